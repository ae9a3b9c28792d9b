"""Best fit's pre-filter: what `core.plan` would decide on every board of a fleet, at once.

`core.bestfit.choose` used to run the exact plan on every fresh matching node: a plan per node
per engine, 1,000 plans to place one engine on 1,000 nodes of different usage (docs/performance.md
has the figures). Nearly all of a plan's work is the engine's bytes at
each offload level and number of minds, and those are the same on every board (`SizeTable`);
what differs is the budget they are held against. So the budgets of every board are read once
into numpy arrays (`Boards`), and for one engine `outcome` goes through the plan's stages over
all of them at once, with the plan's own rules and searches:

- the budget of each side net of the reserve, by the mode's `modes.DeviceBudget` (the one pool
  both sides share, each GPU's own pool, or the declared device budget);
- the offload level (`_place_layers`: the most layers the device budget takes at minds.min,
  the fallback to the host where the mode's rules have one, or the level the spec fixes), by the
  same binary search (`monotone.last_true`) or, where the device bytes grow with the level,
  its closed form;
- the minds (`_grantable_minds`: the same binary search, board by board);
- what best fit ranks them by: every layer on the device, the minds, and the bytes the charged
  pools keep free (`bestfit.leftover_bytes`).

A board that cannot take minds.min at the level the plan would try is filtered out: the bytes
it is held to are the plan's own at that level, so the bound is never above what the plan
requires and no board the plan accepts is lost. `bestfit` then runs the exact plan on the best
survivor only, checks that its rank is the one computed here, and otherwise plans every node as
before. For an engine that fits nowhere the same figures give each node's reason and shortfall,
so the summary names the closest node after one exact plan (`core.unfit`).

Boards this module does not model exactly (a mode whose `DeviceBudget` it has no arithmetic
for, pools of unusual names, bytes near int64's range) are left out of `Boards` and planned
exactly by `bestfit`. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from continuum_operator.core.modes import DeviceBudget, rules_of
from continuum_operator.core.plan import SizeTable, disk_park_bytes
from continuum_operator.core.plan_reasons import ReasonCode
from continuum_operator.core.pools import Board, BoardLeases, Pool
from continuum_operator.model.board import PoolKind
from continuum_operator.model.engine import EngineSpec

__all__ = ["NO_BUDGET", "Best", "Boards", "Kind", "Outcome", "Shortfalls", "kind_of", "outcome"]

Int64s = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]
Pred = Callable[[Int64s, Int64s], Bools]
"""A predicate of many rows at once: `pred(rows, x)` of rows `rows`, each at its own x."""

#: Stands for "no budget on this side": above any figure a `SizeTable` computes in int64.
NO_BUDGET = 2**62
#: A board's disk room where it reports no disk pool (a park store on disk is refused there).
NO_DISK = -1


class Kind(IntEnum):
    """How a board is budgeted: its mode's `modes.DeviceBudget`, each named after the mode that
    has it, and a board with no host pool, which the plan refuses before any budget."""

    UNIFIED = 0  # DeviceBudget.SHARED_POOL
    DISCRETE = 1  # DeviceBudget.EACH_GPU
    UNKNOWN = 2  # DeviceBudget.DECLARED
    NO_HOST = 3


def kind_of(board: Board) -> Kind | None:
    """The board's kind where its pools are the ones its mode's budget reads, None otherwise
    (the plan reads those by name: the host view, the device view of each GPU)."""
    pools, cap = board.pools, board.per_process_cap_bytes
    host = board.host_view()
    if host is None:
        return Kind.NO_HOST
    if cap is not None and cap > SizeTable.LIMIT:
        return None
    if any(p.capacity_bytes > SizeTable.LIMIT for p in pools.values()):
        return None
    budget = rules_of(board.memory_mode).device_budget
    disk = pools.get("disk")
    if disk is not None and (disk.kind is not PoolKind.DISK or disk.device is not None):
        return None
    memory = [key for key in pools if key != "disk"]  # the disk pool only holds park stores
    if budget is DeviceBudget.SHARED_POOL:
        # One pool, which both the host view and the device view of any GPU are.
        return Kind.UNIFIED if len(memory) == 1 and board.device_view(0) is host else None
    if host.key != "host" or host.device is not None or "unified" in pools:
        return None
    if budget is DeviceBudget.EACH_GPU:
        for key in memory:
            p = pools[key]
            if key != "host" and (p.device is None or key != f"device/{p.device}"):
                return None  # not the pool `Board.device_view` finds for its GPU
        return Kind.DISCRETE
    return Kind.UNKNOWN if budget is DeviceBudget.DECLARED else None


def _available(ledger: BoardLeases, pool: Pool) -> int:
    """What the plan's budget reads of a pool (`plan._Available`, nothing credited), and what
    `bestfit.leftover_bytes` reads."""
    if not ledger.leases:  # capacity less what is measured (nothing, before a sample)
        return max(0, pool.capacity_bytes - (pool.used_bytes or 0))
    value = ledger.available_bytes(pool.key)
    if value is None:
        return max(0, pool.capacity_bytes - ledger.leased_bytes(pool.key))
    return value


class Boards:
    """The boards of a fleet the pre-filter reads, one row each, in the order given, with what
    each Engine's budgets read of them (`_budgets`) kept by the GPUs it asks for."""

    def __init__(self, ledgers: Sequence[BoardLeases], kinds: Sequence[Kind]) -> None:
        """One row for each board (with the leases on it), of its `kind_of`."""
        hosts: list[int] = []
        disks: list[int] = []
        caps: list[int] = []
        gpu_rows: list[list[int]] = []
        falls_back: list[bool] = []
        for ledger, kind in zip(ledgers, kinds, strict=True):
            board = ledger.board
            falls_back.append(rules_of(board.memory_mode).auto_falls_back_to_host)
            host = board.host_view()
            hosts.append(0 if host is None else _available(ledger, host))
            disk = board.pools.get("disk")
            disks.append(NO_DISK if disk is None else _available(ledger, disk))
            cap = board.per_process_cap_bytes
            caps.append(NO_BUDGET if cap is None else cap)
            if kind is Kind.DISCRETE:
                # `modes._chosen_gpus`: the most available first, then the lowest index
                room = sorted(
                    (-_available(ledger, p), p.device)
                    for p in board.pools.values()
                    if p.device is not None
                )
                gpu_rows.append([-minus for minus, _ in room])
            else:
                gpu_rows.append([])
        most = max(map(len, gpu_rows), default=0)
        gpu_available = np.zeros((len(ledgers), max(1, most)), dtype=np.int64)
        for i, row in enumerate(gpu_rows):
            if row:
                gpu_available[i, : len(row)] = row
        self.kind = np.asarray(kinds, dtype=np.int8)
        self.host_available = np.asarray(hosts, dtype=np.int64)  # the unified pool if unified
        self.disk_available = np.asarray(disks, dtype=np.int64)  # NO_DISK: no disk pool
        self.cap = np.asarray(caps, dtype=np.int64)  # the per-process cap, NO_BUDGET if none
        self.gpus = np.asarray([len(r) for r in gpu_rows], dtype=np.int64)  # discrete
        self.gpu_available = gpu_available  # each board's GPUs, most available first
        self.one_pool = self.kind == Kind.UNIFIED  # both sides draw on the one pool
        self.each_gpu = self.kind == Kind.DISCRETE  # the device on the GPUs' own pools
        self.declared = self.kind == Kind.UNKNOWN  # the device budget only as declared
        self.no_host = self.kind == Kind.NO_HOST
        self.governed = ~self.declared
        # `offload: auto` tries every layer on the host second (`ModeRules`).
        self.falls_back = np.asarray(falls_back, dtype=np.bool_)
        self.every = np.ones(len(ledgers), dtype=np.bool_)  # a declared budget is checked
        self._by_gpus: dict[int, tuple[Int64s, Int64s, Bools, Bools]] = {}

    def __len__(self) -> int:
        return len(self.kind)

    def by_gpus(self, gpus: int) -> tuple[Int64s, Int64s, Bools, Bools]:
        """For an Engine on `gpus` GPUs: what its device budget is drawn from before the reserve
        (discrete: the least available of the GPUs chosen; unified: the one pool), what that
        is multiplied by (the GPUs, on a discrete board), which boards refuse it (no host
        pool, or fewer GPUs), and which of the others check its device budget without a
        declared one (all but unknown boards)."""
        known = self._by_gpus.get(gpus)
        if known is None:
            if gpus <= self.gpu_available.shape[1]:
                weakest = self.gpu_available[:, gpus - 1]
            else:
                weakest = np.zeros(len(self), dtype=np.int64)
            known = self._by_gpus[gpus] = (
                np.where(self.each_gpu, weakest, self.host_available),
                np.where(self.each_gpu, gpus, 1).astype(np.int64),
                refused := self.no_host | (self.each_gpu & (self.gpus < gpus)),
                self.governed & ~refused,
            )
        return known


