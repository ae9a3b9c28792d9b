"""Receipts: llama.cpp's log parsed per device, receipt files, and the plan using them."""

from __future__ import annotations

from pathlib import Path

import pytest

from continuum_operator.core.plan import ReasonCode, plan
from continuum_operator.core.receipts import (
    BufferKind,
    Receipt,
    ReceiptBuffer,
    ReceiptPlacement,
    is_host_buffer,
    llama_build_of,
    parse_llama_log,
)
from continuum_operator.engine.receipts import ReceiptFileError, load_receipts
from continuum_operator.model.engine import KvCacheType
from tests.support.builders import GiB, MiB, board, board_body, engine, engine_body

SHA = "ab" * 32

# Lines as llama-cpp-python 0.3.36 logged them loading a 4-layer tiny model on the CPU.
CPU_LOG = """\
load_tensors: loading model tensors, this can take a while... (mmap = true, direct_io = false)
load_tensors:   CPU_Mapped model buffer size =     1.38 MiB
llama_context: n_seq_max             = 1
llama_context: n_ctx                 = 2048
llama_context: n_ctx_seq             = 2048
llama_context: n_ubatch              = 512
llama_context: flash_attn            = enabled
llama_context:        CPU  output buffer size =     0.00 MiB
llama_kv_cache:        CPU KV buffer size =     2.00 MiB
llama_kv_cache: size =    2.00 MiB (  2048 cells,   4 layers,  1/1 seqs), K (f16):    1.00 MiB, V (f16):    1.00 MiB
sched_reserve:        CPU compute buffer size =     4.26 MiB
"""  # noqa: E501

# A partly offloaded load on a GPU, with an interleaved sliding-window model (two KV caches)
# and a compute buffer reserved twice; as llama-server prints it, with timestamps.
GPU_LOG = """\
0.00.010.000 I build: 6869 (1a2b3c4d) with cc (GCC) 13 for x86_64-linux-gnu
0.00.100.000 I load_tensors: offloaded 20/27 layers to GPU
0.00.100.001 I load_tensors:        CUDA0 model buffer size =  1200.50 MiB
0.00.100.002 I load_tensors:   CPU_Mapped model buffer size =   300.25 MiB
0.00.200.000 I llama_context: n_seq_max             = 2
0.00.200.001 I llama_context:  CUDA_Host  output buffer size =     1.00 MiB
0.00.200.002 I llama_kv_cache:      CUDA0 KV buffer size =   100.00 MiB
0.00.200.003 I llama_kv_cache:        CPU KV buffer size =    20.00 MiB
0.00.200.004 I llama_kv_cache: size =  120.00 MiB (  4096 cells,  27 layers,  2/2 seqs), K (q8_0):   60.00 MiB, V (q8_0):   60.00 MiB
0.00.200.005 I llama_kv_cache:      CUDA0 KV buffer size =    10.00 MiB
0.00.300.000 I sched_reserve:      CUDA0 compute buffer size =   500.00 MiB
0.00.300.001 I sched_reserve:      CUDA0 compute buffer size =   510.00 MiB
0.00.300.002 I sched_reserve:  CUDA_Host compute buffer size =    20.00 MiB
"""  # noqa: E501


def _mib(x: float) -> int:
    return round(x * MiB)


def test_the_cpu_log_gives_model_kv_compute_and_output_buffers() -> None:
    parsed = parse_llama_log(CPU_LOG)
    got = {(b.kind, b.device): b.bytes for b in parsed.buffers}
    assert got == {
        (BufferKind.MODEL, "CPU_Mapped"): _mib(1.38),
        (BufferKind.OUTPUT, "CPU"): 0,
        (BufferKind.KV, "CPU"): _mib(2.0),
        (BufferKind.COMPUTE, "CPU"): _mib(4.26),
    }
    assert (parsed.n_ctx, parsed.n_seq_max, parsed.n_ubatch) == (2048, 1, 512)
    assert parsed.flash_attention is True
    assert parsed.kv_type_k == "f16"


