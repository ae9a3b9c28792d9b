"""Estimate (made before loading) versus receipt (what llama.cpp allocated), per buffer.

docs/design.md rule 5. For held-out generated shapes (none of them among the shapes the compute
estimate was fitted on): a 128k-vocabulary model of small width, GQA, MQA and non-GQA models,
flash attention on and off, f16 and q8_0 KV, three contexts. The estimate comes from the GGUF
facts alone (`gguf.read_facts`, `core.compute`, the plan's KV sizing); the receipt from the log
of llama-cpp-python loading the same file (`core.receipts.parse_llama_log`). Everything runs on
the CPU, so the one pool is the host: model, KV, compute and output buffers.

Target: the total within 3% and never under. Run: `.venv/bin/python bench/estimate.py`
(needs the llama-cpp-python wheel: `tools/llama install .venv/bin/python`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from continuum_operator.core.compute import ComputeEstimate
from continuum_operator.core.plan import _Shape
from continuum_operator.core.receipts import BufferKind, parse_llama_log
from continuum_operator.gguf import read_facts
from continuum_operator.model.engine import KvCacheType
from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from continuum_operator.testing.llama_load import load_and_log

MIB = 1 << 20
TARGET = 0.03

SHAPES = {
    # 128k vocabulary, width 64: the logits dominate the compute buffer
    "v128k-e64-gqa": TinyModelShape(n_layer=2, n_embd=64, n_head=2, n_head_kv=1, n_ff=192,
                                    vocab_size=131_072, context_length=32_768),
    "v32k-e256-gqa": TinyModelShape(n_layer=4, n_embd=256, n_head=8, n_head_kv=2, n_ff=704,
                                    vocab_size=32_000, context_length=32_768),
    "v16k-e192-mha": TinyModelShape(n_layer=3, n_embd=192, n_head=6, n_head_kv=6, n_ff=512,
                                    vocab_size=16_384, context_length=32_768),
    "v50k-e160-mqa-k48": TinyModelShape(n_layer=3, n_embd=160, n_head=4, n_head_kv=1, n_ff=448,
                                        key_length=48, value_length=48, vocab_size=50_000,
                                        context_length=32_768),
    "v1k-e128-mha": TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=4, n_ff=352,
                                   vocab_size=1000, context_length=32_768),
}  # fmt: skip
CONTEXTS = (1024, 4096, 16384)


@dataclass(frozen=True)
class Row:
    shape: str
    flash: bool
    kv: str
    ctx: int
    est: dict[str, int]
    got: dict[str, int]

    @property
    def total_error(self) -> float:
        e, g = sum(self.est.values()), sum(self.got.values())
        return (e - g) / g

    @property
    def ok(self) -> bool:
        # a printed size is within 0.005 MiB of the truth: under by less is not under
        slack = 0.005 * MIB * len(self.got)
        e, g = sum(self.est.values()), sum(self.got.values())
        return e + slack >= g and self.total_error <= TARGET


def estimate(path: Path, ctx: int, flash: bool, kv: KvCacheType) -> dict[str, int]:
    facts = read_facts(path)
    shape = _Shape.of(facts, kv)
    compute = ComputeEstimate(facts, flash_attention=flash)
    return {
        "model": facts.input_bytes + sum(facts.layer_bytes_list()) + facts.output_host,
        "kv": shape.kv_bytes(0, facts.layers, ctx, 1),
        "compute": compute.graph_bytes(ctx, 1),
        "output": compute.output_bytes(1),
    }


def receipt(path: Path, ctx: int, flash: bool, kv: KvCacheType) -> dict[str, int]:
    log = parse_llama_log(load_and_log(path, n_ctx=ctx, flash_attn=flash, kv_type=str(kv)))
    got = {k.value: 0 for k in (BufferKind.MODEL, BufferKind.KV, BufferKind.COMPUTE,
                                BufferKind.OUTPUT)}  # fmt: skip
    for b in log.buffers:
        got[b.kind.value] += b.bytes
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", choices=sorted(SHAPES), help="only these")
    args = ap.parse_args(argv)
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.shape or list(SHAPES):
            path = write_tiny_gguf(Path(tmp) / f"{name}.gguf", SHAPES[name])
            for flash in (True, False):
                for kv in (KvCacheType.F16, KvCacheType.Q8_0):
                    if kv is KvCacheType.Q8_0 and not flash:
                        continue  # llama.cpp needs flash attention for a quantised V cache
                    if kv is KvCacheType.Q8_0 and SHAPES[name].n_embd_k_gqa % 32:
                        continue  # q8_0 rows are blocks of 32: llama.cpp refuses this width
                    for ctx in CONTEXTS:
                        rows.append(Row(name, flash, str(kv), ctx,
                                        estimate(path, ctx, flash, kv),
                                        receipt(path, ctx, flash, kv)))  # fmt: skip
                        print_row(rows[-1])
    misses = [r for r in rows if not r.ok]
    under = [r for r in rows if sum(r.est.values()) + 0.005 * MIB * 4 < sum(r.got.values())]
    worst = max(r.total_error for r in rows), min(r.total_error for r in rows)
    print(f"\n{len(rows)} cases; {len(rows) - len(misses)} within {TARGET:.0%} and not under; "
          f"{len(under)} under; total error from {worst[1]:+.2%} to {worst[0]:+.2%}")  # fmt: skip
    for r in misses:
        print(f"  miss: {r.shape} fa={'on' if r.flash else 'off'} kv={r.kv} ctx={r.ctx}: "
              f"total {r.total_error:+.2%}")  # fmt: skip
    return 0 if not misses else 1


HEADER = False


def print_row(r: Row) -> None:
    global HEADER
    if not HEADER:
        print(f"{'shape':<20} {'fa':<3} {'kv':<5} {'ctx':>6}  " + "  ".join(
            f"{k + ' est/got MiB (err)':<29}" for k in ("model", "kv", "compute", "output"))
            + "  total err")  # fmt: skip
        HEADER = True
    cells = []
    for k in ("model", "kv", "compute", "output"):
        e, g = r.est[k], r.got[k]
        err = (e - g) / g if g else 0.0
        cells.append(f"{e / MIB:9.2f}/{g / MIB:9.2f} ({err:+6.1%})")
    flag = "" if r.ok else "  MISS"
    print(f"{r.shape:<20} {'on' if r.flash else 'off':<3} {r.kv:<5} {r.ctx:>6}  "
          + "  ".join(cells) + f"  {r.total_error:+6.2%}{flag}", flush=True)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