@dataclass(frozen=True, slots=True)
class _Budgets:
    """Each board's budget for one engine (`modes.Budget`), NO_BUDGET where a side has none."""

    device: Int64s  # NO_BUDGET where the device is not checked
    host: Int64s
    shared: Int64s  # unified: both sides together
    checked: Bools  # the device is checked (`Budgeted.device_checked`)
    #: No budget at all (no host pool, or fewer GPUs than the spec asks), or no room for its
    #: park store on disk (`plan._disk_refusal`, `no_disk`).
    refused: Bools
    checked_open: Bools  # checked and not refused
    no_disk: Bools  # refused for its park store on disk alone

    def take(self, rows: Int64s) -> _Budgets:
        return _Budgets(
            self.device[rows],
            self.host[rows],
            self.shared[rows],
            self.checked[rows],
            self.refused[rows],
            self.checked_open[rows],
            self.no_disk[rows],
        )

    def fits(self, device: Int64s | int, host: Int64s | int) -> Bools:
        """`plan._Fit.fits` of parts of these sizes, board by board."""
        fit: Bools = (device <= self.device) & (host <= self.host) & (device + host <= self.shared)
        return fit

    def column(self) -> _Budgets:
        """The same budgets as a column, to broadcast against a row of minds."""
        return _Budgets(
            self.device[:, None],
            self.host[:, None],
            self.shared[:, None],
            self.checked[:, None],
            self.refused[:, None],
            self.checked_open[:, None],
            self.no_disk[:, None],
        )