def test_kv_caches_add_up_and_the_last_compute_reservation_counts_per_device() -> None:
    parsed = parse_llama_log(GPU_LOG)
    got = {(b.kind, b.device): b.bytes for b in parsed.buffers}
    assert got[(BufferKind.KV, "CUDA0")] == _mib(110.0)
    assert got[(BufferKind.KV, "CPU")] == _mib(20.0)
    assert got[(BufferKind.COMPUTE, "CUDA0")] == _mib(510.0)
    assert got[(BufferKind.COMPUTE, "CUDA_Host")] == _mib(20.0)
    assert got[(BufferKind.OUTPUT, "CUDA_Host")] == _mib(1.0)
    assert (parsed.layers_offloaded, parsed.layers_total) == (20, 27)
    assert parsed.build == "6869 (1a2b3c4d)"
    receipt = parsed.receipt(model_sha256=SHA, context_tokens=4096, gpus=1)
    assert receipt.kv_cache_type is KvCacheType.Q8_0
    assert receipt.placement == ReceiptPlacement(layers_on_device=20, gpus=1)
    assert receipt.parallel == 2
    assert receipt.total(BufferKind.MODEL, host=False) == _mib(1200.5)
    assert receipt.total(host=True) == _mib(300.25) + _mib(20) + _mib(20) + _mib(1)


def test_host_buffers_are_the_cpu_and_pinned_ones() -> None:
    assert is_host_buffer("CPU_Mapped") and is_host_buffer("CUDA_Host") and is_host_buffer("CPU")
    assert not is_host_buffer("CUDA0") and not is_host_buffer("MTL0")


def test_a_log_without_a_build_needs_one_named() -> None:
    with pytest.raises(ValueError, match="build"):
        parse_llama_log(CPU_LOG).receipt(model_sha256=SHA, context_tokens=2048)
    r = parse_llama_log(CPU_LOG).receipt(model_sha256=SHA, context_tokens=2048, llama_build="b1")
    assert r.key.llama_build == "b1" and r.placement.layers_on_device == 0


def _receipt(**kw: object) -> Receipt:
    fields: dict[str, object] = {
        "model_sha256": SHA,
        "context_tokens": 8192,
        "kv_cache_type": "f16",
        "placement": {"layersOnDevice": 0, "gpus": 0},
        "llama_build": "b6869",
        "parallel": 1,
        "buffers": [
            ReceiptBuffer(device="CPU_Mapped", kind=BufferKind.MODEL, bytes=7000 * MiB),
            ReceiptBuffer(device="CPU", kind=BufferKind.KV, bytes=1024 * MiB),
            ReceiptBuffer(device="CPU", kind=BufferKind.COMPUTE, bytes=100 * MiB),
            ReceiptBuffer(device="CPU", kind=BufferKind.OUTPUT, bytes=1 * MiB),
        ],
        "source": "test",
    }
    fields.update(kw)
    return Receipt.model_validate(fields)


def _cpu_plan(receipts: list[Receipt], sha: str | None = SHA, build: str | None = None):  # type: ignore[no-untyped-def]
    b = board(board_body("unknown", [{"kind": "host", "capacityBytes": 64 * GiB}]))
    e = engine(engine_body(model={"sha256": sha, "facts": engine_body()["spec"]["model"]["facts"]},
                           offload="none", minds={"min": 1, "max": 1}))  # fmt: skip
    assert e.spec.model.facts is not None
    return plan(b, e.spec, e.spec.model.facts, receipts=receipts, llama_build=build)


def test_a_matching_receipt_replaces_the_estimate_and_the_plan_says_so() -> None:
    estimated = _cpu_plan([])
    measured = _cpu_plan([_receipt()])
    codes = {r.code for r in measured.reasons}
    assert ReasonCode.RECEIPT_USED in codes
    assert ReasonCode.RECEIPT_USED not in {r.code for r in estimated.reasons}
    slack = 5243  # each buffer rounded up by the log's 0.005 MiB
    assert measured.host.weights == 7000 * MiB + slack
    assert measured.host.kv == 1024 * MiB + slack
    assert measured.host.compute == 101 * MiB + 2 * slack
    assert measured.host.weights != estimated.host.weights


