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

The plan is not run on every node: `core.prefilter` works out what it would decide on every
board at once (numpy), and only the best node is planned exactly (`Fleet`); every node's
verdict is planned when it is read. Neighbours: `core.plan` (one plan on one board),
`core.prefilter`, `core.placements` (leases from placements).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from continuum_operator.core.plan import ServingPlan, SizeTable, plan
from continuum_operator.core.plan_reasons import ReasonCode
from continuum_operator.core.pools import Board, BoardLeases, Lease
from continuum_operator.core.prefilter import NO_BUDGET, Boards, Kind, kind_of, outcome
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
    MPS_ONE_GPU = "MpsOneGpu"
    UNSCHEDULABLE = "Unschedulable"


@dataclass(frozen=True, slots=True)
class NodeView:
    """One node as the snapshot sees it."""

    board: Board
    fresh: bool
    labels: Mapping[str, str] = field(default_factory=dict)
    node_exists: bool = True
    backing_off: bool = False  # a pod never started here recently
    mps_shared: bool = False
    """The node's GPUs are shared by NVIDIA MPS (`--gpu-sharing auto` on a board offering MPS
    and not HAMi): the device plugin gives an MPS client one GPU, so an engine of several
    GPUs cannot run here (`kube.workloads.gpu_env.gpu_sharing_refusal` says the same of `mps`)."""


@dataclass(frozen=True, slots=True)
class NodeVerdict:
    """One node's outcome in an Engine's best fit: excluded (and why) or planned, with its plan.
    Not `core.embed.LaneVerdict`, the ordered outcome of a lane's placement or a request."""

    node: str
    excluded: Exclusion | None
    message: str
    plan: ServingPlan | None = None

    @property
    def why(self) -> str:
        """The verdict's group in a summary: its exclusion, or for a node planned and found
        unschedulable the plan's last reason (the one that decided); "Fits" for a fit."""
        if self.excluded is Exclusion.UNSCHEDULABLE and self.plan is not None and self.plan.reasons:
            return str(self.plan.reasons[-1].code)
        return str(self.excluded) if self.excluded is not None else FITS


FITS = "Fits"


Why = tuple[str, Exclusion | None, str]
"""One node's line in the summary of an Engine that fits nowhere (`core.unfit`): the node, its
exclusion, and its group (`NodeVerdict.why`). A plain tuple: a summary makes one per node."""


def closest_of(verdicts: Iterable[NodeVerdict]) -> NodeVerdict | None:
    """The node planned and found unschedulable with the smallest shortfall (those without
    one last), by name among equals; None when no node was planned."""

    def key(v: NodeVerdict) -> tuple[int, int, str]:
        short = v.plan.shortfall_bytes if v.plan is not None else None
        return (1 if short is None else 0, short or 0, v.node)

    planned = [v for v in verdicts if v.excluded is Exclusion.UNSCHEDULABLE]
    return min(planned, key=key) if planned else None