def _budgets(boards: Boards, spec: EngineSpec) -> _Budgets:
    """`modes`' budget rules over every board at once: unified, the pool less the reserve for
    both sides (the device part capped); discrete, each side's pool less the reserve, the
    device the least of the GPUs chosen times their number, capped per GPU; unknown, the host's,
    and the device's as declared, checked only then."""
    reserve, declared = spec.reserve_bytes, spec.placement.device_budget_bytes
    drawn, times, refused, governed_open = boards.by_gpus(spec.placement.gpus)
    host = boards.host_available - reserve
    device = np.minimum(drawn - reserve, boards.cap) * times
    if declared is None:
        device = np.where(boards.declared, NO_BUDGET, device)
        checked, checked_open = boards.governed, governed_open
    else:
        device = np.where(boards.declared, np.minimum(declared, boards.cap), device)
        checked, checked_open = boards.every, ~refused
    shared = np.where(boards.one_pool, host, NO_BUDGET)
    # A park store on disk needs the disk pool's room, checked by the plan after the budget.
    disk = disk_park_bytes(spec)
    no_disk = ~refused & (boards.disk_available < disk) if disk else np.zeros_like(refused)
    return _Budgets(
        device, host, shared, checked, refused | no_disk, checked_open & ~no_disk, no_disk
    )