@pytest.mark.parametrize(
    "change",
    [
        {"model_sha256": "cd" * 32},
        {"context_tokens": 4096},
        {"kv_cache_type": "q8_0"},
        {"placement": {"layersOnDevice": 3, "gpus": 1}},
        {"parallel": 2},
        {"flash_attention": False},
    ],
    ids=[
        "another_model",
        "another_context",
        "another_kv_type",
        "another_placement",
        "another_parallel",
        "without_flash_attention",
    ],
)
def test_a_receipt_under_another_key_is_not_used(change: dict[str, object]) -> None:
    p = _cpu_plan([_receipt(**change)])
    assert ReasonCode.RECEIPT_USED not in {r.code for r in p.reasons}


def test_an_engine_of_a_context_under_512_finds_its_receipt_under_llamas_clamped_micro_batch() -> (
    None
):
    # Seen on the real node: llama.cpp ran a 256-token engine with n_ubatch 256 (it clamps the
    # micro-batch to the context), and the plan, asking for 512, never used the receipt.
    b = board(board_body("unknown", [{"kind": "host", "capacityBytes": 64 * GiB}]))
    e = engine(engine_body(model={"sha256": SHA, "facts": engine_body()["spec"]["model"]["facts"]},
                           offload="none", minds={"min": 1, "max": 1},
                           contextTokensPerMind=256))  # fmt: skip
    assert e.spec.model.facts is not None
    # Its buffers are those of a 256-token load (the KV a 32nd of the 8,192-token one's).
    buffers = [
        b.model_copy(update={"bytes": 32 * MiB}) if b.kind is BufferKind.KV else b
        for b in _receipt().buffers
    ]
    small = _receipt(context_tokens=256, micro_batch_tokens=256, buffers=buffers)
    p = plan(b, e.spec, e.spec.model.facts, receipts=[small])
    assert ReasonCode.RECEIPT_USED in {r.code for r in p.reasons}
    at_512 = _receipt(context_tokens=256, buffers=buffers)
    p = plan(b, e.spec, e.spec.model.facts, receipts=[at_512])
    assert ReasonCode.RECEIPT_USED not in {r.code for r in p.reasons}  # 512: not what ran


def test_a_receipt_of_another_build_is_not_used_when_the_build_is_known() -> None:
    assert ReasonCode.RECEIPT_USED not in {
        r.code for r in _cpu_plan([_receipt()], build="b1").reasons
    }
    assert ReasonCode.RECEIPT_USED in {
        r.code for r in _cpu_plan([_receipt()], build="b6869").reasons
    }


def test_an_engine_without_a_model_digest_uses_no_receipt() -> None:
    assert ReasonCode.RECEIPT_USED not in {
        r.code for r in _cpu_plan([_receipt()], sha=None).reasons
    }


def test_a_mixture_of_experts_says_expert_offload_is_not_planned() -> None:
    facts = {**engine_body()["spec"]["model"]["facts"], "expertCount": 64, "expertUsedCount": 8}
    e = engine(engine_body(model={"facts": facts}))
    b = board(board_body("unknown", [{"kind": "host", "capacityBytes": 64 * GiB}]))
    assert e.spec.model.facts is not None
    p = plan(b, e.spec, e.spec.model.facts)
    reason = next(r for r in p.reasons if r.code is ReasonCode.EXPERT_OFFLOAD_NOT_PLANNED)
    assert "64 experts" in reason.message


def test_window_layers_hold_the_windows_cells_not_the_context() -> None:
    facts = {**engine_body()["spec"]["model"]["facts"], "computeBytes": None,
             "layers": 4, "layerBytes": MiB, "kvBytesPerTokenPerLayer": 1000,
             "slidingWindow": 1024, "slidingWindowLayers": [0, 1, 2]}  # fmt: skip
    e = engine(engine_body(model={"facts": facts}, offload="none", contextTokensPerMind=32768,
                           minds={"min": 1, "max": 1}))  # fmt: skip
    b = board(board_body("unknown", [{"kind": "host", "capacityBytes": 64 * GiB}]))
    assert e.spec.model.facts is not None
    p = plan(b, e.spec, e.spec.model.facts)
    assert p.host.kv == 1000 * 32768 + 3 * 1000 * (1024 + 512)
    assert ReasonCode.SLIDING_WINDOW_KV in {r.code for r in p.reasons}


