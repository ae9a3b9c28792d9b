"""The staged plan and the lanes on the board's memory modes give what the inline ones gave.

A temporary oracle: `tests/unit/oracle/` holds `core/plan.py` and `core/embed.py` as they were
before the modes moved into `core.modes`; on random boards, engines, leases, GPUs kept and
lanes, the new code must answer exactly as they did.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from continuum_operator.core import embed
from continuum_operator.core.plan import plan
from continuum_operator.core.pools import Ledger
from continuum_operator.core.receipts import BufferKind, Receipt, ReceiptBuffer
from tests.builders import MiB, board, engine
from tests.unit.oracle import old_embed, old_plan
from tests.unit.test_plan_properties import boards, engines, leases_for


@settings(max_examples=1500)
@given(st.data())
def test_every_plan_is_the_one_the_inline_modes_made(data: st.DataObject) -> None:
    b = board(data.draw(boards()))
    spec = engine(data.draw(engines())).spec
    assert spec.model.facts is not None
    ledger = Ledger.of(b, data.draw(leases_for(b)))
    gpus = sorted(b.pools)
    on_gpus = data.draw(st.lists(st.integers(0, 4), max_size=3))
    crediting = data.draw(st.sampled_from([None, "Engine/ns/other-0"]))
    receipts: list[Receipt] = []
    if data.draw(st.booleans()):
        spec = spec.model_copy(update={"model": spec.model.model_copy(update={"sha256": "a" * 64})})
        level = data.draw(st.integers(0, spec.model.facts.layers + 1)) if spec.model.facts else 0
        minds = data.draw(st.integers(spec.minds.min, spec.minds.max))
        receipts.append(
            Receipt(
                model_sha256="a" * 64,
                context_tokens=minds * spec.context_tokens_per_mind,
                kv_cache_type=spec.kv_cache_type,
                llama_build="b1",
                parallel=minds,
                placement={"layersOnDevice": level, "gpus": spec.placement.gpus if level else 0},
                buffers=[
                    ReceiptBuffer(device="CUDA0", kind=BufferKind.MODEL, bytes=7 * MiB),
                    ReceiptBuffer(device="CPU", kind=BufferKind.KV, bytes=3 * MiB),
                ],
            )
        )
    facts = spec.model.facts
    assert facts is not None
    kw = {"crediting": crediting, "receipts": receipts, "on_gpus": on_gpus}
    new = plan(b, spec, facts, ledger, **kw)  # type: ignore[arg-type]
    old = old_plan.plan(b, spec, facts, ledger, **kw)  # type: ignore[arg-type]
    assert new.to_dict() == old.to_dict(), gpus
    assert new.receipt == old.receipt


@settings(max_examples=1500)
@given(st.data())
def test_every_lane_is_placed_and_charged_as_the_inline_modes_did(data: st.DataObject) -> None:
    b = board(data.draw(boards()))
    ledger = Ledger.of(b, data.draw(leases_for(b)))
    spec = engine(data.draw(engines())).spec
    facts = spec.model.facts
    assert facts is not None
    where = data.draw(st.sampled_from(list(embed.Residence)))
    gpus = data.draw(st.lists(st.integers(0, 4), max_size=3, unique=True))
    cb = embed.ContextBytes(data.draw(st.integers(0, 2**34)), data.draw(st.integers(0, 2**34)))
    old_where = old_embed.Residence(str(where))
    old_cb = old_embed.ContextBytes(cb.device, cb.host)
    assert embed.lane_charges(b, where, gpus, cb) == old_embed.lane_charges(
        b, old_where, gpus, old_cb
    )
    pools = sorted(b.pools)
    ask = embed.LaneAsk(
        consumer="EmbedLane/ns/lane",
        max_context_tokens=data.draw(st.integers(1, 65536)),
        largest_embedded_tokens=data.draw(st.integers(0, 65536)),
        floors={p: data.draw(st.integers(0, 2**30)) for p in pools if data.draw(st.booleans())},
        weights_bytes=data.draw(st.integers(0, 2**32)),
    )
    old_ask = old_embed.LaneAsk(
        ask.consumer,
        ask.max_context_tokens,
        ask.largest_embedded_tokens,
        dict(ask.floors),
        ask.weights_bytes,
    )
    why = embed.LaneReason.SPLIT_ENGINE
    new = embed.place_lane(
        b, ledger, ask, embed.LaneSizer(facts), where=where, residence_reason=why, gpus=gpus
    )
    old = old_embed.place_lane(
        b,
        ledger,
        old_ask,
        old_embed.LaneSizer(facts),
        where=old_where,
        residence_reason=old_embed.LaneReason(str(why)),
        gpus=gpus,
    )
    assert new.to_dict() == old.to_dict()
    assert new.leases() == old.leases()