def _search(
    lo: Int64s, hi: Int64s, pred: Pred, grows: bool, *, holds_at_lo: bool = False
) -> Int64s:
    """`plan._search` of each row's range, question for question the same search: pred at hi
    first where the bytes `grows`, then `monotone.last_true`; -1 where it finds nothing.
    `holds_at_lo`: the caller knows pred holds at every lo (last_true's first question)."""
    rows = np.arange(len(lo))
    ok = np.ones(len(lo), dtype=np.bool_) if holds_at_lo else pred(rows, lo)
    lo, hi = lo.copy(), hi.copy()
    if grows:
        whole = pred(rows, hi)
        lo[whole] = hi[whole]
        ok |= whole
    searching = ok & (lo < hi)
    while searching.any():
        at = rows[searching]
        mid = (lo[at] + hi[at] + 1) // 2
        p = pred(at, mid)
        lo[at] = np.where(p, mid, lo[at])
        hi[at] = np.where(p, hi[at], mid - 1)
        searching[at] = lo[at] < hi[at]
    return np.where(ok, lo, -1)


@dataclass(frozen=True, slots=True)
class Shortfalls:
    """For the boards that cannot take the engine: the plan's last reason code and its
    shortfall (`ServingPlan.shortfall_bytes`, -1 where the plan has none)."""

    code: list[str]
    shortfall: Int64s


class Best(NamedTuple):
    """The row best fit ranks first, and what it is ranked by (`bestfit.rank`)."""

    row: int
    gpu_servable: bool
    minds: int
    leftover: int  # `bestfit.leftover_bytes` of its plan


@dataclass(frozen=True, slots=True)
class _Layers:
    """The layer stage on every board (`plan._place_layers`)."""

    schedulable: Bools  # minds.min fits at some level tried
    gpu_servable: Bools
    level: Int64s  # the offload level chosen, where schedulable
    tried: Int64s  # the offload level tried first (the plan's `_Layers.level` where none fits)