class Decision:
    """The plan chosen (None: no node fits), and a verdict for every node looked at, in the
    nodes' order.

    A decision made with the pre-filter (`Fleet.choose`) plans the nodes it did not need only
    when `verdicts` is read (`continuum place` prints them node by node); the operator reads
    them only for an Engine that fits nowhere, through `whys` and `closest`, which the
    pre-filter answers from its own figures and one plan (`core.unfit`). `plans` is how many
    exact plans the choice ran."""

    __slots__ = ("_closest", "_verdicts", "_whys", "chosen", "plans")

    def __init__(
        self,
        chosen: ServingPlan | None,
        verdicts: tuple[NodeVerdict, ...] | Callable[[], tuple[NodeVerdict, ...]],
        *,
        plans: int = 0,
        whys: Callable[[], tuple[Why, ...]] | None = None,
        closest: Callable[[], NodeVerdict | None] | None = None,
    ) -> None:
        self.chosen = chosen
        self.plans = plans
        self._verdicts = verdicts
        self._whys = whys
        self._closest = closest

    @property
    def verdicts(self) -> tuple[NodeVerdict, ...]:
        if callable(self._verdicts):
            self._verdicts = self._verdicts()
        return self._verdicts

    def whys(self) -> tuple[Why, ...]:
        """Each node's exclusion and group, in the nodes' order (as its verdict says)."""
        if self._whys is not None:
            return self._whys()
        return tuple((v.node, v.excluded, v.why) for v in self.verdicts)

    def closest(self) -> NodeVerdict | None:
        """The verdict of the closest node (`closest_of` of the verdicts)."""
        if self._closest is not None:
            return self._closest()
        return closest_of(self.verdicts)

    @property
    def fresh_candidates(self) -> int:
        return sum(
            1 for _, excluded, _ in self.whys() if excluded in (None, Exclusion.UNSCHEDULABLE)
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


def leftover_bytes(p: ServingPlan, ledger: BoardLeases, *, crediting: str | None = None) -> int:
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
    prefilter: bool = True,
) -> Decision:
    """The best-fit node for an Engine not yet placed, and a verdict for every node.

    `prefilter` False plans every candidate node exactly, as before the pre-filter: the same
    choice and verdicts, at a plan per node (tests compare the two)."""
    return Fleet(nodes, leases).choose(spec, facts, receipts=receipts, prefilter=prefilter)


