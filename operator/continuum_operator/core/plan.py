"""The serving plan: how an Engine runs on one node, as a pure function of its inputs.

`plan(board, engine, facts, ledger)` decides layers on the device and the size of the KV pool
(docs/design.md rule 4). Policy: the most layers on the device that still leave room for
`minds.min` contexts, then the pool grows toward `minds.max`. Layers are counted as llama.cpp
counts `--n-gpu-layers`: the output layer plus the repeating layers, the output layer first
(`-ngl j` puts the output layer and the last j - 1 repeating layers on the device, as
llama.cpp's `i_gpu_start = n_layer + 1 - n_gpu_layers` does; seen on an H200: `-ngl 4` of 8
layers logged "offloading output layer to GPU", "offloading 3 repeating layers"); token
embeddings stay on the host.

Bytes are what llama.cpp allocates for the engine's arguments: KV cells per sequence padded to
256 as llama.cpp pads them (one stream per mind: `--parallel` without `--kv-unified`), window
layers at their window's cells, and the compute and output buffers of `core.compute`. Where a
receipt (`core.receipts`) exists for the same model digest, context, KV type, placement and
build, its measured buffers replace the estimate, and the plan says so: `source` is `receipt`
and `receipt` holds the one used (docs/design.md rule 5), otherwise `source` is `estimate`.

`plan()` runs in stages: the budget, which the board's memory mode gives (`core.modes`: what
each side may spend, the GPUs, the reserve, the pools charged; rules 1-3), the layers on the
device, the KV pool (minds), and the result with its reasons. Where no device budget is checked
(an unknown mode with no declared `placement.deviceBudgetBytes`) `offload: auto` offloads
nothing; an explicit offload is honoured unaccounted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from itertools import accumulate, pairwise
from typing import Any

import numpy as np
import numpy.typing as npt

from continuum_operator.core.compute import (
    ComputeEstimate,
    kv_cells_per_sequence,
    window_cells_per_sequence,
)
from continuum_operator.core.modes import Budget, BudgetAsk, Budgeted, ModeRules, rules_of
from continuum_operator.core.monotone import last_true
from continuum_operator.core.plan_reasons import Reason, ReasonCode
from continuum_operator.core.pools import Board, BoardLeases
from continuum_operator.core.receipt_bounds import out_of_bounds
from continuum_operator.core.receipts import (
    LOG_RESOLUTION_BYTES,
    BufferKind,
    Receipt,
    ReceiptBook,
    is_host_buffer,
)
from continuum_operator.model.board import MemoryMode
from continuum_operator.model.engine import EngineSpec, KvCacheType, ModelFacts, ParkTier

__all__ = [
    "Budget",
    "BytesSource",
    "PartBytes",
    "Reason",
    "ReasonCode",
    "ServingPlan",
    "SizeTable",
    "plan",
]


class BytesSource(StrEnum):
    """Where a plan's bytes came from."""

    RECEIPT = "receipt"  # what llama.cpp allocated for this very launch, measured
    ESTIMATE = "estimate"  # computed from the model's facts (`core.compute`)


@dataclass(frozen=True, slots=True)
class PartBytes:
    """Bytes one side (device or host) of a plan puts in its pool."""

    weights: int = 0
    kv: int = 0
    compute: int = 0
    reserve: int = 0
    #: The park store's budget where it lives in this side's pool (spec.park, tier host).
    park: int = 0

    @property
    def in_use(self) -> int:
        """What the engine allocates: checked against budgets, which are net of reserve."""
        return self.weights + self.kv + self.compute + self.park

    @property
    def total(self) -> int:
        return self.in_use + self.reserve


@dataclass(frozen=True, slots=True)
class ServingPlan:
    node: str
    memory_mode: MemoryMode
    governed: bool
    schedulable: bool
    layers_on_device: int
    total_layers: int
    gpu_servable: bool
    pool_tokens: int
    minds_grantable: int
    context_tokens_per_mind: int
    kv_cache_type: KvCacheType
    gpus: tuple[int, ...]
    budget: Budget
    device: PartBytes
    host: PartBytes
    charges: tuple[tuple[str, int], ...]
    engine_args: tuple[str, ...]
    reasons: tuple[Reason, ...] = field(default_factory=tuple)
    receipt: Receipt | None = None
    """The receipt whose buffers are the plan's bytes; None: they are estimated."""
    shortfall_bytes: int | None = None
    """Unschedulable for want of memory: how many bytes the smallest plan asks beyond its
    tightest budget (what "closest node" is ranked by); None otherwise. Not in `to_dict`."""

    @property
    def source(self) -> BytesSource:
        return BytesSource.ESTIMATE if self.receipt is None else BytesSource.RECEIPT

    def to_dict(self) -> dict[str, Any]:
        """The plan as `continuum plan -o json` prints it and Engine `status.plan` holds it."""

        def part(p: PartBytes) -> dict[str, int]:
            return {
                "weights": p.weights,
                "kv": p.kv,
                "compute": p.compute,
                "reserve": p.reserve,
                "park": p.park,
                "total": p.total,
            }

        return {
            "node": self.node,
            "memoryMode": str(self.memory_mode),
            "governed": self.governed,
            "schedulable": self.schedulable,
            "layersOnDevice": self.layers_on_device,
            "totalLayers": self.total_layers,
            "gpuServable": self.gpu_servable,
            "poolTokens": self.pool_tokens,
            "mindsGrantable": self.minds_grantable,
            "contextTokensPerMind": self.context_tokens_per_mind,
            "kvCacheType": str(self.kv_cache_type),
            "gpus": list(self.gpus),
            "budget": {
                "device": self.budget.device,
                "host": self.budget.host,
                "perProcessCap": self.budget.per_process_cap,
                "shared": self.budget.shared,
            },
            "bytes": {"device": part(self.device), "host": part(self.host)},
            "charges": [{"pool": pool, "bytes": n} for pool, n in self.charges],
            "engineArgs": list(self.engine_args),
            "reasons": [{"code": str(r.code), "message": r.message} for r in self.reasons],
            "source": str(self.source),
            "receipt": (
                None
                if self.receipt is None
                else self.receipt.model_dump(mode="json", by_alias=True)
            ),
        }