class Outcome:
    """What the plan decides of one engine on each board, row for row with `Boards`, worked
    out as far as asked: `best` needs the layer stage only where no board takes every layer on
    the device, and the minds and the bytes left over only of the boards that can still rank
    first; `shortfalls` (an engine that fits nowhere) needs every board's."""

    def __init__(self, boards: Boards, sizes: SizeTable, spec: EngineSpec) -> None:
        self.boards, self.sizes, self.spec = boards, sizes, spec
        self.budgets = _budgets(boards, spec)
        self.total = sizes.layers + 1
        self._layers: _Layers | None = None

    @property
    def layers(self) -> _Layers:
        if self._layers is None:
            self._layers = _place_layers(self.boards, self.sizes, self.spec, self.budgets)
        return self._layers

    @property
    def schedulable(self) -> Bools:
        return self.layers.schedulable

    def _open_to_all_layers(self) -> Bools | None:
        """The boards where the plan puts every layer on the device wherever minds.min fits
        there: with offload auto, those that check a device budget (the device's bytes grow
        with the level, so its search stops at the last where that fits), with a level fixed
        at the last, every board that budgets at all; none for a lower level. None where the
        layer stage must be run (a receipt at minds.min: the device's bytes may not grow)."""
        offload, b = self.spec.offload, self.budgets
        if offload == "auto":
            return b.checked_open if self.sizes.grows_with_level(self.spec.minds.min) else None
        if offload == "all" or (isinstance(offload, int) and offload >= self.total):
            return ~b.refused
        return np.zeros(len(self.boards), dtype=np.bool_)

    def best(self, among: Bools) -> Best | None:
        """The row best fit ranks first among the rows `among` (`bestfit.rank`: every layer
        on the device, then more minds, then less left over, then the name: the rows are in
        the nodes' order, and argmin takes the first of equals); None where none is."""
        spec, total, b, sizes = self.spec, self.total, self.budgets, self.sizes
        lo, hi = spec.minds.min, spec.minds.max
        open_ = self._open_to_all_layers()
        if open_ is not None:
            open_ = open_ & among
            if lo < hi and sizes.grows_with_minds(lo, hi):
                # Most engines fit whole somewhere: every layer and minds.max rank first, and
                # where minds.max fits so does minds.min (the bytes grow with the minds).
                device, host = sizes.at(total, hi)
                most = open_ & b.fits(device, host)
                if most.any():
                    rows = np.flatnonzero(most)
                    return self._least_left(rows, total, hi, device, host, True)
            device, host = sizes.at(total, lo)
            if (servable := open_ & b.fits(device, host)).any():
                # Every layer on the device ranks first; those boards plan the last level.
                return self._at_one_level(servable, total, True)
            offload = spec.offload
            if offload == "all" or (isinstance(offload, int) and offload >= total):
                return None  # the level fixed is the last: schedulable is servable there
            if offload != "auto":
                # A level the spec fixes is every board's: minds.min fits there or nowhere.
                fixed = 0 if offload == "none" else int(offload)
                device, host = sizes.at(fixed, lo)
                fit = among & ~b.refused & b.fits(device, host)
                return self._at_one_level(fit, fixed, False) if fit.any() else None
        layers = self.layers
        rows = np.flatnonzero(among & layers.schedulable)
        if len(rows) == 0:
            return None
        servable_rows = rows[layers.gpu_servable[rows]]
        gpu_servable = len(servable_rows) > 0
        if gpu_servable:
            rows = servable_rows
        level = layers.level[rows]
        minds, device_at, host_at = _minds(sizes, spec, level, b.take(rows))
        top = minds == minds.max()
        rows, level, device_at, host_at = rows[top], level[top], device_at[top], host_at[top]
        return self._least_left(rows, level, minds[top], device_at, host_at, gpu_servable)

    def _at_one_level(self, fit: Bools, level: int, gpu_servable: bool) -> Best:
        """`best` among the boards `fit`, where the plan takes minds.min at one level."""
        sizes, b = self.sizes, self.budgets
        lo, hi = self.spec.minds.min, self.spec.minds.max
        if lo == hi:
            device, host = sizes.at(level, lo)
            return self._least_left(np.flatnonzero(fit), level, lo, device, host, gpu_servable)
        if not sizes.grows_with_minds(lo, hi):  # the plan's search itself, board by board
            rows = np.flatnonzero(fit)
            at = np.full(len(rows), level, dtype=np.int64)
            minds, device_at, host_at = _minds(sizes, self.spec, at, b.take(rows))
            top = minds == minds.max()
            return self._least_left(
                rows[top], level, minds[top], device_at[top], host_at[top], gpu_servable
            )
        # Bytes that grow with the minds: the plan's search finds the most minds that fit, so
        # the boards where the most fit are those where minds.max fits, or else those whose
        # budgets take the most of the bytes at each number of minds.
        device, host = sizes.at(level, hi)
        most = fit & b.fits(device, host)
        if most.any():
            return self._least_left(np.flatnonzero(most), level, hi, device, host, gpu_servable)
        rows = np.flatnonzero(fit)
        every = np.arange(lo, hi + 1, dtype=np.int64)
        device_at, host_at = sizes.in_use(np.full(len(every), level, dtype=np.int64), every)
        fitting = np.minimum(
            np.minimum(
                np.searchsorted(device_at, b.device[rows], side="right"),
                np.searchsorted(host_at, b.host[rows], side="right"),
            ),
            np.searchsorted(device_at + host_at, b.shared[rows], side="right"),
        )
        count = int(fitting.max())  # at least 1: minds.min fits on every board of `fit`
        rows = rows[fitting == count]
        m = lo + count - 1
        return self._least_left(
            rows, level, m, int(device_at[m - lo]), int(host_at[m - lo]), gpu_servable
        )

    def _least_left(
        self,
        rows: Int64s,
        level: Int64s | int,
        minds: Int64s | int,
        device: Int64s | int,
        host: Int64s | int,
        gpu_servable: bool,
    ) -> Best:
        """Of rows that rank equal so far, the one whose plan leaves the least."""
        leftover = _leftover(self.boards, rows, level, device, host, self.spec)
        k = int(np.argmin(leftover))
        m = minds if isinstance(minds, int) else int(minds[k])
        return Best(int(rows[k]), gpu_servable, m, int(leftover[k]))

    def shortfalls(self) -> Shortfalls:
        """The reason and shortfall of every row (meaningful where not schedulable), as
        `plan._does_not_fit` and `_Fit.shortfall` give them at the level tried first."""
        b, spec = self.budgets, self.spec
        device, host = self.sizes.in_use(self.layers.tried, spec.minds.min)
        offload_short = (spec.offload != "auto") & ~(device <= b.device)
        over = np.maximum(
            np.maximum(np.where(b.checked, device - b.device, 0), host - b.host),
            np.where(b.shared < NO_BUDGET, device + host - b.shared, 0),
        )
        shortfall = np.where(b.refused, -1, np.maximum(over, 0))
        offload, memory = str(ReasonCode.OFFLOAD_DOES_NOT_FIT), str(ReasonCode.INSUFFICIENT_MEMORY)
        codes = [offload if short else memory for short in offload_short.tolist()]
        no_pool = self.boards.disk_available == NO_DISK
        for r in np.flatnonzero(b.no_disk).tolist():
            codes[r] = str(ReasonCode.NO_DISK_POOL if no_pool[r] else ReasonCode.INSUFFICIENT_DISK)
        return Shortfalls(codes, shortfall)


