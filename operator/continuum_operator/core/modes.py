"""Memory modes as behaviour of the board: what a board of each mode gives an engine to spend,
where its reserve is kept, and which pools a device part is charged to (docs/design.md rules 1-3,
"Memory modes, defined").

- unified: one pool. Device and host parts together fit what it has left after one reserve
  (`Budget.shared`); the per-process cap bounds the device part only, never the host budget.
- discrete: each GPU's device pool after reserve and others' leases, bounded by the per-process
  cap; the host pool after reserve. Several GPUs split the device part evenly.
- unknown: the host pool is governed; the device is not. Its budget is the declared
  `spec.placement.deviceBudgetBytes` (then checked, still ungoverned) or none; nothing is charged
  to it.

`rules_of(mode)` gives a mode's `ModeRules`; the plan (`core.plan`) takes its budget, reserves
and charged pools from them, the lanes (`core.embed`) their charged pools, and best fit's
pre-filter (`core.prefilter`) the same budget over numpy arrays, by the mode's `DeviceBudget`.
Adding a memory mode is a member of `model.board.MemoryMode` and an entry in `RULES` here
(outside planning: the board's pool check in `model.board` and the readings that mean it in
`core.nodeboard`). Which pool a GPU draws from is the board's (`core.pools.Board.device_view`),
not the mode's. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from continuum_operator.core.plan_reasons import Reason, ReasonCode
from continuum_operator.core.pools import Board, Pool
from continuum_operator.model.board import MemoryMode

__all__ = [
    "RULES",
    "Budget",
    "BudgetAsk",
    "Budgeted",
    "DeviceBudget",
    "ModeRules",
    "rules_of",
]

Available = Callable[[str], int]
"""Bytes a pool has left for the engine beside the other leases (`core.plan` records, once per
pool, that an unsampled one was planned against its capacity)."""


@dataclass(frozen=True, slots=True)
class Budget:
    """What each side may use, net of reserve; None where it is not governed."""

    device: int | None
    host: int | None
    per_process_cap: int | None
    shared: int | None = None  # unified: device and host together


@dataclass(frozen=True, slots=True)
class BudgetAsk:
    """What a budget reads of the engine besides the board."""

    reserve: int  # spec.reserveBytes, kept free in each pool
    gpus: int  # spec.placement.gpus
    declared_device: int | None  # spec.placement.deviceBudgetBytes
    on_gpus: Sequence[int] = ()  # the GPUs a running engine is on, kept where the board has them


@dataclass(frozen=True, slots=True)
class Budgeted:
    """A board's budget for one engine: what each side may use, on which GPUs, whether the
    device part is checked against its budget, and what the mode says of it."""

    budget: Budget
    gpus: tuple[int, ...]
    device_checked: bool
    notes: tuple[Reason, ...] = ()


class DeviceBudget(StrEnum):
    """Where a mode's device budget comes from. The plan's budget (`ModeRules.budget`) and best
    fit's pre-filter (`core.prefilter`, the same arithmetic over numpy arrays) both follow it, so
    a mode of an existing kind needs nothing of either."""

    SHARED_POOL = "sharedPool"
    """The one pool the host part draws on too: one budget for both sides, one reserve (kept
    on the host side, where the pool is counted), the device part capped per process."""
    EACH_GPU = "eachGpu"
    """Each GPU's own pool, after its reserve and bounded by the per-process cap; the host
    pool has a budget and a reserve of its own. Several GPUs split the device part evenly."""
    DECLARED = "declared"
    """Nothing measures the device: its budget is the declared
    `spec.placement.deviceBudgetBytes` (checked, still ungoverned) or none, and nothing is
    charged to it."""


@dataclass(frozen=True, slots=True)
class ModeRules:
    """What one memory mode means for planning and for the lanes' charges."""

    mode: MemoryMode
    device_budget: DeviceBudget
    auto_falls_back_to_host: bool
    """`offload: auto` tries every layer on the host when the most the device budget takes
    leaves too little for the rest. On a unified board both parts share one budget, and the
    host part's graph can cost less than the device part's. Where the host has a budget of its
    own (discrete, unknown) fewer layers on the device only add to the host part, so the retry
    can change a plan only where a receipt measured every-layer-on-the-host smaller; unknown
    boards retry and discrete ones do not, as they always have."""
    governed: bool = field(init=False)
    """Device memory is measured: the plan says `governed`, and device parts are charged."""
    one_pool: bool = field(init=False)
    """Device and host draw on one pool: one reserve, kept on the host side."""

    def __post_init__(self) -> None:
        # Read on every size the plan asks for: kept as fields rather than worked out each time.
        object.__setattr__(self, "governed", self.device_budget is not DeviceBudget.DECLARED)
        object.__setattr__(self, "one_pool", self.device_budget is DeviceBudget.SHARED_POOL)

    def budget(
        self, board: Board, host: Pool, ask: BudgetAsk, available: Available
    ) -> Budgeted | Reason:
        """The budget of each side, or why the board cannot be planned on at all."""
        return _BUDGETS[self.device_budget](board, host, ask, available)

    def reserves(self, reserve: int, gpus: int, uses_device: bool) -> tuple[int, int]:
        """The reserve kept (device side, host side): one per pool the engine draws on."""
        if self.one_pool:
            return 0, reserve
        return (reserve * gpus if uses_device else 0), reserve

    def device_pools(self, board: Board, gpus: Sequence[int]) -> list[str]:
        """The pools a device part on `gpus` is charged to, each once; none where the device is
        not governed. On a unified board that is the one pool the host part is charged to."""
        if not self.governed:
            return []
        views = (board.device_view(g) for g in gpus or (0,))
        return list(dict.fromkeys(v.key for v in views if v is not None))