def host_park_bytes(engine: EngineSpec) -> int:
    """The park store's bytes the engine puts in host memory (spec.park of tier host)."""
    park = engine.park
    return park.bytes if park is not None and park.tier is ParkTier.HOST else 0


def _mib(n: int | None) -> str:
    return "unbounded" if n is None else f"{n / 2**20:,.0f} MiB"


@dataclass(frozen=True, slots=True)
class _Shape:
    """The model's bytes arranged so that any offload level is a few additions."""

    layers: int
    input_bytes: int
    output_bytes: int
    output_host_bytes: int
    # Prefix sums from the last layer backwards: llama.cpp offloads the last layers first.
    tail_weights: tuple[int, ...]
    tail_kv: tuple[int, ...]  # per KV cell, at the engine's KV type: full-context layers
    tail_kv_window: tuple[int, ...]  # the same for sliding-window layers
    total_weights: int
    window: int | None

    @classmethod
    def of(cls, facts: ModelFacts, kv_type: KvCacheType) -> _Shape:
        num, den = kv_type.bytes_ratio_to_f16
        weights = facts.layer_bytes_list()
        # Each layer's K and V rows are whole blocks of the type (q8_0: 34 bytes per 32).
        kv = [-(-k * num // den) for k in facts.kv_f16_list()]
        window = set(facts.sliding_window_layers)
        if window:
            full = [0 if i in window else k for i, k in enumerate(kv)]
            swa = [k if i in window else 0 for i, k in enumerate(kv)]
            tail_swa = (0, *accumulate(reversed(swa)))
        else:  # every layer attends over the whole context
            full, tail_swa = kv, (0,) * (len(kv) + 1)
        tail_w = (0, *accumulate(reversed(weights)))
        return cls(
            layers=facts.layers,
            input_bytes=facts.input_bytes,
            output_bytes=facts.output_bytes,
            output_host_bytes=facts.output_host,
            tail_weights=tail_w,
            tail_kv=(0, *accumulate(reversed(full))),
            tail_kv_window=tail_swa,
            total_weights=tail_w[-1],
            window=facts.sliding_window if window else None,
        )

    def kv_bytes(self, first_layers: int, last_layers: int, context: int, minds: int) -> int:
        """KV bytes of the layers [layers - last_layers, layers - first_layers) at `context`
        tokens per mind, one stream per mind."""
        cells = kv_cells_per_sequence(context)
        full = self.tail_kv[last_layers] - self.tail_kv[first_layers]
        swa = self.tail_kv_window[last_layers] - self.tail_kv_window[first_layers]
        window = window_cells_per_sequence(context, self.window) if self.window else 0
        return (full * cells + swa * window) * minds


@dataclass(frozen=True, slots=True)
class _Sizer:
    """Bytes per side for an offload level j (0..layers+1) and a number of minds.

    `parts` is pure, and the stages ask it of the same (j, minds) more than once: it remembers
    what it answered for the plan it serves."""

    shape: _Shape
    compute: ComputeEstimate
    context_per_mind: int
    reserve: int
    gpus: int
    rules: ModeRules
    kv_type: KvCacheType = KvCacheType.F16
    receipts: ReceiptBook = field(default_factory=ReceiptBook)
    model_sha256: str | None = None
    answered: dict[tuple[int, int], tuple[PartBytes, PartBytes]] = field(
        default_factory=dict, compare=False, repr=False
    )
    computed: dict[int, tuple[int, int, int]] = field(
        default_factory=dict, compare=False, repr=False
    )
    # KV bytes of one mind in the last i layers, both kinds (`_Shape.kv_bytes` at this context).
    kv_per_mind: tuple[int, ...] = ()
    # Receipts of this engine's placements beyond the bound of the estimate (`core.receipt_bounds`):
    # not in `receipts`, and why, for the plan's reasons.
    refused: tuple[Reason, ...] = ()
    # The park store's bytes in host memory (spec.park of tier host; on a unified node the
    # one pool): a fixed part of the host side, whatever the level and the minds.
    park_host: int = 0

    @classmethod
    def of(
        cls, facts: ModelFacts, engine: EngineSpec, rules: ModeRules, receipts: ReceiptBook
    ) -> _Sizer:
        """The sizer of `engine`, planning from the receipts within the bound of its estimate."""
        estimate = cls._estimating(facts, engine, rules, receipts.llama_build)
        if not receipts.receipts:
            return estimate
        kept: list[Receipt] = []
        refused: list[Reason] = []
        for r in receipts.receipts:
            why = estimate.beyond_bound(r)
            if why is None:
                kept.append(r)
            else:
                refused.append(Reason(ReasonCode.RECEIPT_REFUSED, receipt_refusal(r, why)))
        book = ReceiptBook(tuple(kept), receipts.llama_build)
        return replace(estimate, receipts=book, refused=tuple(refused), answered={})

    def beyond_bound(self, r: Receipt) -> str | None:
        """Why receipt `r` of this engine's model, context and KV type stands beyond the bound
        of the estimate of its own placement (`core.receipt_bounds`); None when it does not, or
        when it is of another engine (a lookup never finds it)."""
        j, m = r.placement.layers_on_device, r.parallel
        ours = (
            r.model_sha256 == self.model_sha256
            and r.kv_cache_type is self.kv_type
            and r.context_tokens == m * self.context_per_mind
            and 0 <= j <= self.shape.layers + 1
        )
        if not ours:
            return None
        dev_r, host_r = self.rules.reserves(self.reserve, self.gpus, j > 0)
        measured = _measured(r, dev_r, host_r)
        return out_of_bounds(_by_part(measured), _by_part(self._parts(j, m)))

    @classmethod
    def _estimating(
        cls, facts: ModelFacts, engine: EngineSpec, rules: ModeRules, llama_build: str | None
    ) -> _Sizer:
        shape = _Shape.of(facts, engine.kv_cache_type)
        ctx = engine.context_tokens_per_mind
        cells = kv_cells_per_sequence(ctx)
        window = window_cells_per_sequence(ctx, shape.window) if shape.window else 0
        return cls(
            shape=shape,
            kv_per_mind=tuple(
                full * cells + swa * window
                for full, swa in zip(shape.tail_kv, shape.tail_kv_window, strict=True)
            )
            if window
            else tuple(full * cells for full in shape.tail_kv),
            compute=ComputeEstimate(facts),
            context_per_mind=engine.context_tokens_per_mind,
            reserve=engine.reserve_bytes,
            gpus=engine.placement.gpus,
            rules=rules,
            kv_type=engine.kv_cache_type,
            receipts=ReceiptBook((), llama_build),
            model_sha256=engine.model.sha256,
            park_host=host_park_bytes(engine),
        )

    @property
    def estimated(self) -> bool:
        """No receipt can replace the estimate: every figure is `_parts`' arithmetic."""
        return not self.receipts.receipts

    def receipt(self, j: int, minds: int) -> Receipt | None:
        if not self.receipts.receipts:
            return None
        return self.receipts.find(
            model_sha256=self.model_sha256,
            context_tokens=minds * self.context_per_mind,
            kv_cache_type=self.kv_type,
            layers_on_device=j,
            gpus=self.gpus,
            parallel=minds,
            # llama.cpp clamps its micro-batch to the context (n_ubatch <= n_batch <= n_ctx), so
            # an engine of a context under 512 files its receipt under the smaller one.
            micro_batch_tokens=self.compute.micro_batch_of(
                kv_cells_per_sequence(self.context_per_mind), minds
            ),
            flash_attention=True,
        )

    def parts(self, j: int, minds: int) -> tuple[PartBytes, PartBytes]:
        answer = self.answered.get((j, minds))
        if answer is None:
            answer = self.answered[(j, minds)] = self._parts(j, minds)
        return answer

    def compute_terms(self, minds: int) -> tuple[int, int, int]:
        """The compute terms of `minds` minds, whatever the level: one backend's graph, the
        host's graph inputs, the output buffer (each read once per plan, not once per level)."""
        terms = self.computed.get(minds)
        if terms is None:
            c, ctx = self.compute, self.context_per_mind
            terms = self.computed[minds] = (
                c.graph_bytes(ctx, minds),
                c.host_input_bytes(ctx, minds),
                c.output_bytes(minds),
            )
        return terms

    def _parts(self, j: int, minds: int) -> tuple[PartBytes, PartBytes]:
        s = self.shape
        # The output layer is offloaded first, then repeating layers from the last (module doc).
        output_on_device = j > 0
        on_device = min(max(j - 1, 0), s.layers)
        uses_device = j > 0
        dev_r, host_r = self.rules.reserves(self.reserve, self.gpus, uses_device)
        receipt = self.receipt(j, minds)
        if receipt is not None:
            device, host = _measured(receipt, dev_r, host_r)
            return device, replace(host, park=self.park_host)
        graph, host_input, output = self.compute_terms(minds)
        dev_w = s.tail_weights[on_device] + (s.output_bytes if output_on_device else 0)
        host_w = s.input_bytes + s.total_weights - s.tail_weights[on_device]
        if not output_on_device:
            host_w += s.output_host_bytes
        dev_kv = self.kv_per_mind[on_device] * minds
        host_kv = (self.kv_per_mind[s.layers] - self.kv_per_mind[on_device]) * minds
        # Each backend that runs layers reserves its own graph; several GPUs each hold one. The
        # host always holds the logits (output buffer) and, with every layer offloaded, the
        # graph's inputs (token embeddings are looked up on the host).
        dev_c = graph * self.gpus if uses_device else 0
        host_graph = graph if on_device < s.layers else host_input
        host_c = host_graph + output
        device = PartBytes(weights=dev_w, kv=dev_kv, compute=dev_c, reserve=dev_r)
        host = PartBytes(
            weights=host_w, kv=host_kv, compute=host_c, reserve=host_r, park=self.park_host
        )
        return device, host


def vet_receipts(
    engine: EngineSpec,
    facts: ModelFacts,
    receipts: Sequence[Receipt],
    llama_build: str | None = None,
) -> tuple[tuple[Receipt, ...], tuple[Reason, ...]]:
    """The receipts `engine`'s plans may use, and why the others are not: they stand beyond
    the bound of the estimate (`core.receipt_bounds`); what `plan` lists as `ReceiptRefused`,
    whatever the board (the bound is of bytes, not of budgets)."""
    if not receipts:
        return (), ()
    book = ReceiptBook(tuple(receipts), llama_build)
    sizer = _Sizer.of(facts, engine, rules_of(MemoryMode.DISCRETE), book)
    return sizer.receipts.receipts, sizer.refused


def _by_part(sides: tuple[PartBytes, PartBytes]) -> dict[str, dict[str, int]]:
    return {
        name: {"weights": p.weights, "kv": p.kv, "compute": p.compute}
        for name, p in zip(("device", "host"), sides, strict=True)
    }


def receipt_refusal(r: Receipt, why: str) -> str:
    """A refused receipt's reason, in words: which receipt, why, and what holds instead."""
    source = f" ({r.source[:200]})" if r.source else ""
    return (
        f"receipt of {r.llama_build[:64]} at {r.context_tokens} tokens, "
        f"{r.placement.layers_on_device} layers on {r.placement.gpus} GPU(s), {r.parallel} "
        f"minds{source} not planned from: {why}; the estimate stands. A receipt this far from "
        "the estimate is a forged or misread report, or a model the estimate does not describe "
        "(docs/receipts.md)"
    )


def _measured(receipt: Receipt, dev_r: int, host_r: int) -> tuple[PartBytes, PartBytes]:
    """Bytes per side from a receipt, each buffer rounded up by the log's resolution."""

    def side(kinds: tuple[BufferKind, ...], host: bool) -> int:
        buffers = [
            b for b in receipt.buffers if b.kind in kinds and is_host_buffer(b.device) == host
        ]
        return sum(b.bytes + LOG_RESOLUTION_BYTES for b in buffers)

    compute = (BufferKind.COMPUTE, BufferKind.OUTPUT)
    per_sequence = (BufferKind.KV, BufferKind.RECURRENT)  # each slot's memory, either way
    device = PartBytes(
        weights=side((BufferKind.MODEL,), False),
        kv=side(per_sequence, False),
        compute=side(compute, False),
        reserve=dev_r,
    )
    host = PartBytes(
        weights=side((BufferKind.MODEL,), True),
        kv=side(per_sequence, True),
        compute=side(compute, True),
        reserve=host_r,
    )
    return device, host


Int64s = npt.NDArray[np.int64]


class SizeTable:
    """An engine's bytes in use on each side (weights, KV, compute: what budgets are checked
    against) at many offload levels and numbers of minds at once, as numpy arrays: the same
    figures as the plan's own (`_Sizer.parts`, receipts included). No board changes them, only
    the budget they are held against, so best fit's pre-filter (`core.prefilter`) reads them
    once per engine for a whole fleet. The arithmetic is `_Sizer._parts` term by term, over
    arrays: a change to one is a change to the other (tests/unit/core/test_bestfit_prefilter.py
    holds them equal)."""

    #: The most bytes a figure may reach to be computed in int64 with room to add and
    #: multiply (by the GPUs of an engine, at most 64); `fits_int64` says whether it does.
    LIMIT = 2**55

    def __init__(
        self,
        engine: EngineSpec,
        facts: ModelFacts,
        receipts: Sequence[Receipt] = (),
        llama_build: str | None = None,
    ) -> None:
        # Bytes in use do not depend on the memory mode (its rules set only the reserves,
        # which are not in use): any mode's rules size them.
        sizer = _Sizer.of(
            facts, engine, rules_of(MemoryMode.DISCRETE), ReceiptBook(tuple(receipts), llama_build)
        )
        s = sizer.shape
        self._sizer = sizer
        self.layers = s.layers
        self._asked = max(engine.reserve_bytes, engine.placement.device_budget_bytes or 0)
        self._least_minds = engine.minds.min
        self._cells = kv_cells_per_sequence(sizer.context_per_mind)
        self._arrays: tuple[Int64s, Int64s] | None = None
        self._graphs: dict[int, tuple[int, int]] = {}
        self._measured: dict[tuple[int, int], tuple[int, int]] = {}
        for r in sizer.receipts.receipts:
            j, m = r.placement.layers_on_device, r.parallel
            ours = r.model_sha256 == sizer.model_sha256 and m >= 1 and 0 <= j <= s.layers + 1
            if ours and sizer.receipt(j, m) is not None:
                device, host = sizer.parts(j, m)
                self._measured[(j, m)] = (device.in_use, host.in_use)

    @property
    def shape(self) -> _Shape:
        return self._sizer.shape

    def _tails(self) -> tuple[Int64s, Int64s]:
        """The weights and the KV bytes of one mind of the last i layers, as arrays."""
        if self._arrays is None:
            sizer = self._sizer
            self._arrays = (
                np.asarray(sizer.shape.tail_weights, dtype=np.int64),
                np.asarray(sizer.kv_per_mind, dtype=np.int64),
            )
        return self._arrays

    def sizer(self, rules: ModeRules) -> _Sizer:
        """The plan's sizer of this engine under a mode's rules (`plan(sizes=...)`): the parts
        it answers hold that mode's reserves, so each mode has its own."""
        if rules is self._sizer.rules:
            return self._sizer
        return replace(self._sizer, rules=rules, answered={}, computed=self._sizer.computed)

    @property
    def estimated(self) -> bool:
        """No receipt replaces the estimate (`_Sizer.estimated`)."""
        return self._sizer.estimated

    def fits_int64(self, most_minds: int) -> bool:
        """Whether every figure up to `most_minds` minds, and the reserve and declared device
        budget asked, stay under `LIMIT`."""
        s, top = self.shape, max(1, most_minds)
        graph, host_input = map(max, self._graph(self._least_minds), self._graph(top))
        worst = (
            s.input_bytes
            + s.total_weights
            + s.output_bytes
            + s.output_host_bytes
            + self._sizer.kv_per_mind[-1] * top
            + graph * (self._sizer.gpus + 1)
            + host_input
            + self._sizer.compute_terms(top)[2]
            + self._sizer.park_host
        )
        measured = max((d + h for d, h in self._measured.values()), default=0)
        return max(worst, measured, self._asked) <= self.LIMIT

    def at(self, j: int, minds: int) -> tuple[int, int]:
        """Bytes in use (device, host) at one level and number of minds."""
        device, host = self._sizer.parts(j, minds)
        return device.in_use, host.in_use

    def grows_with_level(self, minds: int) -> bool:
        """Whether the device's bytes in use grow (or stay) with the level at `minds` minds:
        weights, KV and (from level 1) the graph are added layer by layer; a receipt's figures
        may do anything."""
        return not any(m == minds for _, m in self._measured)

    def grows_with_minds(self, lo: int, hi: int) -> bool:
        """Whether, at any level, the bytes in use of each side grow (or stay) from `lo` to
        `hi` minds: then a budget they fit at some minds they fit at fewer, and the plan's
        search finds the most that fit. KV and the output buffer grow with the minds; the
        graphs with the micro-batch, checked here; a receipt's figures may do anything."""
        if any(lo <= m <= hi for _, m in self._measured):
            return False
        batch = self._sizer.compute.micro_batch
        last = min(hi, max(lo, -(-batch // self._cells)))  # past it the micro-batch is whole
        graphs = [self._graph(m) for m in range(lo, last + 1)]
        return all(a <= b for g in zip(*graphs, strict=True) for a, b in pairwise(g))

    def _graph(self, minds: int) -> tuple[int, int]:
        """One backend's graph, and the host's graph inputs when every layer is offloaded,
        with `minds` minds: they depend on the minds only through the micro-batch llama.cpp
        clamps to the context (`ComputeEstimate.micro_batch_of`), so few differ."""
        batch = self._sizer.compute.micro_batch_of(self._cells, minds)
        known = self._graphs.get(batch)
        if known is None:  # the plan's own figures, which its sizer then has at hand
            graph, host_input, _ = self._sizer.compute_terms(minds)
            known = self._graphs[batch] = (graph, host_input)
        return known

    def in_use(self, j: Int64s, minds: Int64s | int) -> tuple[Int64s, Int64s]:
        """Bytes in use (device, host) at offload level `j` with `minds` minds, element by
        element (numpy broadcasting), as `_Sizer.parts` gives them."""
        s = self.shape
        on_device = np.clip(j - 1, 0, s.layers)
        output_on_device = j > 0
        m = np.asarray(minds, dtype=np.int64)
        if m.ndim == 0:
            table = np.array([self._graph(int(m))], dtype=np.int64)
            graph, host_input = table[0, 0], table[0, 1]
        else:
            distinct, where = np.unique(m, return_inverse=True)
            table = np.array([self._graph(x) for x in distinct.tolist()], dtype=np.int64)
            graph = table[:, 0][where].reshape(m.shape)
            host_input = table[:, 1][where].reshape(m.shape)
        tail_weights, tail_kv = self._tails()
        tail_w = tail_weights[on_device]
        dev_w = tail_w + np.where(output_on_device, s.output_bytes, 0)
        host_w = (s.input_bytes + s.total_weights - tail_w) + np.where(
            output_on_device, 0, s.output_host_bytes
        )
        kv_dev = tail_kv[on_device]
        kv_host = tail_kv[s.layers] - kv_dev
        # Each backend that runs layers holds its graph; the host holds the output buffer and
        # the graph, or only its inputs when every layer is offloaded (`_Sizer._parts`).
        dev_c = np.where(output_on_device, graph * self._sizer.gpus, 0)
        # The output buffer holds f32 logits of one token per sequence: linear in the minds.
        output_per_mind = self._sizer.compute_terms(1)[2]
        host_c = np.where(on_device < s.layers, graph, host_input) + output_per_mind * m
        device = dev_w + kv_dev * m + dev_c
        host = host_w + kv_host * m + host_c + self._sizer.park_host
        for (rj, rm), (rd, rh) in self._measured.items():
            hit = (j == rj) & (m == rm)
            device = np.where(hit, rd, device)
            host = np.where(hit, rh, host)
        return device, host


@dataclass(frozen=True, slots=True)
class _Fit:
    budget: Budget
    check_device: bool

    def device_fits(self, device: PartBytes) -> bool:
        if not self.check_device or self.budget.device is None:
            return True
        return device.in_use <= self.budget.device

    def rest_fits(self, device: PartBytes, host: PartBytes) -> bool:
        if self.budget.host is not None and host.in_use > self.budget.host:
            return False
        if self.budget.shared is not None:
            return device.in_use + host.in_use <= self.budget.shared
        return True

    def fits(self, parts: tuple[PartBytes, PartBytes]) -> bool:
        return self.device_fits(parts[0]) and self.rest_fits(*parts)

    def shortfall(self, device: PartBytes, host: PartBytes) -> int:
        """Bytes the parts ask beyond their tightest budget (0 when they fit)."""
        over = [0]
        if self.check_device and self.budget.device is not None:
            over.append(device.in_use - self.budget.device)
        if self.budget.host is not None:
            over.append(host.in_use - self.budget.host)
        if self.budget.shared is not None:
            over.append(device.in_use + host.in_use - self.budget.shared)
        return max(over)


class _Available:
    """Bytes a pool has left for the engine beside the other leases, read once per pool. An
    unsampled pool is planned against its capacity less leases, and the plan says so."""

    __slots__ = ("_board", "_crediting", "_ledger", "_reasons", "_seen")

    def __init__(
        self, board: Board, ledger: BoardLeases, crediting: str | None, reasons: list[Reason]
    ) -> None:
        self._board, self._ledger, self._crediting = board, ledger, crediting
        self._reasons = reasons
        self._seen: dict[str, int] = {}

    def __call__(self, pool_key: str) -> int:
        value = self._seen.get(pool_key)
        if value is not None:
            return value
        value = self._ledger.available_bytes(pool_key, crediting=self._crediting)
        if value is None:
            leased = self._ledger.leased_bytes(pool_key, excluding=self._crediting)
            value = max(0, self._board.pools[pool_key].capacity_bytes - leased)
            self._reasons.append(
                Reason(
                    ReasonCode.POOL_UNSAMPLED,
                    f"pool {pool_key} has not been measured yet; planned against capacity "
                    f"less leases ({_mib(value)})",
                )
            )
        self._seen[pool_key] = value
        return value


@dataclass(frozen=True, slots=True)
class _Layers:
    """The layer stage: the offload levels tried at `minds.min`, and the one that fits."""

    level: int  # layers on the device; where no level tried fits, the first one tried
    fits: bool  # minds.min fits at `level`
    device_blind: bool  # offload auto where no device budget is checked: nothing offloaded


def plan(
    board: Board,
    engine: EngineSpec,
    facts: ModelFacts,
    ledger: BoardLeases | None = None,
    *,
    crediting: str | None = None,
    receipts: Sequence[Receipt] = (),
    llama_build: str | None = None,
    on_gpus: Sequence[int] = (),
    sizes: SizeTable | None = None,
) -> ServingPlan:
    """The serving plan of `engine` on `board`, given the leases already on it.

    `on_gpus` are the GPUs a running engine is on (the ones its lease charges, moved to those
    its processes use by `core.gpu_check`): a re-plan keeps them where the board has them all
    and they are as many as the spec asks, rather than choosing again, since its pod stays
    where it is and choosing again would move the charge, not the pod.

    `crediting` names the engine's own lease when sizing the successor of a running engine.
    `receipts` are llama.cpp's measured buffers; one filed under the engine's model digest
    (`spec.model.sha256`), context, KV type, placement and `llama_build` (any build when None)
    replaces the estimate for that placement.

    `sizes`: the engine's `SizeTable` of the same spec, facts, receipts and build, where the
    caller has one (best fit plans many boards for one engine): its sizer is not built again.
    """
    ledger = ledger if ledger is not None else BoardLeases(board)
    reasons: list[Reason] = []
    rules = rules_of(board.memory_mode)
    host = board.host_view()
    if host is None:
        why = Reason(
            ReasonCode.NO_HOST_POOL,
            f"node {board.node}'s board reports no host pool; the agent must report host memory "
            "before anything can be planned there",
        )
        return _unschedulable(board, engine, facts, rules, reasons, why)
    ask = BudgetAsk(
        reserve=engine.reserve_bytes,
        gpus=engine.placement.gpus,
        declared_device=engine.placement.device_budget_bytes,
        on_gpus=on_gpus,
    )
    available = _Available(board, ledger, crediting, reasons)
    budgeted = rules.budget(board, host, ask, available)
    if isinstance(budgeted, Reason):
        return _unschedulable(board, engine, facts, rules, reasons, budgeted)
    reasons.extend(budgeted.notes)
    no_disk = _disk_refusal(board, engine, available)
    if no_disk is not None:
        return _unschedulable(board, engine, facts, rules, reasons, no_disk, budgeted)
    sizer = (
        _Sizer.of(facts, engine, rules, ReceiptBook(tuple(receipts), llama_build))
        if sizes is None
        else sizes.sizer(rules)
    )
    reasons.extend(sizer.refused)
    fit = _Fit(budgeted.budget, budgeted.device_checked)
    layers = _place_layers(engine, sizer, fit, facts.layers + 1)
    if not layers.fits:
        why = _does_not_fit(board, engine, sizer, fit, layers.level)
        short = fit.shortfall(*sizer.parts(layers.level, engine.minds.min))
        return _unschedulable(board, engine, facts, rules, reasons, why, budgeted, short)
    minds = _grantable_minds(engine, sizer, fit, layers.level)
    _explain(reasons, engine, facts, sizer, fit, layers, minds)
    return _planned(board, engine, facts, rules, budgeted, sizer, layers, minds, reasons)


def _place_layers(engine: EngineSpec, sizer: _Sizer, fit: _Fit, total: int) -> _Layers:
    """Offload level: forced by the spec, or the most the device budget takes at minds.min
    (then, where the mode falls back to the host, every layer on the host)."""
    lo_minds, offload = engine.minds.min, engine.offload
    device_blind = offload == "auto" and not fit.check_device
    if offload == "none" or device_blind:
        candidates = [0]
    elif offload == "all":
        candidates = [total]
    elif isinstance(offload, int):
        candidates = [min(offload, total)]
    else:
        top = _search(
            0, total, lambda j: fit.device_fits(sizer.parts(j, lo_minds)[0]), sizer.estimated
        )
        if top is None:
            candidates = [0]
        else:
            candidates = [top, 0] if sizer.rules.auto_falls_back_to_host else [top]
    level = next((j for j in candidates if fit.fits(sizer.parts(j, lo_minds))), None)
    if level is None:
        return _Layers(candidates[0], False, device_blind)
    return _Layers(level, True, device_blind)


def _grantable_minds(engine: EngineSpec, sizer: _Sizer, fit: _Fit, level: int) -> int:
    """The KV pool: the most minds, up to minds.max, whose contexts fit beside `level` layers
    on the device (the level was chosen so that minds.min fits)."""
    minds = _search(
        engine.minds.min,
        engine.minds.max,
        lambda m: fit.fits(sizer.parts(level, m)),
        sizer.estimated,
    )
    assert minds is not None
    return minds


def _search(lo: int, hi: int, pred: Callable[[int], bool], grows: bool) -> int | None:
    """`last_true`, asking first at `hi` where the bytes are estimates (`grows`): those grow
    with the level and with the minds (weights, KV and graphs are added, never taken away), so
    pred holds up to a point and, where it holds at hi, the search would end there. Most plans
    that fit at all fit whole, and this spares their search. A receipt's figures may not grow:
    with receipts the search runs as it always has."""
    if grows and pred(hi):
        return hi
    return last_true(lo, hi, pred)


def _does_not_fit(board: Board, engine: EngineSpec, sizer: _Sizer, fit: _Fit, level: int) -> Reason:
    """Why minds.min does not fit at the offload level tried first, and what would fix it."""
    lo_minds, reserve, budget = engine.minds.min, engine.reserve_bytes, fit.budget
    device, host = sizer.parts(level, lo_minds)
    need = f"device {_mib(device.in_use)}, host {_mib(host.in_use)}"
    have = f"device budget {_mib(budget.device)}, host budget {_mib(budget.host)}"
    if budget.shared is not None:
        have += f", pool {_mib(budget.shared)} for both"
    code = (
        ReasonCode.OFFLOAD_DOES_NOT_FIT
        if engine.offload != "auto" and not fit.device_fits(device)
        else ReasonCode.INSUFFICIENT_MEMORY
    )
    fix = (
        "Lower spec.minds.min, spec.contextTokensPerMind or spec.offload, or use a "
        "quantised spec.kvCacheType"
    )
    if host.park:
        need += f" (its park store {_mib(host.park)} included)"
        fix += ", or spec.park.bytes (or park on disk: spec.park.tier disk)"
    if any(b is not None and b < 0 <= b + reserve for b in (budget.device, budget.host)):
        # The reserve alone leaves the pool nothing: no other field can make it fit.
        fix = "Lower spec.reserveBytes: it leaves the pool nothing to plan in"
    return Reason(
        code,
        f"{lo_minds} mind(s) of {engine.context_tokens_per_mind} tokens at offload "
        f"{level}/{sizer.shape.layers + 1} need {need}; node {board.node} has {have} "
        f"(reserve {_mib(reserve)} per pool kept free). {fix}",
    )


def _unschedulable(
    board: Board,
    engine: EngineSpec,
    facts: ModelFacts,
    rules: ModeRules,
    reasons: list[Reason],
    why: Reason,
    budgeted: Budgeted | None = None,
    shortfall: int | None = None,
) -> ServingPlan:
    """A plan that places nothing, with what it found so far and `why` last."""
    reasons.append(why)
    return ServingPlan(
        node=board.node,
        memory_mode=rules.mode,
        governed=rules.governed,
        schedulable=False,
        layers_on_device=0,
        total_layers=facts.layers + 1,
        gpu_servable=False,
        pool_tokens=0,
        minds_grantable=0,
        context_tokens_per_mind=engine.context_tokens_per_mind,
        kv_cache_type=engine.kv_cache_type,
        gpus=() if budgeted is None else budgeted.gpus,
        budget=(
            Budget(None, None, board.per_process_cap_bytes) if budgeted is None else budgeted.budget
        ),
        device=PartBytes(),
        host=PartBytes(),
        charges=(),
        engine_args=(),
        reasons=tuple(reasons),
        shortfall_bytes=shortfall,
    )


def _planned(
    board: Board,
    engine: EngineSpec,
    facts: ModelFacts,
    rules: ModeRules,
    budgeted: Budgeted,
    sizer: _Sizer,
    layers: _Layers,
    minds: int,
    reasons: list[Reason],
) -> ServingPlan:
    """The plan of `minds` minds at the layers chosen, with the reasons found."""
    level, total_layers = layers.level, facts.layers + 1
    device, host = sizer.parts(level, minds)
    tokens = minds * engine.context_tokens_per_mind
    return ServingPlan(
        node=board.node,
        memory_mode=rules.mode,
        governed=rules.governed,
        schedulable=True,
        layers_on_device=level,
        total_layers=total_layers,
        gpu_servable=level == total_layers and not layers.device_blind,
        pool_tokens=tokens,
        minds_grantable=minds,
        context_tokens_per_mind=engine.context_tokens_per_mind,
        kv_cache_type=engine.kv_cache_type,
        gpus=budgeted.gpus if level > 0 else (),
        budget=budgeted.budget,
        device=device,
        host=host,
        charges=_charges(board, rules, budgeted.gpus, device, host) + _disk_charge(engine),
        engine_args=_engine_args(level, tokens, minds, engine.kv_cache_type, sizer.gpus),
        reasons=tuple(reasons),
        receipt=sizer.receipt(level, minds),
    )


def _explain(
    reasons: list[Reason],
    engine: EngineSpec,
    facts: ModelFacts,
    sizer: _Sizer,
    fit: _Fit,
    layers: _Layers,
    minds: int,
) -> None:
    """Why a schedulable plan has its layers and minds, and what its bytes rest on."""
    level, total = layers.level, facts.layers + 1
    if not layers.device_blind:
        _explain_layers(reasons, level, total, engine.offload, fit.budget, sizer, engine.minds.min)
    if minds == engine.minds.max:
        reasons.append(Reason(ReasonCode.MINDS_AT_MAX, f"{minds} minds, spec.minds.max"))
    else:
        reasons.append(
            Reason(
                ReasonCode.MINDS_LIMITED_BY_POOL,
                f"{minds} of up to {engine.minds.max} minds fit; the rest wait as overflow",
            )
        )
    if not sizer.rules.governed:
        _explain_ungoverned(reasons, engine, level, fit.check_device)
    _explain_estimates(reasons, sizer, facts, level, minds)
    if sizer.compute.assumed and sizer.receipt(level, minds) is None:
        reasons.append(
            Reason(
                ReasonCode.COMPUTE_ESTIMATED,
                "compute buffer estimated assuming " + ", ".join(sizer.compute.assumed),
            )
        )


def _explain_layers(
    reasons: list[Reason],
    level: int,
    total: int,
    offload: object,
    budget: Budget,
    sizer: _Sizer,
    minds: int,
) -> None:
    if offload == "none":
        reasons.append(Reason(ReasonCode.OFFLOAD_NONE, "spec.offload is none: every layer on host"))
    elif isinstance(offload, int):
        reasons.append(
            Reason(ReasonCode.OFFLOAD_FIXED, f"spec.offload fixes {level}/{total} layers on device")
        )
    elif level == total:
        reasons.append(Reason(ReasonCode.ALL_LAYERS_ON_DEVICE, f"all {total} layers on the device"))
    else:
        needed = sizer.parts(level + 1, minds)[0].in_use
        capped = budget.per_process_cap is not None and budget.per_process_cap == budget.device
        code = (
            ReasonCode.LIMITED_BY_PER_PROCESS_CAP if capped else ReasonCode.LAYERS_LIMITED_BY_DEVICE
        )
        reasons.append(
            Reason(
                code,
                f"{level}/{total} layers on the device: {level + 1} would need "
                f"{_mib(needed)} against a device budget of {_mib(budget.device)}",
            )
        )


def _explain_estimates(
    reasons: list[Reason], sizer: _Sizer, facts: ModelFacts, level: int, minds: int
) -> None:
    receipt = sizer.receipt(level, minds)
    if receipt is not None:
        source = f" ({receipt.source})" if receipt.source else ""
        reasons.append(
            Reason(
                ReasonCode.RECEIPT_USED,
                f"bytes measured by {receipt.llama_build} at {receipt.context_tokens} tokens, "
                f"{receipt.placement.layers_on_device} layers on {receipt.placement.gpus} GPU(s), "
                f"{receipt.kv_cache_type} KV{source} used instead of the estimate",
            )
        )
    if facts.is_moe:
        used = f", {facts.expert_used_count} used per token" if facts.expert_used_count else ""
        reasons.append(
            Reason(
                ReasonCode.EXPERT_OFFLOAD_NOT_PLANNED,
                f"a mixture of {facts.expert_count} experts{used}: expert weights are planned "
                "with their layers; keeping experts on the host (llama.cpp --n-cpu-moe) is not "
                "planned yet",
            )
        )
    if facts.sliding_window and facts.sliding_window_layers and receipt is None:
        cells = window_cells_per_sequence(sizer.context_per_mind, facts.sliding_window)
        reasons.append(
            Reason(
                ReasonCode.SLIDING_WINDOW_KV,
                f"{len(facts.sliding_window_layers)} of {facts.layers} layers attend over a "
                f"window of {facts.sliding_window} tokens: their KV holds {cells} cells per mind",
            )
        )


def _explain_ungoverned(
    reasons: list[Reason], engine: EngineSpec, level: int, check_device: bool
) -> None:
    """What an ungoverned device (unknown mode) was planned against, or why nothing was."""
    if check_device:
        reasons.append(
            Reason(
                ReasonCode.DEVICE_BUDGET_DECLARED,
                "device planned against the declared spec.placement.deviceBudgetBytes "
                f"({_mib(engine.placement.device_budget_bytes)}); nothing measures it",
            )
        )
    elif engine.offload == "auto":
        reasons.append(
            Reason(
                ReasonCode.DEVICE_UNGOVERNED,
                "offload auto on a node of unknown memory mode offloads nothing; declare "
                "spec.placement.deviceBudgetBytes, or run the node agent with a GPU backend",
            )
        )
    elif level > 0:
        reasons.append(
            Reason(
                ReasonCode.OFFLOAD_UNGOVERNED,
                f"spec.offload {engine.offload} honoured without accounting: {level} layers on a "
                "device whose memory nobody measures",
            )
        )


def _charges(
    board: Board,
    rules: ModeRules,
    gpus: Sequence[int],
    device: PartBytes,
    host: PartBytes,
) -> tuple[tuple[str, int], ...]:
    """Bytes leased per pool: the host part to the host view, the device part split evenly over
    the pools its GPUs draw from (on a unified board the same pool; ungoverned: none)."""
    host_view = board.host_view()
    assert host_view is not None
    charges = {host_view.key: host.total}
    device_pools = rules.device_pools(board, gpus) if device.total > 0 else []
    for pool in device_pools:
        share = -(-device.total // len(device_pools))
        charges[pool] = charges.get(pool, 0) + share
    return tuple(charges.items())


def disk_park_bytes(engine: EngineSpec) -> int:
    """The park store's bytes the engine puts on the node's disk (spec.park of tier disk)."""
    park = engine.park
    return park.bytes if park is not None and park.tier is ParkTier.DISK else 0


def _disk_charge(engine: EngineSpec) -> tuple[tuple[str, int], ...]:
    n = disk_park_bytes(engine)
    return (("disk", n),) if n else ()


def _disk_refusal(board: Board, engine: EngineSpec, available: _Available) -> Reason | None:
    """Why a park store on disk does not fit the node: no disk pool, or not the room."""
    n = disk_park_bytes(engine)
    if not n:
        return None
    if "disk" not in board.pools:
        return Reason(
            ReasonCode.NO_DISK_POOL,
            f"spec.park asks {_mib(n)} on disk and node {board.node}'s board reports no disk "
            "pool (its agent probes the disk only with --disk-path): park in host memory "
            "(spec.park.tier host), or give the node's agent --disk-path",
        )
    left = available("disk")
    if n > left:
        return Reason(
            ReasonCode.INSUFFICIENT_DISK,
            f"spec.park asks {_mib(n)} on disk and node {board.node}'s disk has {_mib(left)} "
            "left beside other leases: lower spec.park.bytes",
        )
    return None


def _engine_args(
    level: int, tokens: int, minds: int, kv: KvCacheType, gpus: int
) -> tuple[str, ...]:
    args = [
        "--n-gpu-layers", str(level),
        "--ctx-size", str(tokens),
        "--parallel", str(minds),
        "--cache-type-k", str(kv),
        "--cache-type-v", str(kv),
        "--flash-attn", "on",
    ]  # fmt: skip
    if gpus > 1 and level > 0:
        args += ["--split-mode", "layer", "--tensor-split", ",".join(["1"] * gpus)]
    return tuple(args)
