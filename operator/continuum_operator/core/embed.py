"""Embed lanes: where an embedding context resides, what it costs per pool, and its floors.

docs/design.md rule 6: an embedding is charged where it resides. The seed system leased a fixed
1,792 MiB of VRAM for every lane, even where the lane's context lived in host memory; here the
charge follows the backend and the engine beside the lane:

- `Residence.DEVICE` when the backend offloads to a GPU and the engine offloads every layer
  (the lane's layers follow the engine's onto the device);
- `Residence.HOST` when the backend cannot offload, or the engine offloads no layer;
- `Residence.SPLIT` when the engine offloads some layers but not all, or the backend has not
  said whether it offloads: llama.cpp may put any part of the lane's context on either side, so
  each pool is charged its upper bound, the whole context.

`ContextBytes {device, host}` of a context of N tokens come from receipts (the lane runtime's
measured buffers: bytes over tokens, per part) or, until one exists, from the estimate
(`core.compute`). The ledger (`core.pools`) gets one lease per non-empty part, with a floor per
pool at the bytes of the largest context the lane has embedded; a floor never falls while the
lane lives (a calibration pass at that context sets it before the first request).

`place_lane` sizes the lane's lease against a node's ledger: the largest context up to the
lane's maximum that the pools hold, never below its floor and never over-committing a pool.
`admit` decides one request against the lease: fits, waits (the pool holds less than the
request now) or fails (larger than the lane's maximum), with a reason. Pure: no I/O, no clock.
Neighbours: `core.pools` (the ledger), `core.modes` (which pools a device part is charged to),
`core.placements` (leases read off lanes' status), `embed.lane` (the runtime that measures and
serves), `kube.lanes.loop` (writes the placement).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from continuum_operator.core.compute import (
    F16,
    FRAGMENTATION,
    KV_CELL_PAD,
    GraphShape,
    kv_cells_per_sequence,
)
from continuum_operator.core.modes import rules_of
from continuum_operator.core.monotone import last_true
from continuum_operator.core.pools import Board, BoardLeases, ConsumerKind, Lease
from continuum_operator.core.receipts import BufferKind, Receipt, is_host_buffer
from continuum_operator.model.engine import KvCacheType, ModelFacts

__all__ = [
    "MAX_PARALLEL_SEQUENCES",
    "Admission",
    "ContextBytes",
    "LaneAsk",
    "LanePlacement",
    "LaneReason",
    "LaneSizer",
    "LaneVerdict",
    "Residence",
    "admit",
    "lane_charges",
    "lane_leases",
    "place_lane",
    "raise_floors",
    "residence",
]

#: llama.cpp's limit on parallel sequences; an embedding context holds min(batch, this).
MAX_PARALLEL_SEQUENCES = 256
F32 = 4


class Residence(StrEnum):
    DEVICE = "device"
    HOST = "host"
    SPLIT = "split"


class LaneVerdict(StrEnum):
    """The outcome of a lane's placement (`place_lane`) or of a request's admission to its lease
    (`admit`), written as EmbedLane `status.placement.verdict`. Ordered as Kueue orders its modes:
    a later one is a better outcome. Not `core.bestfit.NodeVerdict`, a node's for an Engine."""

    FAILS = "Fails"
    WAITS = "Waits"
    FITS = "Fits"


class LaneReason(StrEnum):
    DEVICE_RESIDENT = "DeviceResident"
    HOST_BACKEND = "HostOnlyBackend"
    ENGINE_ON_HOST = "EngineOnHost"
    SPLIT_ENGINE = "SplitEngine"
    BACKEND_UNREPORTED = "BackendUnreported"
    DEVICE_UNGOVERNED = "DeviceUngoverned"
    RECEIPT_USED = "ReceiptUsed"
    ESTIMATED = "Estimated"
    AT_MAX_CONTEXT = "AtMaxContext"
    LIMITED_BY_POOL = "LimitedByPool"
    POOL_UNSAMPLED = "PoolUnsampled"
    POOL_BUSY = "PoolBusy"
    INSUFFICIENT_MEMORY = "InsufficientMemory"
    NO_POOL = "NoPool"
    CONTEXT_TOO_LARGE = "ContextTooLarge"
    NOT_PLACED = "NotPlaced"
    FITS = "Fits"


