"""Best fit's pre-filter (`core.prefilter`) decides as the exact plan of every node does.

For random engines (facts, minds, offload, GPUs, declared budgets, selectors, receipts) on random
mixed boards (unified, discrete, unknown, boards it does not read, stale and missing nodes,
leases, unsampled pools): the chosen node and its plan, every verdict, and the summary of an
Engine that fits nowhere are the same with and without the pre-filter; board by board its
figures are the plan's, so no board the exact plan accepts is filtered out.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
from bench.plan import fleet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum_operator.core import prefilter
from continuum_operator.core.bestfit import (
    NODE_POOL_LABEL,
    Exclusion,
    Fleet,
    NodeView,
    choose,
    leftover_bytes,
    rank,
)
from continuum_operator.core.compute import MICRO_BATCH_TOKENS, kv_cells_per_sequence
from continuum_operator.core.plan import ServingPlan, SizeTable, plan
from continuum_operator.core.plan_reasons import ReasonCode
from continuum_operator.core.pools import Board, ConsumerKind, Lease, Pool
from continuum_operator.core.receipts import Receipt
from continuum_operator.core.unfit import summarise
from continuum_operator.model.board import MemoryMode, PoolKind
from continuum_operator.model.engine import EngineSpec
from tests.support.builders import GiB, MiB, engine, engine_body

SHA = "ab" * 32
EXAMPLES = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

mib = st.integers(min_value=0, max_value=256 * 1024).map(lambda n: n * MiB)


@st.composite
def pools(draw: st.DrawFn, kind: PoolKind, device: int | None = None) -> Pool:
    capacity = draw(st.integers(min_value=1, max_value=512 * 1024)) * MiB
    if draw(st.integers(0, 40)) == 40:  # past the pre-filter's int64 reach: planned exactly
        capacity = 2**60
    used = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=capacity)))
    key = f"device/{device}" if kind is PoolKind.DEVICE else str(kind)
    return Pool(key, kind, capacity, used, device, draw(st.booleans()))


@st.composite
def boards(draw: st.DrawFn, name: str) -> Board:
    shape = draw(st.sampled_from(["unified", "discrete", "discrete", "unknown", "odd"]))
    cap = draw(st.one_of(st.none(), st.none(), mib))
    ps: list[Pool] = []
    mode = MemoryMode.DISCRETE
    if shape == "unified":
        mode = MemoryMode.UNIFIED
        ps = [draw(pools(PoolKind.UNIFIED))]
    elif shape == "discrete":
        gpus = draw(st.integers(min_value=0, max_value=4))
        ps = [draw(pools(PoolKind.HOST))] + [draw(pools(PoolKind.DEVICE, g)) for g in range(gpus)]
    elif shape == "unknown":
        mode = MemoryMode.UNKNOWN
        ps = [draw(pools(PoolKind.HOST))]
        if draw(st.booleans()):
            ps.append(draw(pools(PoolKind.DEVICE, 0)))
    else:  # boards the pre-filter does not read, or that the plan refuses outright
        mode = draw(st.sampled_from(list(MemoryMode)))
        odd = draw(
            st.sampled_from(["no host", "unified and device", "host and unified", "misnamed"])
        )
        if odd == "no host":
            ps = [draw(pools(PoolKind.DEVICE, 0)), draw(pools(PoolKind.DEVICE, 1))]
        elif odd == "misnamed":  # a GPU's pool not under its own name
            ps = [draw(pools(PoolKind.HOST)), replace(draw(pools(PoolKind.DEVICE, 0)), key="gpu")]
        elif odd == "unified and device":
            ps = [draw(pools(PoolKind.UNIFIED)), draw(pools(PoolKind.DEVICE, 0))]
        else:
            ps = [draw(pools(PoolKind.HOST)), draw(pools(PoolKind.UNIFIED))]
    if draw(st.booleans()):  # its agent probes the disk (park stores on disk are charged there)
        ps.append(draw(pools(PoolKind.DISK)))
    return Board(name, mode, {p.key: p for p in ps}, per_process_cap_bytes=cap)


@st.composite
def views(draw: st.DrawFn) -> tuple[list[NodeView], list[Lease]]:
    n = draw(st.integers(min_value=0, max_value=12))
    out: list[NodeView] = []
    leases: list[Lease] = []
    for i in range(n):
        b = draw(boards(f"n{i:02d}"))
        labels = {"zone": draw(st.sampled_from(["a", "b"]))}
        if draw(st.booleans()):
            labels[NODE_POOL_LABEL] = draw(st.sampled_from(["p", "q"]))
        # The first of each choice is the common case (hypothesis draws it most).
        usually = st.sampled_from([True] * 9 + [False])
        fresh, exists, backing_off = draw(usually), draw(usually), not draw(usually)
        mps = not draw(usually)  # GPUs shared by MPS: no candidate for several GPUs
        out.append(
            NodeView(b, fresh, labels, node_exists=exists, backing_off=backing_off, mps_shared=mps)
        )
        for j in range(draw(st.integers(min_value=0, max_value=2))):
            pool = draw(st.sampled_from(sorted(b.pools)))
            leases.append(
                Lease(f"Engine/ns/x{i}-{j}", ConsumerKind.ENGINE, b.node, pool, draw(mib))
            )
    return out, leases


@st.composite
def engines(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(min_value=1, max_value=64))
    per_layer = draw(st.booleans())
    layer_mib = st.integers(min_value=0, max_value=1024).map(lambda n: n * MiB)
    kv = st.integers(min_value=1, max_value=8 * 1024)
    facts: dict[str, Any] = {
        "layers": layers,
        "layerBytes": draw(st.lists(layer_mib, min_size=layers, max_size=layers))
        if per_layer
        else draw(layer_mib),
        "inputBytes": draw(layer_mib),
        "outputBytes": draw(layer_mib),
        "kvBytesPerTokenPerLayer": draw(kv),
    }
    if draw(st.booleans()):
        facts["computeBytes"] = draw(layer_mib)
    else:
        facts["embeddingLength"] = draw(st.integers(min_value=64, max_value=16384))
        facts["vocabSize"] = draw(st.integers(min_value=256, max_value=262144))
    if draw(st.integers(0, 3)) == 0:
        facts["slidingWindow"] = draw(st.integers(min_value=16, max_value=8192))
        facts["slidingWindowLayers"] = sorted(
            draw(st.sets(st.integers(0, layers - 1), min_size=1, max_size=layers))
        )
    lo = draw(st.integers(min_value=1, max_value=8))
    hi = draw(st.integers(min_value=lo, max_value=lo + draw(st.sampled_from([0, 4, 16, 300]))))
    placement: dict[str, Any] = {"gpus": draw(st.integers(min_value=1, max_value=3))}
    if draw(st.booleans()):
        placement["deviceBudgetBytes"] = draw(mib)
    if draw(st.integers(0, 4)) == 4:
        placement["nodeSelector"] = {"zone": "a"}
    if draw(st.integers(0, 4)) == 4:
        placement["nodePool"] = "p"
    spec: dict[str, Any] = {
        "model": {"facts": facts, "sha256": SHA},
        "contextTokensPerMind": draw(
            st.one_of(st.integers(min_value=16, max_value=8192), st.integers(16, 131072))
        ),
        "minds": {"min": lo, "max": hi},
        "offload": draw(
            st.one_of(st.sampled_from(["auto", "auto", "all", "none"]), st.integers(0, 100))
        ),
        "kvCacheType": draw(st.sampled_from(["f32", "f16", "q8_0", "q4_0"])),
        "reserveBytes": draw(st.integers(min_value=0, max_value=4096)) * MiB,
        "placement": placement,
    }
    if draw(st.booleans()):
        spec["park"] = {"tier": draw(st.sampled_from(["host", "disk"])), "bytes": draw(mib)}
    return engine_body(**spec)


@st.composite
def receipts_for(draw: st.DrawFn, spec: EngineSpec) -> list[Receipt]:
    """Receipts filed under the engine's own key at some levels and minds: their figures are
    anything, so the bytes no longer grow with the level or the minds."""
    facts = spec.model.facts
    assert facts is not None
    out = []
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        j = draw(st.integers(min_value=0, max_value=facts.layers + 1))
        most = min(spec.minds.max + 1, 16_777_216 // spec.context_tokens_per_mind)
        if most < spec.minds.min:
            break
        # minds.min most often: the level searched is that of minds.min
        m = draw(st.one_of(st.just(spec.minds.min), st.integers(spec.minds.min, most)))
        cells = kv_cells_per_sequence(spec.context_tokens_per_mind)
        buffers = [
            {"device": draw(st.sampled_from(["CPU", "CUDA0", "CUDA_Host"])),
             "kind": draw(st.sampled_from(["model", "kv", "compute", "output"])),
             "bytes": draw(mib)}
            for _ in range(draw(st.integers(min_value=1, max_value=4)))
        ]  # fmt: skip
        out.append(
            Receipt.model_validate(
                {
                    "modelSha256": SHA,
                    "contextTokens": m * spec.context_tokens_per_mind,
                    "kvCacheType": str(spec.kv_cache_type),
                    "placement": {
                        "layersOnDevice": j,
                        "gpus": spec.placement.gpus if j > 0 else 0,
                    },
                    "llamaBuild": "b1",
                    "parallel": m,
                    "microBatchTokens": min(MICRO_BATCH_TOKENS, cells * m),
                    "buffers": buffers,
                }
            )
        )
    return out


def _case(data: st.DataObject) -> tuple[list[NodeView], list[Lease], EngineSpec, list[Receipt]]:
    nodes, leases = data.draw(views())
    spec = engine(data.draw(engines())).spec
    receipts = data.draw(receipts_for(spec)) if data.draw(st.booleans()) else []
    return nodes, leases, spec, receipts


@EXAMPLES
@given(st.data())
def test_the_choice_verdicts_and_summary_are_those_of_the_exact_plan_of_every_node(
    data: st.DataObject,
) -> None:
    nodes, leases, spec, receipts = _case(data)
    facts = spec.model.facts
    assert facts is not None
    small_grid = data.draw(st.booleans())  # the minds searched board by board, not on a grid
    grid, prefilter.GRID_CELLS = prefilter.GRID_CELLS, 4 if small_grid else prefilter.GRID_CELLS
    try:
        fast = choose(nodes, spec, facts, leases, receipts=receipts)
        whys, closest = fast.whys(), fast.closest()
    finally:
        prefilter.GRID_CELLS = grid
    slow = choose(nodes, spec, facts, leases, receipts=receipts, prefilter=False)
    assert fast.chosen == slow.chosen
    assert whys == slow.whys()
    assert closest == slow.closest()
    if slow.chosen is None:
        assert summarise(fast) == summarise(slow)
    assert fast.verdicts == slow.verdicts
    # The pre-filter's own figures chose (it planned the best node only, and the nodes it does
    # not read): had they differed from the plan's, every node would have been planned.
    f = Fleet(nodes, leases)
    excluded = f.excluded(spec)
    unread = [i for i in f.rows().unread if not excluded[i]]
    if SizeTable(spec, facts, receipts).fits_int64(spec.minds.max):
        assert fast.plans <= len(unread) + 1


@EXAMPLES
@given(st.data())
def test_board_by_board_its_figures_are_the_plans_and_no_board_the_plan_takes_is_filtered(
    data: st.DataObject,
) -> None:
    nodes, leases, spec, receipts = _case(data)
    facts = spec.model.facts
    assert facts is not None
    sizes = SizeTable(spec, facts, receipts)
    if not sizes.fits_int64(spec.minds.max):
        return
    f = Fleet(nodes, leases)
    rows = f.rows()
    o = prefilter.outcome(rows.boards, sizes, spec)
    layers, short = o.layers, o.shortfalls()
    ranked: list[tuple[tuple[int, int, int, str], int]] = []
    for row, i in enumerate(rows.node.tolist()):
        ledger = f.ledgers[i]
        assert ledger is not None
        p = plan(ledger.board, spec, facts, ledger, receipts=receipts)
        assert bool(layers.schedulable[row]) == p.schedulable, ledger.board
        if p.schedulable:
            assert int(layers.level[row]) == p.layers_on_device
            assert bool(layers.gpu_servable[row]) == p.gpu_servable
            ranked.append((rank(p, leftover_bytes(p, ledger)), row))
        else:
            expected = -1 if p.shortfall_bytes is None else p.shortfall_bytes
            assert int(short.shortfall[row]) == expected
            code = p.reasons[-1].code
            if code not in (ReasonCode.NO_HOST_POOL, ReasonCode.NOT_ENOUGH_GPUS):
                assert short.code[row] == code
    best = o.best(np.ones(len(rows.boards), dtype=np.bool_))
    if not ranked:
        assert best is None
        return
    (servable, minds, left, _), row = min(ranked)
    assert best == prefilter.Best(row, servable == 0, -minds, left)


@settings(EXAMPLES, max_examples=100)
@given(st.data())
def test_the_size_table_is_the_plans_arithmetic_over_arrays(data: st.DataObject) -> None:
    spec = engine(data.draw(engines())).spec
    facts = spec.model.facts
    assert facts is not None
    receipts = data.draw(receipts_for(spec))
    sizes = SizeTable(spec, facts, receipts)
    levels = np.arange(facts.layers + 2, dtype=np.int64)
    for m in sorted({spec.minds.min, spec.minds.max, spec.minds.max + 1, 1, 2}):
        device, host = sizes.in_use(levels, m)
        assert [sizes.at(j, m) for j in levels.tolist()] == list(
            zip(device.tolist(), host.tolist(), strict=True)
        )
    minds = np.arange(spec.minds.min, spec.minds.max + 2, dtype=np.int64)
    device, host = sizes.in_use(levels[:, None], minds[None, :])
    for j in levels.tolist()[:: max(1, len(levels) // 7)]:
        for k, m in enumerate(minds.tolist()):
            assert sizes.at(j, m) == (device[j, k], host[j, k])


def test_the_benchs_fleet_is_placed_the_same_with_and_without_the_prefilter() -> None:
    boards, specs = fleet(60, 120)
    nodes = [NodeView(b, True) for b in boards]
    together = Fleet(nodes, [])
    for spec in specs:
        facts = spec.model.facts
        assert facts is not None
        fast = together.choose(spec, facts)
        slow = together.choose(spec, facts, prefilter=False)
        assert fast.chosen == slow.chosen
        if slow.chosen is None:
            assert summarise(fast) == summarise(slow)
        assert fast.plans <= 1


def test_an_engine_past_int64s_reach_is_planned_node_by_node() -> None:
    body = engine_body(
        model={
            "facts": {
                "layers": 4096,
                "layerBytes": 2**31 - 1,
                "inputBytes": MiB,
                "outputBytes": MiB,
                "kvBytesPerTokenPerLayer": 2**31 - 1,
                "computeBytes": MiB,
            }
        },
        contextTokensPerMind=16_777_216,
        minds={"min": 1, "max": 4096},
    )
    spec = engine(body).spec
    assert spec.model.facts is not None
    nodes = [
        NodeView(
            Board(
                f"n{i}",
                MemoryMode.UNIFIED,
                {"unified": Pool("unified", PoolKind.UNIFIED, 64 * GiB, GiB)},
            ),
            True,
        )
        for i in range(3)
    ]
    d = choose(nodes, spec, spec.model.facts, [])
    assert d.chosen is None and d.plans == 3
    assert {v.excluded for v in d.verdicts} == {Exclusion.UNSCHEDULABLE}


def test_a_fleet_decides_for_many_engines_from_one_reading_of_its_boards() -> None:
    boards, specs = fleet(8, 30)
    together = Fleet([NodeView(b, True) for b in boards], [])
    chosen: list[ServingPlan | None] = []
    for spec in specs:
        assert spec.model.facts is not None
        chosen.append(together.choose(spec, spec.model.facts).chosen)
    alone = [
        choose([NodeView(b, True) for b in boards], s, s.model.facts, []).chosen
        for s in specs
        if s.model.facts is not None
    ]
    assert chosen == alone
