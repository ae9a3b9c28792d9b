"""Which node an Engine goes to: the best fit among fresh boards (docs/design.md "Placement").

The operator hands in a snapshot (every node's board, whether its Lease is fresh, its labels,
the leases others hold) and gets back a typed decision: the chosen plan, and a verdict for every
node it looked at: `core.unfit` summarises them for an unschedulable Engine's condition, and
`continuum place` prints them node by node. Pure: no API, no clock.

Ranking, best first:
1. plans that put every layer on the device (the spec's full ask of the GPU);
2. more minds grantable (up to `minds.max`);
3. the tightest fit: the fewest bytes left over in the pools the plan charges, so that large
   nodes stay free for large engines (best fit, as bin packers do);
4. the node's name, so a replay decides the same.
Neighbours: `core.plan` (one plan on one board), `core.placements` (leases from placements).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from continuum_operator.core.plan import ServingPlan, plan
from continuum_operator.core.pools import Board, Lease, Ledger
from continuum_operator.core.receipts import Receipt
from continuum_operator.model.engine import EngineSpec, ModelFacts

NODE_POOL_LABEL = "continuum.dev/node-pool"


class Exclusion(StrEnum):
    """Why a node was not a candidate at all (before any plan was tried)."""

    SELECTOR_MISMATCH = "SelectorMismatch"
    NODE_POOL_MISMATCH = "NodePoolMismatch"
    NO_NODE = "NoNode"
    BOARD_STALE = "BoardStale"
    BACKING_OFF = "BackingOff"
    UNSCHEDULABLE = "Unschedulable"


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the snapshot sees it."""

    board: Board
    fresh: bool
    labels: Mapping[str, str] = field(default_factory=dict)
    node_exists: bool = True
    backing_off: bool = False  # a pod never started here recently


@dataclass(frozen=True, slots=True)
class Verdict:
    node: str
    excluded: Exclusion | None
    message: str
    plan: ServingPlan | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    chosen: ServingPlan | None
    verdicts: tuple[Verdict, ...]

    @property
    def fresh_candidates(self) -> int:
        return sum(
            1 for v in self.verdicts if v.excluded is None or v.excluded is Exclusion.UNSCHEDULABLE
        )


def with_unmeasured(board: Board, assumed: Iterable[Lease]) -> Board:
    """The board as if leases not yet resident were already measured.

    The ledger takes available as capacity - max(leased, used): measured usage is read as
    possibly the leased engines' own. That holds for engines that run, not for an assumed lease
    whose pod has not started: its bytes are in no measurement yet, so the usage already
    measured is someone else's. Adding the assumed bytes to the usage keeps a second engine from
    being placed into memory the first one is about to load.
    """
    extra: dict[str, int] = {}
    for lease in assumed:
        if lease.node == board.node and lease.pool in board.pools:
            extra[lease.pool] = extra.get(lease.pool, 0) + lease.bytes
    if not extra:
        return board
    pools = {
        key: (
            replace(pool, used_bytes=min(pool.capacity_bytes, pool.used_bytes + extra[key]))
            if key in extra and pool.used_bytes is not None
            else pool
        )
        for key, pool in board.pools.items()
    }
    return replace(board, pools=pools)


def matches(spec: EngineSpec, labels: Mapping[str, str]) -> Exclusion | None:
    for key, value in spec.placement.node_selector.items():
        if labels.get(key) != value:
            return Exclusion.SELECTOR_MISMATCH
    pool = spec.placement.node_pool
    if pool is not None and labels.get(NODE_POOL_LABEL) != pool:
        return Exclusion.NODE_POOL_MISMATCH
    return None


def leftover_bytes(p: ServingPlan, ledger: Ledger, *, crediting: str | None = None) -> int:
    """Bytes the charged pools would still have free after this plan: smaller is tighter."""
    left = 0
    for pool, charge in p.charges:
        available = ledger.available_bytes(pool, crediting=crediting)
        if available is None:
            available = ledger.board.pools[pool].capacity_bytes - ledger.leased_bytes(pool)
        left += max(0, available - charge)
    return left


def rank(p: ServingPlan, leftover: int) -> tuple[int, int, int, str]:
    """Sort key: smaller is better."""
    return (0 if p.gpu_servable else 1, -p.minds_grantable, leftover, p.node)


def _shape(board: Board, leases: Sequence[Lease]) -> tuple[object, ...]:
    """What a plan reads of a node, less its name (`plan` is a function of these)."""
    return (
        board.memory_mode,
        board.per_process_cap_bytes,
        tuple(sorted(board.pools.items())),
        tuple(sorted((x.kind, x.pool, x.bytes, x.floor_bytes) for x in leases)),
    )


def choose(
    nodes: Iterable[NodeView],
    spec: EngineSpec,
    facts: ModelFacts,
    leases: Sequence[Lease],
    *,
    receipts: Sequence[Receipt] = (),
) -> Decision:
    """The best-fit node for an Engine not yet placed, and a verdict for every node."""
    verdicts: list[Verdict] = []
    ranked: list[tuple[tuple[int, int, int, str], ServingPlan]] = []
    on: dict[str, list[Lease]] = {}  # by node once: not every lease read for every node
    for lease in leases:
        on.setdefault(lease.node, []).append(lease)
    # Nodes alike (the same pools, usage and leased bytes) get the same plan but for its node:
    # planned once. A cluster of many nodes of a few kinds has few distinct ones.
    alike: dict[tuple[object, ...], ServingPlan] = {}
    for view in sorted(nodes, key=lambda v: v.board.node):
        node = view.board.node
        # Whether the Node exists first: a missing one has no labels to match.
        if not view.node_exists:
            verdicts.append(Verdict(node, Exclusion.NO_NODE, "has a board but no Node object"))
            continue
        mismatch = matches(spec, view.labels)
        if mismatch is not None:
            what = (
                "spec.placement.nodeSelector"
                if mismatch is Exclusion.SELECTOR_MISMATCH
                else (f"spec.placement.nodePool (label {NODE_POOL_LABEL})")
            )
            verdicts.append(Verdict(node, mismatch, f"does not match {what}"))
            continue
        if not view.fresh:
            verdicts.append(
                Verdict(node, Exclusion.BOARD_STALE, "board is stale (its node Lease expired)")
            )
            continue
        if view.backing_off:
            verdicts.append(
                Verdict(node, Exclusion.BACKING_OFF, "an engine pod never started here recently")
            )
            continue
        ledger = Ledger.of(view.board, on.get(node, ()))
        shape = None if receipts else _shape(view.board, ledger.leases)
        known = alike.get(shape) if shape is not None else None
        if known is not None:
            p = replace(known, node=node)
        else:
            p = plan(view.board, spec, facts, ledger, receipts=receipts)
            if shape is not None and node not in repr(p.reasons):  # no message names the node
                alike[shape] = p
        if not p.schedulable:
            why = p.reasons[-1].message if p.reasons else "unschedulable"
            verdicts.append(Verdict(node, Exclusion.UNSCHEDULABLE, why, p))
            continue
        ranked.append((rank(p, leftover_bytes(p, ledger)), p))
        verdicts.append(
            Verdict(
                node,
                None,
                f"fits {p.layers_on_device}/{p.total_layers} layers on device, "
                f"{p.minds_grantable} minds",
                p,
            )
        )
    chosen = min(ranked, key=lambda r: r[0])[1] if ranked else None
    return Decision(chosen, tuple(verdicts))