#: The most cells (boards x numbers of minds) the minds are sized on at once; past it, the
#: plan's binary search is run on every board at once instead.
GRID_CELLS = 1 << 16


def outcome(boards: Boards, sizes: SizeTable, spec: EngineSpec) -> Outcome:
    """What `core.plan.plan` decides of `spec` on every board (see the module). The boards with
    no budget at all (`_Budgets.refused`) come out not schedulable; their reason is the
    caller's to read off the board (`Kind.NO_HOST`, the GPUs)."""
    return Outcome(boards, sizes, spec)


def _place_layers(boards: Boards, sizes: SizeTable, spec: EngineSpec, b: _Budgets) -> _Layers:
    """`plan._place_layers` on every board: the level tried first, and the one that fits."""
    n, total, lo_minds = len(boards), sizes.layers + 1, spec.minds.min
    offload = spec.offload
    blind = np.zeros(n, dtype=np.bool_)
    if offload == "auto":
        # offload auto where no device budget is checked offloads nothing (`device_blind`).
        blind = ~b.checked
        levels = np.arange(total + 1, dtype=np.int64)
        dev_at, host_at = sizes.in_use(levels, lo_minds)
        if np.all(dev_at[1:] >= dev_at[:-1]):
            # last_true of a predicate true up to a point is the last x where it holds.
            top = np.searchsorted(dev_at, b.device, side="right").astype(np.int64) - 1
        else:  # a receipt broke the growth: the search itself, as the plan runs it
            top = _search(
                np.zeros(n, dtype=np.int64),
                np.full(n, total, dtype=np.int64),
                _DeviceFits(dev_at, b.device),
                sizes.estimated,
            )
        tried = np.where(blind | (top < 0), 0, top)
        # Where the mode falls back to the host, every layer there is the second try.
        fallback = boards.falls_back & ~blind & (top >= 0)
        fits_tried = b.fits(dev_at[tried], host_at[tried])
        fits_host = b.fits(dev_at[:1], host_at[:1])
        level = np.where(fits_tried, tried, 0)
        schedulable = ~b.refused & (fits_tried | (fallback & fits_host))
    else:
        fixed = 0 if offload == "none" else total if offload == "all" else min(int(offload), total)
        tried = np.full(n, fixed, dtype=np.int64)
        dev_at, host_at = sizes.in_use(np.array([fixed], dtype=np.int64), lo_minds)
        schedulable = ~b.refused & b.fits(dev_at, host_at)
        level = tried
    return _Layers(schedulable, schedulable & (level == total) & ~blind, level, tried)