class Fleet:
    """One snapshot's nodes and the leases on them, read once to choose for many engines.

    `choose` (the function) reads them anew for each Engine, as the operator's snapshot changes
    with every placement; bench/plan.py keeps one `Fleet` for its stateless fleet of engines.
    The pre-filter's arrays (`core.prefilter.Boards`) are built on the first choice that uses
    them."""

    def __init__(self, nodes: Iterable[NodeView], leases: Sequence[Lease]) -> None:
        self.views = sorted(nodes, key=lambda v: v.board.node)
        on: dict[str, list[Lease]] = {}  # by node once: not every lease read for every node
        for lease in leases:
            on.setdefault(lease.node, []).append(lease)
        # What excludes a node whatever the Engine, and the ledger of each node that may be
        # planned on (its selectors aside).
        self.late = [_late(view) for view in self.views]
        self.ledgers = [
            BoardLeases.of(view.board, on.get(view.board.node, ()))
            if view.node_exists and late is None
            else None
            for view, late in zip(self.views, self.late, strict=True)
        ]
        self._unplannable = np.array([x is None for x in self.ledgers], dtype=np.bool_)
        self._mps_shared = np.array([v.mps_shared for v in self.views], dtype=np.bool_)
        self._labelled: dict[tuple[tuple[str, str], ...], list[int]] | None = None
        self._rows: _Rows | None = None
        self._open_rows: npt.NDArray[np.bool_] | None = None

    def exclusion(self, spec: EngineSpec, i: int) -> tuple[Exclusion, str] | None:
        """Why node i is no candidate for this Engine, in the order the reasons are read;
        None where it is one."""
        view = self.views[i]
        # Whether the Node exists first: a missing one has no labels to match.
        if not view.node_exists:
            return Exclusion.NO_NODE, "has a board but no Node object"
        mismatch = matches(spec, view.labels)
        if mismatch is not None:
            what = (
                "spec.placement.nodeSelector"
                if mismatch is Exclusion.SELECTOR_MISMATCH
                else (f"spec.placement.nodePool (label {NODE_POOL_LABEL})")
            )
            return mismatch, f"does not match {what}"
        if view.mps_shared and spec.placement.gpus > 1:
            return Exclusion.MPS_ONE_GPU, _MPS_ONE_GPU_MESSAGE
        late = self.late[i]
        if late is not None:
            return late, _LATE_MESSAGES[late]
        return None

    def excluded(self, spec: EngineSpec) -> npt.NDArray[np.bool_]:
        """Which nodes are no candidates for this Engine (`exclusion` is not None), at once:
        the selectors are matched once per distinct set of labels."""
        excluded = self._unplannable
        if spec.placement.gpus > 1:
            excluded = excluded | self._mps_shared
        if not spec.placement.node_selector and spec.placement.node_pool is None:
            return excluded
        if self._labelled is None:
            self._labelled = {}
            for i, view in enumerate(self.views):
                self._labelled.setdefault(tuple(sorted(view.labels.items())), []).append(i)
        excluded = excluded.copy()
        for labels, nodes in self._labelled.items():
            if matches(spec, dict(labels)) is not None:
                excluded[nodes] = True
        return excluded

    def choose(
        self,
        spec: EngineSpec,
        facts: ModelFacts,
        *,
        receipts: Sequence[Receipt] = (),
        prefilter: bool = True,
    ) -> Decision:
        """The best-fit node for an Engine not yet placed (see `choose`)."""
        if not prefilter:
            return self.exact(spec, facts, receipts)
        sizes = SizeTable(spec, facts, receipts)
        if not sizes.fits_int64(spec.minds.max):  # bytes past int64's reach: plan each node
            return self.exact(spec, facts, receipts)
        return _Prefiltered(self, spec, facts, receipts, sizes).decide()

    def exact(self, spec: EngineSpec, facts: ModelFacts, receipts: Sequence[Receipt]) -> Decision:
        """Every candidate node planned exactly: the choice without the pre-filter."""
        verdicts: list[NodeVerdict] = []
        ranked: list[tuple[tuple[int, int, int, str], ServingPlan]] = []
        # Nodes alike (the same pools, usage and leased bytes) get the same plan but for its
        # node: planned once. A cluster of many nodes of a few kinds has few distinct ones.
        alike: dict[tuple[object, ...], ServingPlan] = {}
        plans = 0
        for i, view in enumerate(self.views):
            node = view.board.node
            excluded = self.exclusion(spec, i)
            if excluded is not None:
                verdicts.append(NodeVerdict(node, *excluded))
                continue
            ledger = self.ledgers[i]
            assert ledger is not None
            shape = None if receipts else _shape(view.board, ledger.leases)
            known = alike.get(shape) if shape is not None else None
            if known is not None:
                p = replace(known, node=node)
            else:
                p = plan(view.board, spec, facts, ledger, receipts=receipts)
                plans += 1
                if shape is not None and node not in repr(p.reasons):  # no message names the node
                    alike[shape] = p
            verdict = _verdict(p)
            verdicts.append(verdict)
            if verdict.excluded is None:
                ranked.append((rank(p, leftover_bytes(p, ledger)), p))
        chosen = min(ranked, key=lambda r: r[0])[1] if ranked else None
        return Decision(chosen, tuple(verdicts), plans=plans)

    def candidate_rows(self, excluded: npt.NDArray[np.bool_]) -> npt.NDArray[np.bool_]:
        """Which pre-filter rows are candidates, given the nodes `excluded` (kept for the
        Engines without selectors, which all share the one answer)."""
        if excluded is self._unplannable:
            if self._open_rows is None:
                self._open_rows = ~excluded[self.rows().node]
            return self._open_rows
        return ~excluded[self.rows().node]

    def rows(self) -> _Rows:
        """The pre-filter's rows, built once: the nodes that may be planned on and that it
        reads exactly (`prefilter.kind_of`); the others are planned exactly."""
        if self._rows is None:
            read: list[int] = []
            unread: list[int] = []
            ledgers: list[BoardLeases] = []
            kinds: list[Kind] = []
            for i, ledger in enumerate(self.ledgers):
                if ledger is None:
                    continue
                kind = kind_of(ledger.board)
                if kind is None:
                    unread.append(i)
                else:
                    read.append(i)
                    ledgers.append(ledger)
                    kinds.append(kind)
            row_of = np.full(len(self.views), -1, dtype=np.int64)
            row_of[read] = np.arange(len(read))
            boards = Boards(ledgers, kinds)
            self._rows = _Rows(boards, np.asarray(read, dtype=np.int64), row_of, tuple(unread))
        return self._rows


