"""Properties of the serving plan that must hold for every board, engine and set of leases."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum_operator.core.plan import ServingPlan, plan
from continuum_operator.core.pools import Board, BoardLeases, ConsumerKind, Lease, Pool
from continuum_operator.model.board import MemoryMode
from continuum_operator.model.engine import EngineSpec
from tests.support.builders import GiB, MiB, board, board_body, engine, engine_body

settings.register_profile(
    "plans", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("plans")

mib = st.integers(min_value=0, max_value=512 * 1024).map(lambda n: n * MiB)


@st.composite
def pools(draw: st.DrawFn, kind: str, device: int | None = None) -> dict[str, Any]:
    capacity = draw(st.integers(min_value=1, max_value=512 * 1024)) * MiB
    used = draw(st.one_of(st.none(), st.integers(min_value=0, max_value=capacity)))
    pool: dict[str, Any] = {"kind": kind, "capacityBytes": capacity}
    if used is not None:
        pool["usedBytes"] = used
    if device is not None:
        pool["device"] = device
        pool["coherent"] = draw(st.booleans())
    return pool


@st.composite
def boards(draw: st.DrawFn, mode: str | None = None) -> dict[str, Any]:
    mode = mode or draw(st.sampled_from(["unified", "discrete", "unknown"]))
    cap = draw(st.one_of(st.none(), mib))
    if mode == "unified":
        return board_body(mode, [draw(pools("unified"))], cap=cap)
    if mode == "discrete":
        gpus = draw(st.integers(min_value=1, max_value=4))
        ps = [draw(pools("host"))] + [draw(pools("device", i)) for i in range(gpus)]
        return board_body(mode, ps, cap=cap)
    return board_body(mode, [draw(pools("host"))], cap=cap)


@st.composite
def engines(draw: st.DrawFn) -> dict[str, Any]:
    layers = draw(st.integers(min_value=1, max_value=96))
    per_layer = draw(st.booleans())
    layer_mib = st.integers(min_value=0, max_value=2048).map(lambda n: n * MiB)
    kv = st.integers(min_value=0, max_value=64 * 1024)
    facts: dict[str, Any] = {
        "layers": layers,
        "layerBytes": draw(st.lists(layer_mib, min_size=layers, max_size=layers))
        if per_layer
        else draw(layer_mib),
        "inputBytes": draw(layer_mib),
        "outputBytes": draw(layer_mib),
        # An Engine whose every KV rate is 0 is refused (a KV cell always
        # costs bytes); single layers may still be 0, as sliding-window ones.
        "kvBytesPerTokenPerLayer": draw(
            st.lists(kv, min_size=layers, max_size=layers).map(
                lambda rates: rates if any(rates) else [1, *rates[1:]]
            )
        )
        if per_layer
        else draw(kv.filter(bool)),
    }
    if draw(st.booleans()):
        facts["computeBytes"] = draw(layer_mib)
    else:
        facts["embeddingLength"] = draw(st.integers(min_value=64, max_value=16384))
        facts["vocabSize"] = draw(st.integers(min_value=256, max_value=262144))
    lo = draw(st.integers(min_value=1, max_value=8))
    hi = draw(st.integers(min_value=lo, max_value=16))
    spec: dict[str, Any] = {
        "model": {"facts": facts},
        "contextTokensPerMind": draw(st.integers(min_value=16, max_value=131072)),
        "minds": {"min": lo, "max": hi},
        "offload": draw(
            st.one_of(st.sampled_from(["auto", "auto", "all", "none"]), st.integers(0, 100))
        ),
        "kvCacheType": draw(st.sampled_from(["f32", "f16", "q8_0", "q4_0"])),
        "reserveBytes": draw(st.integers(min_value=0, max_value=4096)) * MiB,
        "placement": {"gpus": draw(st.integers(min_value=1, max_value=2))},
    }
    if draw(st.booleans()):
        spec["placement"]["deviceBudgetBytes"] = draw(mib)
    return engine_body(**spec)


@st.composite
def leases_for(draw: st.DrawFn, b: Board) -> list[Lease]:
    keys = sorted(b.pools)
    return [
        Lease(
            f"Engine/ns/other-{i}",
            ConsumerKind.ENGINE,
            b.node,
            draw(st.sampled_from(keys)),
            draw(mib),
        )
        for i in range(draw(st.integers(min_value=0, max_value=3)))
    ]


def plan_of(
    board_doc: dict[str, Any], engine_doc: dict[str, Any], leases: Sequence[Lease] = ()
) -> ServingPlan:
    b = board(board_doc)
    spec = engine(engine_doc).spec
    assert spec.model.facts is not None
    return plan(b, spec, spec.model.facts, BoardLeases.of(b, leases))


def rank(p: ServingPlan) -> tuple[int, int]:
    return (p.layers_on_device, p.pool_tokens) if p.schedulable else (-1, -1)


@given(st.data())
def test_no_pool_is_charged_past_what_it_has_available(data: st.DataObject) -> None:
    b_doc, e_doc = data.draw(boards()), data.draw(engines())
    b = board(b_doc)
    leases = data.draw(leases_for(b))
    p = plan_of(b_doc, e_doc, leases)
    if not p.schedulable:
        assert p.charges == () and p.minds_grantable == 0
        return
    ledger = BoardLeases.of(b, leases)
    for pool, charged in p.charges:
        available = ledger.available_bytes(pool)
        if available is None:  # unsampled: planned against capacity less leases
            available = b.pools[pool].capacity_bytes - ledger.leased_bytes(pool)
        # Several GPUs share the device part evenly: rounding may add a byte per GPU.
        assert charged <= available + len(p.gpus)
    if p.budget.host is not None:
        assert p.host.in_use <= p.budget.host
    if p.budget.shared is not None:
        assert p.device.in_use + p.host.in_use <= p.budget.shared
    if p.governed and p.budget.device is not None:
        assert p.device.in_use <= p.budget.device
    if p.budget.per_process_cap is not None and p.governed:
        assert p.device.in_use <= p.budget.per_process_cap * max(1, len(p.gpus))
    spec = engine(e_doc).spec
    assert spec.minds.min <= p.minds_grantable <= spec.minds.max
    assert p.pool_tokens == p.minds_grantable * spec.context_tokens_per_mind


@given(st.data())
def test_on_a_unified_board_the_device_and_host_views_always_agree(data: st.DataObject) -> None:
    b = board(data.draw(boards("unified")))
    leases = data.draw(leases_for(b))
    ledger = BoardLeases.of(b, leases)
    device, host = b.device_view(0), b.host_view()
    assert device is not None and host is not None
    assert ledger.available_bytes(device.key) == ledger.available_bytes(host.key)
    charged = data.draw(mib)
    after = ledger.lease(Lease("Engine/ns/x", ConsumerKind.ENGINE, b.node, device.key, charged))
    assert after.available_bytes(host.key) == after.available_bytes(device.key)
    before = ledger.available_bytes(host.key)
    if before is not None:
        assert after.available_bytes(host.key) == max(
            0, b.pools[host.key].capacity_bytes - max(ledger.leased_bytes(host.key) + charged,
                                                      b.pools[host.key].used_bytes or 0)
        )  # fmt: skip


@given(st.data())
def test_a_per_process_cap_never_shrinks_the_host_budget(data: st.DataObject) -> None:
    b_doc, e_doc = data.draw(boards()), data.draw(engines())
    cap = data.draw(mib)
    capped = {**b_doc, "status": {**b_doc["status"], "perProcessCapBytes": cap}}
    uncapped = {
        **b_doc,
        "status": {k: v for k, v in b_doc["status"].items() if k != "perProcessCapBytes"},
    }
    p_capped, p_free = plan_of(capped, e_doc), plan_of(uncapped, e_doc)
    assert p_capped.budget.host == p_free.budget.host
    assert rank(p_capped) <= rank(p_free)


@given(st.data())
def test_an_unknown_memory_mode_is_never_planned_as_discrete(data: st.DataObject) -> None:
    b_doc, e_doc = data.draw(boards("unknown")), data.draw(engines())
    p = plan_of(b_doc, e_doc)
    assert p.memory_mode is MemoryMode.UNKNOWN
    assert not p.governed
    assert all(not pool.startswith("device/") for pool, _ in p.charges)
    spec = engine(e_doc).spec
    if spec.offload == "auto" and spec.placement.device_budget_bytes is None:
        assert p.layers_on_device == 0
        assert not p.gpu_servable
    if p.schedulable:
        assert "MemoryModeUnknown" in {r.code for r in p.reasons}


@given(st.data())
def test_the_same_inputs_give_the_same_plan_whatever_the_order_of_pools(
    data: st.DataObject,
) -> None:
    b_doc, e_doc = data.draw(boards()), data.draw(engines())
    b = board(b_doc)
    leases = data.draw(leases_for(b))
    first = plan_of(b_doc, e_doc, leases)
    assert plan_of(b_doc, e_doc, leases) == first
    shuffled = {
        **b_doc,
        "status": {**b_doc["status"], "pools": list(reversed(b_doc["status"]["pools"]))},
    }
    assert plan_of(shuffled, e_doc, list(reversed(leases))).to_dict() == first.to_dict()


def _more(pool: dict[str, Any], extra_capacity: int, less_used: int) -> dict[str, Any]:
    out = {**pool, "capacityBytes": pool["capacityBytes"] + extra_capacity}
    if "usedBytes" in out:
        out["usedBytes"] = max(0, out["usedBytes"] - less_used)
    return out


@given(st.data())
def test_more_memory_never_lowers_layers_on_device_then_pool_tokens(data: st.DataObject) -> None:
    b_doc, e_doc = data.draw(boards()), data.draw(engines())
    which = data.draw(st.integers(min_value=0, max_value=len(b_doc["status"]["pools"]) - 1))
    extra, freed = data.draw(mib), data.draw(mib)
    richer_pools = [
        _more(p, extra, freed) if i == which else p for i, p in enumerate(b_doc["status"]["pools"])
    ]
    richer = {**b_doc, "status": {**b_doc["status"], "pools": richer_pools}}
    assert rank(plan_of(richer, e_doc)) >= rank(plan_of(b_doc, e_doc))


@given(st.data())
def test_a_larger_per_process_cap_never_lowers_the_plan(data: st.DataObject) -> None:
    b_doc, e_doc = data.draw(boards()), data.draw(engines())
    cap, more = data.draw(mib), data.draw(mib)
    low = {**b_doc, "status": {**b_doc["status"], "perProcessCapBytes": cap}}
    high = {**b_doc, "status": {**b_doc["status"], "perProcessCapBytes": cap + more}}
    assert rank(plan_of(high, e_doc)) >= rank(plan_of(low, e_doc))


def test_the_successor_of_a_running_engine_is_credited_its_own_residency() -> None:
    """Planning a relaunch hands back what the running engine holds; admission does not."""
    b = board(board_body("unified", [{"kind": "unified", "capacityBytes": 64 * GiB,
                                      "usedBytes": 40 * GiB}]))  # fmt: skip
    spec: EngineSpec = engine(engine_body()).spec
    assert spec.model.facts is not None
    own = Lease("Engine/ns/eng", ConsumerKind.ENGINE, b.node, "unified", 30 * GiB)
    ledger = BoardLeases.of(b, [own])
    admitted = plan(b, spec, spec.model.facts, ledger)
    successor = plan(b, spec, spec.model.facts, ledger, crediting="Engine/ns/eng")
    assert successor.budget.shared is not None and admitted.budget.shared is not None
    assert successor.budget.shared - admitted.budget.shared == 30 * GiB
    assert rank(successor) >= rank(admitted)


def test_a_pool_not_yet_sampled_is_planned_against_capacity_and_says_so() -> None:
    b = board(board_body("unified", [{"kind": "unified", "capacityBytes": 64 * GiB}]))
    spec = engine(engine_body()).spec
    assert spec.model.facts is not None
    p = plan(b, spec, spec.model.facts)
    assert p.schedulable
    assert "PoolUnsampled" in {r.code for r in p.reasons}


def test_an_unsampled_pool_reports_unknown_availability_never_full() -> None:
    b = Board("n", MemoryMode.UNIFIED, {"unified": Pool("unified", *_unified(64 * GiB))})
    assert BoardLeases(b).available_bytes("unified") is None
    assert BoardLeases(b).external_bytes("unified") is None


def _unified(capacity: int) -> tuple[Any, int, None]:
    from continuum_operator.model.board import PoolKind

    return (PoolKind.UNIFIED, capacity, None)


def test_replace_keeps_plans_comparable() -> None:
    """ServingPlan is a frozen value: equal inputs compare equal, a change does not."""
    b = board(
        board_body("unified", [{"kind": "unified", "capacityBytes": 64 * GiB, "usedBytes": 0}])
    )
    spec = engine(engine_body()).spec
    assert spec.model.facts is not None
    p = plan(b, spec, spec.model.facts)
    assert replace(p, pool_tokens=p.pool_tokens + 1) != p