def _capped(n: int, cap: int | None) -> int:
    return n if cap is None else min(n, cap)


def _shared_pool_budget(board: Board, host: Pool, ask: BudgetAsk, available: Available) -> Budgeted:
    cap = board.per_process_cap_bytes
    pool_left = available(host.key) - ask.reserve
    budget = Budget(
        device=_capped(pool_left, cap), host=pool_left, per_process_cap=cap, shared=pool_left
    )
    return Budgeted(budget, (0,), device_checked=True)


def _chosen_gpus(board: Board, ask: BudgetAsk, available: Available) -> list[Pool] | Reason:
    """The GPUs a running engine is on, where the board has them all and they are as many as
    the spec asks; else the ones with the most available."""
    by_room = sorted(
        (p for p in board.pools.values() if p.device is not None),
        key=lambda p: (-available(p.key), p.device),
    )
    if len(by_room) < ask.gpus:
        return Reason(
            ReasonCode.NOT_ENOUGH_GPUS,
            f"spec.placement.gpus asks for {ask.gpus} GPUs; node {board.node} has {len(by_room)}",
        )
    kept = [board.device_view(g) for g in sorted(set(ask.on_gpus))]
    if len(kept) == ask.gpus and all(p is not None for p in kept):
        return [p for p in kept if p is not None]
    return by_room[: ask.gpus]


def _each_gpu_budget(
    board: Board, host: Pool, ask: BudgetAsk, available: Available
) -> Budgeted | Reason:
    chosen = _chosen_gpus(board, ask, available)
    if isinstance(chosen, Reason):
        return chosen
    cap = board.per_process_cap_bytes
    per_gpu = _capped(min(available(p.key) - ask.reserve for p in chosen), cap)
    budget = Budget(
        device=per_gpu * ask.gpus, host=available(host.key) - ask.reserve, per_process_cap=cap
    )
    notes: tuple[Reason, ...] = ()
    if any(p.coherent for p in chosen):
        notes = (
            Reason(
                ReasonCode.COHERENT_DEVICE,
                "the GPU can address host memory (HMM/ATS); its framebuffer is still planned "
                "as its own pool",
            ),
        )
    gpus = tuple(sorted(p.device for p in chosen if p.device is not None))
    return Budgeted(budget, gpus, device_checked=True, notes=notes)


def _declared_budget(board: Board, host: Pool, ask: BudgetAsk, available: Available) -> Budgeted:
    cap = board.per_process_cap_bytes
    declared = ask.declared_device
    budget = Budget(
        device=None if declared is None else _capped(declared, cap),
        host=available(host.key) - ask.reserve,
        per_process_cap=cap,
    )
    note = Reason(
        ReasonCode.MEMORY_MODE_UNKNOWN,
        f"node {board.node} reports no memory mode ({host.key} pool governed, "
        "device memory ungoverned)",
    )
    return Budgeted(budget, (0,), device_checked=declared is not None, notes=(note,))


BudgetRule = Callable[[Board, Pool, BudgetAsk, Available], "Budgeted | Reason"]

_BUDGETS: dict[DeviceBudget, BudgetRule] = {
    DeviceBudget.SHARED_POOL: _shared_pool_budget,
    DeviceBudget.EACH_GPU: _each_gpu_budget,
    DeviceBudget.DECLARED: _declared_budget,
}

RULES: dict[MemoryMode, ModeRules] = {
    rules.mode: rules
    for rules in (
        ModeRules(MemoryMode.UNIFIED, DeviceBudget.SHARED_POOL, auto_falls_back_to_host=True),
        ModeRules(MemoryMode.DISCRETE, DeviceBudget.EACH_GPU, auto_falls_back_to_host=False),
        ModeRules(MemoryMode.UNKNOWN, DeviceBudget.DECLARED, auto_falls_back_to_host=True),
    )
}


def rules_of(mode: MemoryMode) -> ModeRules:
    return RULES[mode]