@dataclass(frozen=True, slots=True)
class _Rows:
    boards: Boards
    node: npt.NDArray[np.int64]  # each row's node (its index in `Fleet.views`)
    row_of: npt.NDArray[np.int64]  # each node's row, -1 where none
    unread: tuple[int, ...]  # nodes that may be planned on, not read by the pre-filter


_LATE_MESSAGES: Mapping[Exclusion, str] = {
    Exclusion.BOARD_STALE: "board is stale (its node Lease expired)",
    Exclusion.BACKING_OFF: "an engine pod never started here recently",
}


_MPS_ONE_GPU_MESSAGE = (
    "shares its GPUs by MPS (--gpu-sharing auto): NVIDIA's device plugin gives an MPS client "
    "one GPU (it refuses a request above 1 unless its MPS config sets "
    "failRequestsGreaterThanOne: false); set spec.placement.gpus to 1, or place this engine "
    "where GPUs are not shared by MPS (spec.placement.nodeSelector)"
)


def _late(view: NodeView) -> Exclusion | None:
    """Why a node that exists and matches is still no candidate: its board, its pods."""
    if not view.fresh:
        return Exclusion.BOARD_STALE
    if view.backing_off:
        return Exclusion.BACKING_OFF
    return None


def _verdict(p: ServingPlan) -> NodeVerdict:
    """A candidate node's verdict from its plan."""
    if not p.schedulable:
        why = p.reasons[-1].message if p.reasons else "unschedulable"
        return NodeVerdict(p.node, Exclusion.UNSCHEDULABLE, why, p)
    return NodeVerdict(
        p.node,
        None,
        f"fits {p.layers_on_device}/{p.total_layers} layers on device, {p.minds_grantable} minds",
        p,
    )