def residence(
    *, backend_offloads: bool | None, layers_on_device: int, total_layers: int
) -> tuple[Residence, LaneReason]:
    """Where the lane's context lives, from the backend and the engine beside it (rule 6)."""
    if layers_on_device <= 0:
        return Residence.HOST, LaneReason.ENGINE_ON_HOST
    if backend_offloads is False:
        return Residence.HOST, LaneReason.HOST_BACKEND
    if backend_offloads is None:
        return Residence.SPLIT, LaneReason.BACKEND_UNREPORTED
    if layers_on_device >= total_layers:
        return Residence.DEVICE, LaneReason.DEVICE_RESIDENT
    return Residence.SPLIT, LaneReason.SPLIT_ENGINE


@dataclass(frozen=True, slots=True, order=True)
class ContextBytes:
    """Bytes of one lane context per side: what the device and the host each hold."""

    device: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host

    def covers(self, other: ContextBytes) -> bool:
        return self.device >= other.device and self.host >= other.host


def context_cells(tokens: int) -> int:
    """The cells a lane context of `tokens` holds (llama.cpp pads to 256)."""
    return kv_cells_per_sequence(tokens)


@dataclass(frozen=True, slots=True)
class LaneSizer:
    """ContextBytes of a lane at a context, from receipts when they exist, else the estimate.

    A receipt at a context of at least N tokens bounds the bytes at N (a context's buffers grow
    with it), so the smallest such receipt answers. Above every receipt, the largest receipt's
    bytes over its tokens are scaled per part, and never taken below the estimate (attention's
    mask grows with the square of the micro-batch, faster than the rate).
    """

    facts: ModelFacts
    receipts: tuple[Receipt, ...] = ()
    kv_cache_type: KvCacheType = KvCacheType.F16

    def estimate(self, tokens: int) -> ContextBytes:
        """llama.cpp's buffers for an embedding context of `tokens`, as one backend holds them:
        the KV cells, the graph of one micro-batch of the whole context (an embedding is one
        batch) and the output buffer (logits and embeddings per sequence, on the host)."""
        cells = context_cells(tokens)
        num, den = self.kv_cache_type.bytes_ratio_to_f16
        kv = sum(-(-k * num // den) for k in self.facts.kv_f16_list()) * cells
        shape = GraphShape.of(self.facts)
        sequences = min(cells, MAX_PARALLEL_SEQUENCES)
        output = sequences * (shape.vocab + shape.n_embd) * F32
        return ContextBytes(device=0, host=kv + embedding_graph_bytes(shape, cells) + output)

    def measured(self, tokens: int) -> ContextBytes | None:
        usable = sorted(self.receipts, key=lambda r: r.context_tokens)
        if not usable:
            return None
        # Receipts are filed by the cells llama.cpp made (`context_tokens` = cells), and a
        # context of `tokens` makes `context_cells(tokens)`: scaled by cells, not tokens.
        cells = context_cells(tokens)
        for r in usable:
            if r.context_tokens >= cells:
                return _receipt_parts(r)
        top = usable[-1]
        parts = _receipt_parts(top)
        n = top.context_tokens
        scaled = ContextBytes(-(-parts.device * cells // n), -(-parts.host * cells // n))
        est = self.estimate(tokens).total
        if scaled.total >= est:
            return scaled
        # Where the rate falls short of the estimate, the estimate's excess goes to the side
        # that holds most of the context.
        extra = est - scaled.total
        if scaled.device > scaled.host:
            return ContextBytes(scaled.device + extra, scaled.host)
        return ContextBytes(scaled.device, scaled.host + extra)

    def bytes_at(self, tokens: int) -> tuple[ContextBytes, LaneReason]:
        """The lane's context bytes per side, and whether a receipt or the estimate said so."""
        measured = self.measured(tokens)
        if measured is not None:
            return measured, LaneReason.RECEIPT_USED
        return self.estimate(tokens), LaneReason.ESTIMATED


#: Rows of slack on the embedding graph: inputs (tokens, positions, KV indices, output ids) and
#: the allocator's alignment; fitted to receipts of generated embedding models (see below).
EMBEDDING_SLACK_ROWS = 64


def embedding_graph_bytes(shape: GraphShape, cells: int) -> int:
    """The compute buffer of an embedding pass over `cells` tokens in one micro-batch.

    As `core.compute.graph_bytes` with flash attention, except the output phase: every token
    is an output in embedding mode, so the logits are `vocab` rows of the whole batch, and mean
    pooling adds its `tokens x sequences` matrix while the mask is still live. The output phase
    is the mask, the logits, 5 rows of n_embd (the residual, the norm, the embeddings and their
    pooled copy) and the pooling matrix. Checked against llama.cpp's receipts of generated
    embedding models (tests/e2e/test_embed_llama.py): never under, and within 30% of the whole
    context's bytes.
    """
    e, f, v = shape.n_embd, shape.n_ff, shape.vocab
    q = shape.n_head * shape.head_k
    kv = shape.n_head_kv * (shape.head_k + shape.head_v)
    mask = cells * F16 / F32  # in f32 rows of the batch
    mean = min(cells, MAX_PARALLEL_SEQUENCES)
    attention = mask + FRAGMENTATION * (4 * e + 2 * q + kv)
    ffn = mask + FRAGMENTATION * (3 * f + 4 * e)
    output = mask + v + 5 * e + mean
    rows = max(attention, ffn, output) + EMBEDDING_SLACK_ROWS
    return int(rows * cells * F32)


def _receipt_parts(r: Receipt) -> ContextBytes:
    """A receipt's context buffers (KV, compute, output) per side; weights are not context."""
    kinds = (BufferKind.KV, BufferKind.RECURRENT, BufferKind.COMPUTE, BufferKind.OUTPUT)
    device = sum(b.bytes for b in r.buffers if b.kind in kinds and not is_host_buffer(b.device))
    host = sum(b.bytes for b in r.buffers if b.kind in kinds and is_host_buffer(b.device))
    return ContextBytes(device=device, host=host)


def lane_charges(
    board: Board, where: Residence, gpus: Sequence[int], cb: ContextBytes
) -> dict[str, int]:
    """Bytes per pool for a context of `cb` bytes residing `where` on `board`.

    Device residence charges the device part to each of the engine's GPUs (an upper bound when
    the engine spans several) and the host part to the host; host residence charges the whole
    context to the host; a split charges the whole context to each side (each pool's upper
    bound). Device and host views of a unified board are one pool: a part charged to one is
    not charged again to the other, and a split there is charged once. On a board of unknown
    memory mode the device is not governed and is charged nothing. Which pools a device part
    is charged to is the mode's (`core.modes.ModeRules.device_pools`), as for an engine's plan.
    """
    host_view = board.host_view()
    if host_view is None:
        return {}
    out: dict[str, int] = {}

    def charge(pool: str, n: int, *, upper_bound: bool) -> None:
        if n <= 0:
            return
        out[pool] = max(out.get(pool, 0), n) if upper_bound else out.get(pool, 0) + n

    total = cb.total
    device_pools = rules_of(board.memory_mode).device_pools(board, gpus)
    if where is Residence.HOST:
        charge(host_view.key, total, upper_bound=False)
    elif where is Residence.DEVICE:
        # An estimate (or a host-only receipt) says nothing of sides: the context is device-side.
        if cb.device == 0:
            device_part, host_part = total, 0
        else:
            device_part, host_part = cb.device, cb.host
        for pool in device_pools:
            charge(pool, device_part, upper_bound=False)
        charge(host_view.key, host_part, upper_bound=False)
    else:
        for pool in device_pools:
            charge(pool, total, upper_bound=True)
        charge(host_view.key, total, upper_bound=True)
    return out


@dataclass(frozen=True, slots=True)
class LaneAsk:
    """What one lane asks of one node: everything `place_lane` reads besides the ledger."""

    consumer: str
    max_context_tokens: int
    largest_embedded_tokens: int = 0
    floors: Mapping[str, int] = field(default_factory=dict)  # the floors it holds already
    weights_bytes: int = 0  # a lane with a model of its own holds its weights too


@dataclass(frozen=True, slots=True)
class LanePlacement:
    """Where a lane resides, what it holds per pool, and why."""

    consumer: str
    node: str
    verdict: LaneVerdict
    reason: LaneReason
    message: str
    residence: Residence
    residence_reason: LaneReason
    source: LaneReason  # RECEIPT_USED or ESTIMATED
    context_tokens: int  # the context the lease holds (0 when none)
    context_bytes: ContextBytes
    charges: Mapping[str, int]
    floors: Mapping[str, int]
    floor_tokens: int

    def leases(self) -> list[Lease]:
        return lane_leases(self.consumer, self.node, self.charges, self.floors)

    def to_dict(self) -> dict[str, object]:
        """The placement as EmbedLane `status.placement` holds it."""
        pools = sorted(set(self.charges) | set(self.floors))
        return {
            "node": self.node,
            "verdict": str(self.verdict),
            "reason": str(self.reason),
            "message": self.message,
            "residence": str(self.residence),
            "residenceReason": str(self.residence_reason),
            "bytesSource": "receipt" if self.source is LaneReason.RECEIPT_USED else "estimate",
            "contextTokens": self.context_tokens,
            "floorTokens": self.floor_tokens,
            "contextBytes": {"device": self.context_bytes.device, "host": self.context_bytes.host},
            "pools": [
                {
                    "pool": p,
                    "bytes": self.charges.get(p, 0),
                    "floorBytes": self.floors.get(p, 0),
                }
                for p in pools
            ],
        }


def lane_leases(
    consumer: str, node: str, charges: Mapping[str, int], floors: Mapping[str, int]
) -> list[Lease]:
    """One lease per non-empty part; a floor the lane holds is leased even while it waits."""
    leases = []
    for pool in sorted(set(charges) | set(floors)):
        n = max(charges.get(pool, 0), floors.get(pool, 0))
        if n > 0:
            leases.append(
                Lease(consumer, ConsumerKind.EMBED_LANE, node, pool, n, floors.get(pool, 0))
            )
    return leases


def raise_floors(floors: Mapping[str, int], charges: Mapping[str, int]) -> dict[str, int]:
    """Floors never fall: each pool's floor is the larger of the old one and the new charge."""
    out = dict(floors)
    for pool, n in charges.items():
        out[pool] = max(out.get(pool, 0), n)
    return {p: n for p, n in out.items() if n > 0}


@dataclass(frozen=True, slots=True)
class _Contexts:
    """Contexts worth leasing, ascending: whole multiples of llama.cpp's padding from the floor,
    then the max. Computed per index, never listed: a lane of 16M tokens has 65,536 steps, and
    the bisection reads some 17 of them (a list of them all cost 0.1 s a lane a board a pass)."""

    steps: range
    most: int

    @classmethod
    def of(cls, floor_tokens: int, max_tokens: int) -> _Contexts:
        return cls(range(context_cells(max(1, floor_tokens)), max_tokens, KV_CELL_PAD), max_tokens)

    def __len__(self) -> int:
        return len(self.steps) + 1

    def __getitem__(self, i: int) -> int:
        return self.steps[i] if i < len(self.steps) else self.most


#: A context tried: its tokens, bytes per side, charges per pool, and what said so.
_Sized = tuple[int, ContextBytes, dict[str, int], LaneReason]


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What `place_lane` decided, before it is dressed as a `LanePlacement`."""

    verdict: LaneVerdict
    reason: LaneReason
    message: str
    tokens: int = 0
    context_bytes: ContextBytes = field(default_factory=ContextBytes)
    charges: Mapping[str, int] = field(default_factory=dict)
    source: LaneReason = LaneReason.ESTIMATED


@dataclass(frozen=True, slots=True)
class _LaneFit:
    """One lane's contexts against one node's ledger: what each costs per pool, and whether
    every pool it charges holds it beside the other leases (crediting the lane's own)."""

    board: Board
    ledger: BoardLeases
    ask: LaneAsk
    sizer: LaneSizer
    where: Residence
    gpus: Sequence[int]
    tried: dict[int, tuple[str | None, _Sized]] = field(default_factory=dict)

    def sized(self, tokens: int) -> tuple[ContextBytes, LaneReason]:
        cb, source = self.sizer.bytes_at(tokens)
        weights = self.ask.weights_bytes
        if weights <= 0:
            return cb, source
        # Weights sit where the context does: the host part on the host, else the device part.
        if self.where is Residence.HOST:
            return ContextBytes(cb.device, cb.host + weights), source
        return ContextBytes(cb.device + weights, cb.host), source

    def charges(self, cb: ContextBytes) -> dict[str, int]:
        return lane_charges(self.board, self.where, self.gpus, cb)

    def blocking(self, charges: Mapping[str, int]) -> str | None:
        """The first pool that cannot take its charge now; None when every pool can."""
        for pool, n in charges.items():
            if pool not in self.board.pools:
                return pool
            have = self.ledger.available_bytes(pool, crediting=self.ask.consumer)
            if have is None or n > have:
                return pool
        return None

    def attempt(self, tokens: int) -> tuple[str | None, _Sized]:
        """Whether a context of `tokens` fits (the pool blocking it, or None), and its sizes."""
        if tokens not in self.tried:
            cb, source = self.sized(tokens)
            charges = self.charges(cb)
            self.tried[tokens] = (self.blocking(charges), (tokens, cb, charges, source))
        return self.tried[tokens]


def place_lane(
    board: Board,
    ledger: BoardLeases,
    ask: LaneAsk,
    sizer: LaneSizer,
    *,
    where: Residence,
    residence_reason: LaneReason,
    gpus: Sequence[int] = (),
) -> LanePlacement:
    """The lane's lease on `board`: the largest context up to its maximum that every charged
    pool holds beside the other leases, crediting the lane's own lease; never below its floor.

    Fits: a lease of at least the floor context (the largest embedded, or the first context
    step). Waits: a pool is unsampled, or holds less than the floor now. Fails: a pool's
    capacity less the floors of every other lease cannot hold the smallest context at all.
    """
    lane = _LaneFit(board, ledger, ask, sizer, where, gpus)
    floor_tokens = max(1, ask.largest_embedded_tokens)
    floors = dict(ask.floors)
    if ask.largest_embedded_tokens > 0:
        # The lane holds this context already (its calibration pass allocated it).
        floors = raise_floors(floors, lane.charges(lane.sized(floor_tokens)[0]))
    if board.host_view() is None:
        outcome = _Outcome(
            LaneVerdict.WAITS,
            LaneReason.NO_POOL,
            f"node {board.node}'s board reports no host pool yet",
        )
    else:
        contexts = _Contexts.of(floor_tokens, ask.max_context_tokens)
        outcome = _largest_context(lane, contexts)
    return LanePlacement(
        consumer=ask.consumer,
        node=board.node,
        verdict=outcome.verdict,
        reason=outcome.reason,
        message=outcome.message,
        residence=where,
        residence_reason=residence_reason,
        source=outcome.source,
        context_tokens=outcome.tokens,
        context_bytes=outcome.context_bytes,
        charges=dict(outcome.charges),
        floors=floors,
        floor_tokens=ask.largest_embedded_tokens,
    )


def _largest_context(lane: _LaneFit, contexts: _Contexts) -> _Outcome:
    """The largest of `contexts` that fits (bytes grow with the context: by bisection), or why
    not even the smallest does."""
    last = last_true(0, len(contexts) - 1, lambda i: lane.attempt(contexts[i])[0] is None)
    if last is None:
        blocked = lane.attempt(contexts[0])[0]
        assert blocked is not None
        return _not_placed(lane, contexts[0], blocked)
    tokens, cb, charges, source = lane.attempt(contexts[last])[1]
    where, most = lane.where, lane.ask.max_context_tokens
    if tokens >= most:
        message = f"{tokens} tokens ({where}): the lane's whole spec.maxContextTokens"
        reason = LaneReason.AT_MAX_CONTEXT
        return _Outcome(LaneVerdict.FITS, reason, message, tokens, cb, charges, source)
    blocked = lane.attempt(contexts[last + 1])[0] if last + 1 < len(contexts) else None
    message = (
        f"{tokens} of up to {most} tokens ({where}): pool {blocked} holds no more beside the "
        "other leases; larger requests wait"
    )
    return _Outcome(
        LaneVerdict.FITS, LaneReason.LIMITED_BY_POOL, message, tokens, cb, charges, source
    )


def _not_placed(lane: _LaneFit, tokens: int, blocked: str) -> _Outcome:
    """Why a context of `tokens` does not fit pool `blocked`: never (fails) or not now (waits)."""
    board, consumer = lane.board, lane.ask.consumer
    cb, source = lane.sized(tokens)
    blocked_pool = board.pools.get(blocked)
    if blocked_pool is None:
        message = f"node {board.node} has no pool {blocked} for a lane residing on the {lane.where}"
        return _Outcome(LaneVerdict.FAILS, LaneReason.NO_POOL, message, 0, cb, {}, source)
    others_floor = sum(
        lease.floor_bytes
        for lease in lane.ledger.leases
        if lease.pool == blocked and lease.consumer != consumer
    )
    need = lane.charges(cb)[blocked]
    if need > blocked_pool.capacity_bytes - others_floor:
        message = (
            f"a context of {tokens} tokens needs {_mib(need)} in pool {blocked}, whose "
            f"capacity {_mib(blocked_pool.capacity_bytes)} less the floors of other consumers "
            f"({_mib(others_floor)}) can never hold it; lower spec.maxContextTokens or place "
            "the lane beside another engine"
        )
        return _Outcome(
            LaneVerdict.FAILS, LaneReason.INSUFFICIENT_MEMORY, message, 0, cb, {}, source
        )
    have = lane.ledger.available_bytes(blocked, crediting=consumer)
    if have is None:
        message = (
            f"pool {blocked} on {board.node} has not been measured yet; the lane waits for "
            "the node agent's first reading"
        )
        return _Outcome(LaneVerdict.WAITS, LaneReason.POOL_UNSAMPLED, message, 0, cb, {}, source)
    message = (
        f"a context of {tokens} tokens needs {_mib(need)} in pool {blocked}, which has "
        f"{_mib(have)} available beside the other leases; the lane waits for room"
    )
    return _Outcome(LaneVerdict.WAITS, LaneReason.POOL_BUSY, message, 0, cb, {}, source)


@dataclass(frozen=True, slots=True)
class Admission:
    verdict: LaneVerdict
    reason: LaneReason
    message: str
    tokens: int


def admit(
    request_tokens: Iterable[int], *, max_context_tokens: int, leased_context_tokens: int
) -> Admission:
    """One embedding request against the lane's lease: the largest input decides.

    Fails when an input is larger than the lane's maximum (no lease could ever hold it), waits
    when it is larger than the context the pool holds for the lane now, fits otherwise. A lane
    never runs a context larger than its lease, so it never over-commits its pool.
    """
    tokens = max(request_tokens, default=0)
    if tokens > max_context_tokens:
        return Admission(
            LaneVerdict.FAILS,
            LaneReason.CONTEXT_TOO_LARGE,
            f"an input of {tokens} tokens is larger than the lane's spec.maxContextTokens "
            f"({max_context_tokens}); split it, or raise maxContextTokens",
            tokens,
        )
    if leased_context_tokens <= 0:
        return Admission(
            LaneVerdict.WAITS,
            LaneReason.NOT_PLACED,
            "the lane holds no lease yet (status.placement); waiting for the operator to place it",
            tokens,
        )
    if tokens > leased_context_tokens:
        return Admission(
            LaneVerdict.WAITS,
            LaneReason.POOL_BUSY,
            f"an input of {tokens} tokens needs more than the {leased_context_tokens} tokens "
            "the pool holds for the lane now; waiting for room",
            tokens,
        )
    return Admission(LaneVerdict.FITS, LaneReason.FITS, f"{tokens} tokens fit the lease", tokens)


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"
