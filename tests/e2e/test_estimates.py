"""A plan made from a generated GGUF, before loading, against what llama.cpp then allocates.

With no receipt the plan's bytes are estimates from the file's facts; weights and KV must be
exactly what llama.cpp reports when it loads the same file at the same context (to the 0.01
MiB its log prints), and the compute and output buffers never under what it reports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from continuum_operator.core.plan import ReasonCode, plan
from continuum_operator.core.receipts import BufferKind, parse_llama_log
from continuum_operator.gguf import file_sha256, read_facts
from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from continuum_operator.testing.llama_load import llama_build, load_and_log
from tests.support.builders import GiB, MiB, board, board_body, engine, engine_body
from tests.support.llama_server import import_llama_cpp

pytestmark = pytest.mark.e2e

PRINTED = 0.005 * MiB  # llama.cpp prints MiB with two decimals

CASES = {
    "gqa-f16-ctx2048": (TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2,
                                       context_length=8192), 2048, "f16"),
    "mha-k64-q8_0-ctx1000": (TinyModelShape(n_layer=3, n_embd=96, n_head=4, n_head_kv=4, n_ff=192,
                                            key_length=64, value_length=64, vocab_size=3000,
                                            context_length=8192), 1000, "q8_0"),
    "tied-v32k-ctx4096": (TinyModelShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=128,
                                         vocab_size=32_000, tied_output=True,
                                         context_length=8192), 4096, "f16"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_a_plan_without_receipts_charges_the_weights_and_kv_llama_cpp_allocates(
    name: str, tmp_path: Path
) -> None:
    import_llama_cpp()
    shape, ctx, kv = CASES[name]
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", shape)
    facts = read_facts(path)
    body = engine_body(
        model={"facts": facts.model_dump(by_alias=True, exclude_none=True)},
        contextTokensPerMind=ctx,
        minds={"min": 1, "max": 1},
        offload="none",
        kvCacheType=kv,
        reserveBytes=0,
    )
    node = board(board_body("unknown", [{"kind": "host", "capacityBytes": 64 * GiB}]))
    spec = engine(body).spec
    p = plan(node, spec, facts)
    assert p.schedulable and p.layers_on_device == 0

    got = parse_llama_log(load_and_log(path, n_ctx=ctx, flash_attn=True, kv_type=kv))
    model = sum(b.bytes for b in got.buffers if b.kind is BufferKind.MODEL)
    kv_bytes = sum(b.bytes for b in got.buffers if b.kind is BufferKind.KV)
    measured_compute = sum(
        b.bytes for b in got.buffers if b.kind in (BufferKind.COMPUTE, BufferKind.OUTPUT)
    )
    assert abs(p.host.weights - model) <= PRINTED
    assert abs(p.host.kv - kv_bytes) <= PRINTED
    assert p.host.compute + 2 * PRINTED >= measured_compute
    assert p.device.in_use == 0


def test_a_receipt_from_the_log_is_used_by_the_next_plan(tmp_path: Path) -> None:
    import_llama_cpp()
    shape, ctx, kv = CASES["gqa-f16-ctx2048"]
    path = write_tiny_gguf(tmp_path / "m.gguf", shape)
    facts = read_facts(path)
    sha = file_sha256(path)
    receipt = parse_llama_log(load_and_log(path, n_ctx=ctx)).receipt(
        model_sha256=sha, context_tokens=ctx, llama_build=llama_build(), source="e2e"
    )
    body = engine_body(
        model={"sha256": sha, "facts": facts.model_dump(by_alias=True, exclude_none=True)},
        contextTokensPerMind=ctx,
        minds={"min": 1, "max": 1},
        offload="none",
        kvCacheType=kv,
    )
    node = board(board_body("unknown", [{"kind": "host", "capacityBytes": 64 * GiB}]))
    p = plan(node, engine(body).spec, facts, receipts=[receipt], llama_build=llama_build())
    assert ReasonCode.RECEIPT_USED in {r.code for r in p.reasons}
    assert p.host.compute >= receipt.total(BufferKind.COMPUTE) + receipt.total(BufferKind.OUTPUT)