class _Prefiltered:
    """One Engine's choice through the pre-filter (`core.prefilter`): every board's outcome in
    numpy, the exact plan of the best only, and the nodes it does not read planned exactly."""

    def __init__(
        self,
        fleet: Fleet,
        spec: EngineSpec,
        facts: ModelFacts,
        receipts: Sequence[Receipt],
        sizes: SizeTable,
    ) -> None:
        self.fleet, self.spec, self.facts, self.receipts = fleet, spec, facts, receipts
        self.sizes = sizes
        self.plans = 0
        self.rows = fleet.rows()
        self.excluded = fleet.excluded(spec)
        self.outcome = outcome(self.rows.boards, sizes, spec)
        self.candidate = fleet.candidate_rows(self.excluded)  # by row
        self.exact = {i: self._plan(i) for i in self.rows.unread if not self.excluded[i]}
        self.reasons: tuple[list[str], list[int]] | None = None

    def _plan(self, i: int) -> ServingPlan:
        self.plans += 1
        ledger = self.fleet.ledgers[i]
        assert ledger is not None
        return plan(
            ledger.board, self.spec, self.facts, ledger, receipts=self.receipts, sizes=self.sizes
        )

    def _node(self, i: int) -> str:
        return self.fleet.views[i].board.node

    def decide(self) -> Decision:
        o = self.outcome
        best: tuple[tuple[int, int, int, str], int] | None = None
        first = o.best(self.candidate)
        if first is not None:
            i = int(self.rows.node[first.row])
            key = (0 if first.gpu_servable else 1, -first.minds, first.leftover, self._node(i))
            best = (key, i)
        for i, p in self.exact.items():
            ledger = self.fleet.ledgers[i]
            if p.schedulable and ledger is not None:
                exact = rank(p, leftover_bytes(p, ledger))
                if best is None or exact < best[0]:
                    best = (exact, i)
        chosen = None
        if best is not None:
            key, i = best
            chosen = self.exact.get(i)
            if chosen is None:
                chosen = self._plan(i)
                ledger = self.fleet.ledgers[i]
                assert ledger is not None
                # The pre-filter's figures are the plan's; were they ever not, its choice could
                # be another node's: the exact plan of every node decides instead.
                if not chosen.schedulable or rank(chosen, leftover_bytes(chosen, ledger)) != key:
                    return self._everyone()
        return Decision(
            chosen,
            lambda: self._everyone().verdicts,
            plans=self.plans,
            whys=self.whys,
            closest=self.closest,
        )

    def _everyone(self) -> Decision:
        return self.fleet.exact(self.spec, self.facts, self.receipts)

    def _reasons(self) -> tuple[list[str], list[int]]:
        """Each row's group (its plan's last reason code) and shortfall (-1: none), where it
        is not schedulable."""
        if self.reasons is not None:
            return self.reasons
        boards = self.rows.boards
        short = self.outcome.shortfalls()
        codes = short.code
        for r in np.flatnonzero(boards.kind == Kind.NO_HOST).tolist():
            codes[r] = str(ReasonCode.NO_HOST_POOL)
        few = (boards.kind == Kind.DISCRETE) & (boards.gpus < self.spec.placement.gpus)
        for r in np.flatnonzero(few).tolist():
            codes[r] = str(ReasonCode.NOT_ENOUGH_GPUS)
        self.reasons = (codes, short.shortfall.tolist())
        return self.reasons

    def whys(self) -> tuple[Why, ...]:
        codes, _ = self._reasons()
        row_of, excluded = self.rows.row_of.tolist(), self.excluded.tolist()
        schedulable = self.outcome.schedulable.tolist()
        out: list[Why] = []
        for i, view in enumerate(self.fleet.views):
            node, row = view.board.node, row_of[i]
            exclusion = self.fleet.exclusion(self.spec, i) if excluded[i] else None
            if exclusion is not None:
                out.append((node, exclusion[0], str(exclusion[0])))
            elif i in self.exact:
                v = _verdict(self.exact[i])
                out.append((node, v.excluded, v.why))
            elif schedulable[row]:
                out.append((node, None, FITS))
            else:
                out.append((node, Exclusion.UNSCHEDULABLE, codes[row]))
        return tuple(out)

    def closest(self) -> NodeVerdict | None:
        """`closest_of` the verdicts, from the pre-filter's shortfalls.

        The summary of an Engine that fits nowhere names the closest node (the smallest
        shortfall, then the name) with its plan's own message. The pre-filter has every
        board's shortfall exactly as the plan has it (at the level the plan tries first), so
        the closest is known without a plan and only that node is planned, for its message.
        Its plan is checked against the pre-filter's figures; were they ever not the same,
        every node would be planned instead, as before the pre-filter."""
        codes, shortfall = self._reasons()
        keys: list[tuple[int, int, str, int]] = []
        for i, p in self.exact.items():
            if not p.schedulable:
                short = p.shortfall_bytes
                keys.append((1 if short is None else 0, short or 0, p.node, i))
        refused = np.flatnonzero(~self.outcome.schedulable & self.candidate)
        if len(refused):
            # The rows are in the nodes' order: argmin takes the first name of equals, and
            # the rows without a shortfall (-1) come last.
            shorts = np.asarray(shortfall)[refused]
            r = int(refused[np.argmin(np.where(shorts < 0, NO_BUDGET, shorts))])
            i, s = int(self.rows.node[r]), shortfall[r]
            keys.append((1 if s < 0 else 0, max(s, 0), self._node(i), i))
        if not keys:
            return None
        *_, i = min(keys)
        p = self.exact.get(i) or self._plan(i)
        v = _verdict(p)
        if i not in self.exact:
            r = int(self.rows.row_of[i])
            expected = None if shortfall[r] < 0 else shortfall[r]
            if v.excluded is None or p.shortfall_bytes != expected or v.why != codes[r]:
                return closest_of(self._everyone().verdicts)
        return v