def test_receipt_files_load_from_yaml_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    good = tmp_path / "r.yaml"
    good.write_text(
        "kind: Receipt\nmodelSha256: " + SHA + "\ncontextTokens: 8192\nllamaBuild: b1\n"
        "buffers:\n- {device: CPU, kind: kv, bytes: 1024}\n---\n"
        "modelSha256: " + SHA + "\ncontextTokens: 4096\nllamaBuild: b1\n"
    )
    assert [r.context_tokens for r in load_receipts([good])] == [8192, 4096]
    bad = tmp_path / "bad.json"
    bad.write_text('{"modelSha256": "xyz", "contextTokens": 1, "llamaBuild": "b"}')
    with pytest.raises(ReceiptFileError, match=r"bad.json: receipt 0: modelSha256"):
        load_receipts([bad])


def test_llama_servers_own_build_line_names_the_build() -> None:
    # llama-server (at -lv 4) logs its build after two prefixes, not as a line of its own.
    line = (
        "0.00.003.862 I cmn  common_param: common_params_print_info: build 1 (0c1e57098) "
        "with GNU 12.2.0 for Linux x86_64"
    )
    assert parse_llama_log(line).build == "1 (0c1e57098)"
    assert llama_build_of("rebuild 2 (abc)") is None


@pytest.mark.parametrize(
    "kept",
    [
        (),  # a load log cut before its buffers: "receipt filed with buffers {}"
        (BufferKind.MODEL, BufferKind.KV),  # no compute graph
        (BufferKind.KV, BufferKind.COMPUTE),  # no weights
        (BufferKind.MODEL, BufferKind.COMPUTE, BufferKind.OUTPUT),  # no per-sequence memory
    ],
    ids=["no-buffers", "no-compute", "no-weights", "no-kv"],
)
def test_a_receipt_lacking_a_part_is_never_planned_from(kept: tuple[BufferKind, ...]) -> None:
    # It would charge that part nothing: an engine holding 8 GB leased as a few MB (an engine
    # pod writes its own status.runtime, where the operator finds receipts).
    partial = _receipt(buffers=[b for b in _receipt().buffers if b.kind in kept])
    assert not partial.complete
    p = _cpu_plan([partial])
    assert ReasonCode.RECEIPT_USED not in {r.code for r in p.reasons}
    assert p.host.weights == _cpu_plan([]).host.weights


def test_a_load_log_cut_short_gives_no_receipt_saying_what_it_named() -> None:
    cut = CPU_LOG.split("llama_kv_cache:")[0]  # the weights only
    with pytest.raises(ValueError, match=r"names: model, output\); cut short"):
        parse_llama_log(cut).receipt(model_sha256=SHA, context_tokens=2048, llama_build="b1")


def test_a_recurrent_models_state_is_in_its_receipt_and_charged_as_its_slots_memory() -> None:
    # llama.cpp's llama_memory_recurrent: one state per sequence (Mamba, Jamba, Qwen3-Next).
    log = CPU_LOG.replace(
        "llama_kv_cache:        CPU KV buffer size =     2.00 MiB\n",
        "llama_memory_recurrent:        CPU RS buffer size =   804.00 MiB\n",
    )
    parsed = parse_llama_log(log)
    assert {(b.kind, b.device): b.bytes for b in parsed.buffers}[
        (BufferKind.RECURRENT, "CPU")
    ] == _mib(804.0)
    receipt = parsed.receipt(model_sha256=SHA, context_tokens=2048, llama_build="b1")
    assert receipt.complete  # the state stands for the KV cache
    buffers = [b for b in _receipt().buffers if b.kind is not BufferKind.KV] + [
        ReceiptBuffer(device="CPU", kind=BufferKind.RECURRENT, bytes=804 * MiB)
    ]
    measured = _cpu_plan([_receipt(buffers=buffers)])
    assert ReasonCode.RECEIPT_USED in {r.code for r in measured.reasons}
    assert measured.host.kv == 804 * MiB + 5243  # rounded up by the log's 0.005 MiB


@pytest.mark.parametrize("log", [CPU_LOG, GPU_LOG], ids=["cpu", "gpu"])
def test_the_lines_a_runtime_keeps_are_all_the_parser_reads(log: str) -> None:
    from continuum_operator.core.receipts import read_for_receipt

    lines = [*log.splitlines(), "llama_model_loader: - kv   0: general.name str = tiny"]
    kept = [line for line in lines if read_for_receipt(line)]
    assert parse_llama_log(kept) == parse_llama_log(lines)
    assert len(kept) < len(lines)
