"""The pure core's embed lanes: residence, pool bytes, floors, admission (docs/design.md rule 6)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum_operator.core.embed import (
    ContextBytes,
    LaneAsk,
    LanePlacement,
    LaneReason,
    LaneSizer,
    LaneVerdict,
    Residence,
    admit,
    lane_charges,
    place_lane,
    residence,
)
from continuum_operator.core.placements import embedlane_leases
from continuum_operator.core.plan import plan
from continuum_operator.core.pools import Board, BoardLeases, ConsumerKind, Lease
from continuum_operator.core.receipts import BufferKind, Receipt, ReceiptBuffer
from continuum_operator.model.embedlane import EmbedLane
from continuum_operator.model.engine import ModelFacts
from tests.support.builders import GiB, MiB, board, board_body, engine, engine_body

LANE = "EmbedLane/ns/lane"
FACTS = ModelFacts(
    layers=28,
    layer_bytes=20 * MiB,
    input_bytes=300 * MiB,
    kv_bytes_per_token_per_layer=4096,  # 8 KV heads x 128 x 2 (K, V) x f16
    embedding_length=1024,
    head_count=16,
    head_count_kv=8,
    key_length=128,
    feed_forward_length=3072,
    vocab_size=151_669,
)
SHA = "a" * 64


def discrete(host_gib: int = 64, dev_gib: int = 24, used: int = 0) -> Board:
    return board(
        board_body(
            "discrete",
            [
                {"kind": "host", "capacityBytes": host_gib * GiB, "usedBytes": used},
                {"kind": "device", "device": 0, "capacityBytes": dev_gib * GiB, "usedBytes": used},
            ],
        )
    )


def unified(gib: int = 64) -> Board:
    return board(board_body("unified", [{"kind": "unified", "capacityBytes": gib * GiB,
                                         "usedBytes": 0}]))  # fmt: skip


def receipt(tokens: int, **sides: int) -> Receipt:
    buffers = [ReceiptBuffer(device=dev, kind=BufferKind.KV, bytes=n) for dev, n in sides.items()]
    return Receipt(model_sha256=SHA, context_tokens=tokens, llama_build="b1", buffers=buffers)


# --- residence ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offloads", "layers", "expected"),
    [
        (True, 29, Residence.DEVICE),
        (True, 10, Residence.SPLIT),
        (True, 0, Residence.HOST),
        (False, 29, Residence.HOST),
        (False, 0, Residence.HOST),
        (None, 29, Residence.SPLIT),
        (None, 0, Residence.HOST),
    ],
)
def test_a_lane_resides_on_the_device_only_when_the_backend_and_the_engine_offload(
    offloads: bool | None, layers: int, expected: Residence
) -> None:
    where, _ = residence(backend_offloads=offloads, layers_on_device=layers, total_layers=29)
    assert where is expected


# --- bytes per pool ----------------------------------------------------------------------------


def test_a_host_resident_lane_is_charged_to_the_host_and_never_to_the_device() -> None:
    cb = ContextBytes(device=0, host=100 * MiB)
    charges = lane_charges(discrete(), Residence.HOST, [0], cb)
    assert charges == {"host": 100 * MiB}


def test_a_split_lane_is_charged_its_whole_context_in_each_pool() -> None:
    cb = ContextBytes(device=30 * MiB, host=70 * MiB)
    assert lane_charges(discrete(), Residence.SPLIT, [0], cb) == {
        "host": 100 * MiB,
        "device/0": 100 * MiB,
    }


def test_a_split_lane_on_unified_memory_is_charged_once() -> None:
    cb = ContextBytes(device=30 * MiB, host=70 * MiB)
    assert lane_charges(unified(), Residence.SPLIT, [0], cb) == {"unified": 100 * MiB}
    assert lane_charges(unified(), Residence.DEVICE, [0], cb) == {"unified": 100 * MiB}


def test_a_device_resident_lane_charges_each_part_to_its_pool() -> None:
    cb = ContextBytes(device=90 * MiB, host=10 * MiB)
    assert lane_charges(discrete(), Residence.DEVICE, [0], cb) == {
        "device/0": 90 * MiB,
        "host": 10 * MiB,
    }


def test_on_a_board_of_unknown_mode_the_device_part_is_not_charged() -> None:
    b = board(board_body("unknown", [{"kind": "host", "capacityBytes": 8 * GiB, "usedBytes": 0}]))
    cb = ContextBytes(device=90 * MiB, host=10 * MiB)
    assert lane_charges(b, Residence.SPLIT, [0], cb) == {"host": 100 * MiB}


def test_receipts_replace_the_estimate_and_scale_by_bytes_over_tokens_per_part() -> None:
    sizer = LaneSizer(FACTS, (receipt(1024, CUDA0=8 * MiB, CPU=2 * MiB),))
    at_512, source = sizer.bytes_at(512)
    assert source is LaneReason.RECEIPT_USED
    assert at_512 == ContextBytes(8 * MiB, 2 * MiB)  # a larger context's receipt bounds it
    at_4096, _ = sizer.bytes_at(4096)
    assert at_4096.total >= sizer.estimate(4096).total
    assert at_4096.device >= 4 * 8 * MiB and at_4096.host >= 4 * 2 * MiB


def test_the_estimate_grows_with_the_context() -> None:
    sizer = LaneSizer(FACTS)
    sizes = [sizer.estimate(t).total for t in (256, 1024, 2048, 8192)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    # Qwen3-Embedding-0.6B's KV at 2,048 tokens is 224 MiB (docs/design.md's lessons); the lane's
    # context holds at least that.
    assert sizer.estimate(2048).total >= 224 * MiB


# --- placement ---------------------------------------------------------------------------------


def place(b: Board, leases: list[Lease], ask: LaneAsk, where: Residence = Residence.HOST,
          sizer: LaneSizer | None = None) -> LanePlacement:  # fmt: skip
    return place_lane(
        b, BoardLeases.of(b, leases), ask, sizer or LaneSizer(FACTS), where=where,
        residence_reason=LaneReason.ENGINE_ON_HOST, gpus=[0],
    )  # fmt: skip


def test_a_lane_with_room_leases_its_whole_maximum_context() -> None:
    p = place(discrete(), [], LaneAsk(LANE, max_context_tokens=8192))
    assert p.verdict is LaneVerdict.FITS and p.reason is LaneReason.AT_MAX_CONTEXT
    assert p.context_tokens == 8192
    assert set(p.charges) == {"host"}
    assert p.charges["host"] == LaneSizer(FACTS).estimate(8192).total


def test_a_lane_in_a_tight_pool_leases_what_fits_and_says_why() -> None:
    b = discrete(host_gib=4)
    engine_lease = Lease("Engine/ns/eng", ConsumerKind.ENGINE, b.node, "host", 3 * GiB)
    p = place(b, [engine_lease], LaneAsk(LANE, max_context_tokens=32768))
    assert p.verdict is LaneVerdict.FITS and p.reason is LaneReason.LIMITED_BY_POOL
    assert 0 < p.context_tokens < 32768
    assert p.charges["host"] <= GiB
    assert "host" in p.message


@given(st.integers(0, 40_000), st.integers(1, 40_000))
def test_the_contexts_tried_are_the_padded_steps_from_the_floor_then_the_maximum(
    floor: int, most: int
) -> None:
    from continuum_operator.core.compute import KV_CELL_PAD
    from continuum_operator.core.embed import _Contexts, context_cells

    lo = max(1, floor)
    listed = sorted({*range(context_cells(lo), most, KV_CELL_PAD), most})
    contexts = _Contexts.of(floor, most)
    assert [contexts[i] for i in range(len(contexts))] == listed


def test_a_lane_of_the_largest_maximum_context_is_placed_by_trying_a_few_contexts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 16,777,216 tokens (the CRD's limit) is 65,536 steps: they were all listed and sorted for
    # each board at each pass, by any namespace that may create an EmbedLane.
    tried: list[int] = []
    sized = LaneSizer.bytes_at

    def counted(self: LaneSizer, tokens: int) -> Any:
        tried.append(tokens)
        return sized(self, tokens)

    monkeypatch.setattr(LaneSizer, "bytes_at", counted)
    p = place(discrete(host_gib=64), [], LaneAsk(LANE, max_context_tokens=16_777_216))
    assert p.verdict is LaneVerdict.FITS and p.reason is LaneReason.LIMITED_BY_POOL
    assert len(tried) < 40


def test_a_lane_that_never_fits_fails_with_the_pool_named() -> None:
    b = discrete(host_gib=1)
    engine_lease = Lease("Engine/ns/eng", ConsumerKind.ENGINE, b.node, "host", GiB, GiB)
    p = place(b, [engine_lease], LaneAsk(LANE, max_context_tokens=8192))
    assert p.verdict is LaneVerdict.FAILS and p.reason is LaneReason.INSUFFICIENT_MEMORY
    assert "host" in p.message and p.charges == {}


def test_a_lane_waits_while_its_pool_is_busy_above_the_others_floors() -> None:
    b = discrete(host_gib=1)
    engine_lease = Lease("Engine/ns/eng", ConsumerKind.ENGINE, b.node, "host", GiB, 0)
    p = place(b, [engine_lease], LaneAsk(LANE, max_context_tokens=8192))
    assert p.verdict is LaneVerdict.WAITS and p.reason is LaneReason.POOL_BUSY
    assert p.leases() == []


def test_a_lane_waits_for_an_unmeasured_pool() -> None:
    b = board(board_body("unified", [{"kind": "unified", "capacityBytes": 64 * GiB}]))
    p = place(b, [], LaneAsk(LANE, max_context_tokens=1024))
    assert p.verdict is LaneVerdict.WAITS and p.reason is LaneReason.POOL_UNSAMPLED


def test_floors_rise_with_the_largest_context_embedded_and_never_fall() -> None:
    b = discrete()
    first = place(b, [], LaneAsk(LANE, 8192, largest_embedded_tokens=300))
    bigger = place(b, first.leases(), LaneAsk(LANE, 8192, 3000, first.floors))
    smaller = place(b, bigger.leases(), LaneAsk(LANE, 8192, 100, bigger.floors))
    assert 0 < first.floors["host"] < bigger.floors["host"]
    assert smaller.floors["host"] == bigger.floors["host"]
    assert all(lease.floor_bytes == bigger.floors["host"] for lease in smaller.leases())


def test_a_placed_lane_shows_in_the_node_ledger_and_in_the_engine_plan() -> None:
    b = discrete(host_gib=64, dev_gib=24)
    spec = engine(engine_body(offload="none", reserveBytes=0)).spec
    facts = spec.model.facts
    assert facts is not None
    alone = plan(b, spec, facts, BoardLeases(b))
    p = place(b, [], LaneAsk(LANE, max_context_tokens=16384))
    lane = EmbedLane.model_validate(
        {
            "apiVersion": "continuum.dev/v1alpha1",
            "kind": "EmbedLane",
            "metadata": {"name": "lane", "namespace": "ns"},
            "spec": {"engine": "eng", "maxContextTokens": 16384},
            "status": {"placement": p.to_dict()},
        }
    )
    leases = embedlane_leases([lane])
    assert [(x.pool, x.bytes) for x in leases] == [("host", p.charges["host"])]
    beside = plan(b, spec, facts, BoardLeases.of(b, leases))
    assert alone.budget.host is not None and beside.budget.host is not None
    assert alone.budget.host - beside.budget.host == p.charges["host"]


# --- admission ---------------------------------------------------------------------------------


def test_a_request_within_the_lease_fits() -> None:
    a = admit([10, 500], max_context_tokens=2048, leased_context_tokens=512)
    assert a.verdict is LaneVerdict.FITS and a.tokens == 500


def test_a_request_above_the_lease_waits_with_its_reason() -> None:
    a = admit([900], max_context_tokens=2048, leased_context_tokens=512)
    assert a.verdict is LaneVerdict.WAITS and a.reason is LaneReason.POOL_BUSY
    assert "512" in a.message


def test_a_request_above_the_lanes_maximum_fails() -> None:
    a = admit([4096], max_context_tokens=2048, leased_context_tokens=2048)
    assert a.verdict is LaneVerdict.FAILS and a.reason is LaneReason.CONTEXT_TOO_LARGE


def test_a_lane_not_yet_placed_admits_nothing() -> None:
    a = admit([1], max_context_tokens=2048, leased_context_tokens=0)
    assert a.verdict is LaneVerdict.WAITS and a.reason is LaneReason.NOT_PLACED


# --- properties --------------------------------------------------------------------------------

settings.register_profile(
    "lanes", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def scenes(draw: st.DrawFn) -> dict[str, Any]:
    mode = draw(st.sampled_from(["discrete", "unified", "unknown"]))
    cap = st.integers(min_value=64, max_value=64 * 1024).map(lambda n: n * MiB)
    host_cap = draw(cap)
    pools: list[dict[str, Any]] = [
        {"kind": "unified" if mode == "unified" else "host", "capacityBytes": host_cap,
         "usedBytes": draw(st.integers(0, host_cap))}
    ]  # fmt: skip
    if mode == "discrete":
        dev_cap = draw(cap)
        pools.append({"kind": "device", "device": 0, "capacityBytes": dev_cap,
                      "usedBytes": draw(st.integers(0, dev_cap))})  # fmt: skip
    b = board(board_body(mode, pools))
    others = [
        Lease(f"Engine/ns/e{i}", ConsumerKind.ENGINE, b.node, pool, n, min(n, floor))
        for i, (pool, n, floor) in enumerate(
            draw(
                st.lists(
                    st.tuples(
                        st.sampled_from(sorted(b.pools)),
                        st.integers(0, 32 * 1024).map(lambda n: n * MiB),
                        st.integers(0, 32 * 1024).map(lambda n: n * MiB),
                    ),
                    max_size=3,
                )
            )
        )
    ]
    receipts = draw(
        st.lists(
            st.builds(
                lambda t, d, h: receipt(t, CUDA0=d, CPU=h),
                st.integers(1, 65536),
                st.integers(0, 512).map(lambda n: n * MiB),
                st.integers(0, 512).map(lambda n: n * MiB),
            ),
            max_size=3,
        )
    )
    return {
        "board": b,
        "others": others,
        "where": draw(st.sampled_from(list(Residence))),
        "max": draw(st.integers(1, 65536)),
        "sizer": LaneSizer(FACTS, tuple(receipts)),
        "largest": draw(st.lists(st.integers(0, 65536), min_size=1, max_size=5)),
    }


@settings(settings.get_profile("lanes"))
@given(scenes())
def test_a_lane_never_over_commits_a_pool(scene: dict[str, Any]) -> None:
    b, others = scene["board"], scene["others"]
    ledger = BoardLeases.of(b, others)
    p = place(b, others, LaneAsk(LANE, scene["max"]), scene["where"], scene["sizer"])
    if p.verdict is not LaneVerdict.FITS:
        assert p.leases() == []
        return
    assert p.context_tokens <= scene["max"]
    for pool, n in p.charges.items():
        available = ledger.available_bytes(pool)
        assert available is not None and n <= available
    after = BoardLeases.of(b, [*others, *p.leases()])
    for pool in p.charges:
        assert after.leased_bytes(pool) <= max(
            b.pools[pool].capacity_bytes, ledger.leased_bytes(pool)
        )


@settings(settings.get_profile("lanes"))
@given(scenes())
def test_a_lanes_floors_never_fall_while_it_lives(scene: dict[str, Any]) -> None:
    b, others = scene["board"], scene["others"]
    floors: dict[str, int] = {}
    leases: list[Lease] = []
    largest = 0
    for embedded in scene["largest"]:
        largest = max(largest, min(embedded, scene["max"]))
        p = place(b, [*others, *leases], LaneAsk(LANE, scene["max"], largest, floors),
                  scene["where"], scene["sizer"])  # fmt: skip
        for pool, n in floors.items():
            assert p.floors.get(pool, 0) >= n
        for lease in p.leases():
            assert lease.bytes >= lease.floor_bytes
        floors, leases = dict(p.floors), p.leases()


@settings(settings.get_profile("lanes"))
@given(
    st.lists(st.integers(0, 70000), min_size=1, max_size=8),
    st.integers(1, 65536),
    st.integers(0, 65536),
)
def test_a_request_fits_only_within_the_lease_and_the_maximum(
    tokens: list[int], max_ctx: int, leased: int
) -> None:
    a = admit(tokens, max_context_tokens=max_ctx, leased_context_tokens=leased)
    biggest = max(tokens)
    if a.verdict is LaneVerdict.FITS:
        assert biggest <= leased and biggest <= max_ctx
    elif a.verdict is LaneVerdict.FAILS:
        assert biggest > max_ctx
    else:
        assert biggest > leased or leased == 0


def test_a_lane_with_a_model_of_its_own_is_charged_its_weights_with_its_context() -> None:
    ask = LaneAsk(LANE, max_context_tokens=2048, largest_embedded_tokens=2048)
    without = place(discrete(), [], ask)
    weights = 600 * MiB
    own = place(discrete(), [], LaneAsk(LANE, 2048, 2048, weights_bytes=weights))
    assert own.charges["host"] == without.charges["host"] + weights
    assert own.floors["host"] == without.floors["host"] + weights


def test_bytes_above_every_receipt_are_scaled_by_the_cells_llama_cpp_makes() -> None:
    # Receipts are filed by cells; a lease of 300 tokens is a context of 512 cells. It was
    # charged 300/256 of the 256-cell receipt, not 512/256.
    from continuum_operator.core.embed import context_cells

    kv = 2 * GiB  # a receipt well above the estimate (another backend)
    r = Receipt(model_sha256=SHA, context_tokens=256, llama_build="b1",
                buffers=[ReceiptBuffer(device="CPU", kind=BufferKind.KV, bytes=kv)])  # fmt: skip
    got = LaneSizer(FACTS, (r,)).measured(300)
    assert got is not None and context_cells(300) == 512
    assert got.total >= kv * 512 // 256
    assert LaneSizer(FACTS, (r,)).measured(256) == LaneSizer(FACTS, (r,)).measured(200)