def _minds(
    sizes: SizeTable, spec: EngineSpec, level: Int64s, b: _Budgets
) -> tuple[Int64s, Int64s, Int64s]:
    """`plan._grantable_minds` on each board at its level (where minds.min fits), and the
    bytes in use (device, host) of that many."""
    lo, hi = spec.minds.min, spec.minds.max
    rows = np.arange(len(level))
    if len(level) * (hi - lo + 1) <= GRID_CELLS:
        every = np.arange(lo, hi + 1, dtype=np.int64)
        device, host = sizes.in_use(level[:, None], every[None, :])
        fit = b.column().fits(device, host)
        if not np.any(fit[:, 1:] & ~fit[:, :-1]):
            # Each board's fit holds up to a point (from minds.min, which fits): the search
            # finds that point.
            found = lo + fit.sum(axis=1) - 1
        else:
            found = _search(
                np.full(len(level), lo, dtype=np.int64),
                np.full(len(level), hi, dtype=np.int64),
                lambda at, x: fit[at, x - lo],
                sizes.estimated,
                holds_at_lo=True,
            )
        return found, device[rows, found - lo], host[rows, found - lo]
    found = _search(
        np.full(len(level), lo, dtype=np.int64),
        np.full(len(level), hi, dtype=np.int64),
        _MindsFit(sizes, level, b),
        sizes.estimated,
        holds_at_lo=True,  # the level was chosen where minds.min fits
    )
    device, host = sizes.in_use(level, found)
    return found, device, host


def _leftover(
    boards: Boards,
    rows: Int64s,
    level: Int64s | int,
    device: Int64s | int,
    host: Int64s | int,
    spec: EngineSpec,
) -> Int64s:
    """`bestfit.leftover_bytes` of the plans on `rows` at `level` with these bytes in use: the
    bytes each charged pool keeps free. The charges are `plan._charges`: the host part (with the
    reserve) to the host view, the device part split evenly over the GPUs chosen; on a unified
    board both in its one pool; on an unknown one nothing on the device."""
    reserve, gpus = spec.reserve_bytes, spec.placement.gpus
    one_pool = boards.one_pool[rows]
    left: Int64s = np.maximum(
        0, boards.host_available[rows] - (host + reserve) - np.where(one_pool, device, 0)
    )
    if disk := disk_park_bytes(spec):  # its park store on disk: the disk pool is charged too
        left += np.maximum(0, boards.disk_available[rows] - disk)
    # `ModeRules.reserves`: one pool keeps one reserve (on the host side); otherwise each GPU
    # used keeps its own. A device part is charged where it has bytes (`plan._charges`).
    if isinstance(level, int) and isinstance(device, int):  # one plan's bytes for every row
        device_own = device + (reserve * gpus if level > 0 else 0)
        if device_own <= 0:
            return left
        discrete = np.flatnonzero(boards.each_gpu[rows])
        share: Int64s | int = -(-device_own // gpus)
    else:
        owns = device + np.where(np.asarray(level) > 0, reserve * gpus, 0)
        discrete = np.flatnonzero(boards.each_gpu[rows] & (owns > 0))
        share = -(-owns[discrete] // gpus)
    if len(discrete):
        chosen = boards.gpu_available[rows[discrete], :gpus]
        left[discrete] += np.maximum(0, chosen - np.reshape(share, (-1, 1))).sum(axis=1)
    return left


@dataclass(frozen=True, slots=True)
class _DeviceFits:
    """The layer search's predicate: the device part at minds.min within the device budget."""

    device_at: Int64s  # by level
    budget: Int64s  # by row

    def __call__(self, rows: Int64s, x: Int64s) -> Bools:
        fit: Bools = self.device_at[x] <= self.budget[rows]
        return fit


@dataclass(frozen=True, slots=True)
class _MindsFit:
    """The minds search's predicate: the plan at each row's level with x minds fits."""

    sizes: SizeTable
    level: Int64s  # by row
    budgets: _Budgets

    def __call__(self, rows: Int64s, x: Int64s) -> Bools:
        device, host = self.sizes.in_use(self.level[rows], x)
        return self.budgets.take(rows).fits(device, host)
