"""Model facts from GGUF headers: generated files read back, and headers llama.cpp would meet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from continuum_operator import cli
from continuum_operator.gguf import (
    FactsError,
    GgufHeader,
    GgufReadError,
    TensorEntry,
    facts_from_header,
    read_facts,
)
from continuum_operator.testing import TinyModelShape, write_tiny_gguf

F16 = 2
F32 = 4


def _write(tmp_path: Path, shape: TinyModelShape) -> Path:
    return write_tiny_gguf(tmp_path / "m.gguf", shape)


def test_layer_input_and_output_bytes_are_the_tensor_index_sums(tmp_path: Path) -> None:
    shape = TinyModelShape(n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, vocab_size=600)
    facts = read_facts(_write(tmp_path, shape))
    e, ff = 64, 96
    q, kv = 4 * 16, 2 * 16
    per_layer = (e * q + 2 * e * kv + q * e + 3 * e * ff) * F16 + 2 * e * F32
    assert facts.layers == 3
    assert facts.layer_bytes == per_layer
    assert facts.input_bytes == 600 * e * F16
    assert facts.output_bytes == 600 * e * F16 + e * F32  # output.weight and output_norm
    assert facts.output_host == facts.output_bytes
    assert facts.architecture == "llama"
    assert facts.vocab_size == 600
    assert facts.context_length == shape.context_length
    assert (facts.embedding_length, facts.head_count, facts.head_count_kv) == (64, 4, 2)
    assert facts.feed_forward_length == 96


def test_kv_follows_the_key_length_not_n_embd_over_n_head(tmp_path: Path) -> None:
    shape = TinyModelShape(n_embd=128, n_head=4, n_head_kv=2, key_length=48, value_length=48)
    facts = read_facts(_write(tmp_path, shape))
    assert facts.key_length == facts.value_length == 48
    assert facts.kv_bytes_per_token_per_layer == 2 * 2 * 48 * F16
    assert facts.kv_bytes_per_token_per_layer * shape.n_layer == shape.kv_bytes_per_token(F16)


def test_without_key_length_the_head_size_is_n_embd_over_n_head(tmp_path: Path) -> None:
    facts = read_facts(_write(tmp_path, TinyModelShape(n_embd=128, n_head=4, n_head_kv=4)))
    assert facts.key_length == 32
    assert facts.kv_bytes_per_token_per_layer == 2 * 4 * 32 * F16


def test_a_tied_head_costs_a_copy_of_the_embeddings_on_the_device_only(tmp_path: Path) -> None:
    shape = TinyModelShape(tied_output=True, vocab_size=700, n_embd=128)
    facts = read_facts(_write(tmp_path, shape))
    embeddings = 700 * 128 * F16
    assert facts.output_bytes == embeddings + 128 * F32
    assert facts.output_host_bytes == 128 * F32


def test_a_file_that_is_not_gguf_is_refused_with_its_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a model at all")
    with pytest.raises(GgufReadError, match=r"bad\.gguf"):
        read_facts(bad)
    with pytest.raises(GgufReadError, match="no such file"):
        read_facts(tmp_path / "missing.gguf")


def _header(arch: str, meta: dict[str, Any], layers: int = 4) -> GgufHeader:
    tensors = [TensorEntry("token_embd.weight", "F16", 1000 * 64, 1000 * 64 * F16)]
    tensors += [TensorEntry(f"blk.{i}.attn_q.weight", "F16", 64 * 64, 64 * 64 * F16)
                for i in range(layers)]  # fmt: skip
    tensors.append(TensorEntry("output.weight", "F16", 1000 * 64, 1000 * 64 * F16))
    base: dict[str, Any] = {
        "general.architecture": arch,
        f"{arch}.block_count": layers,
        f"{arch}.embedding_length": 64,
        f"{arch}.attention.head_count": 4,
    }
    return GgufHeader(metadata={**base, **meta}, tensors=tuple(tensors), source="test.gguf")


def test_per_layer_kv_heads_give_one_kv_rate_per_layer() -> None:
    facts = facts_from_header(_header("llama", {"llama.attention.head_count_kv": [4, 2, 0, 1]}))
    assert facts.head_count_kv == [4, 2, 0, 1]
    assert facts.kv_bytes_per_token_per_layer == [h * 2 * 16 * F16 for h in (4, 2, 0, 1)]


def test_sliding_window_layers_follow_the_architectures_pattern() -> None:
    gemma2 = facts_from_header(_header("gemma2", {"gemma2.attention.sliding_window": 4096}))
    assert gemma2.sliding_window == 4096
    assert gemma2.sliding_window_layers == [0, 2]  # every other layer, the last of each pair full
    pattern = {"gemma3.attention.sliding_window": 512,
               "gemma3.attention.sliding_window_pattern": [True, False, True, True]}  # fmt: skip
    assert facts_from_header(_header("gemma3", pattern)).sliding_window_layers == [0, 2, 3]


def test_a_window_on_an_architecture_without_a_pattern_is_not_used() -> None:
    facts = facts_from_header(_header("llama", {"llama.attention.sliding_window": 4096}))
    assert facts.sliding_window is None and facts.sliding_window_layers == []


def test_experts_are_read() -> None:
    meta = {"qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8}
    facts = facts_from_header(_header("qwen3moe", meta))
    assert (facts.expert_count, facts.expert_used_count, facts.is_moe) == (128, 8, True)


def test_a_header_without_head_counts_is_refused_with_a_reason() -> None:
    header = _header("llama", {})
    meta = {k: v for k, v in header.metadata.items() if "head_count" not in k}
    with pytest.raises(FactsError, match="cannot size the KV cache"):
        facts_from_header(GgufHeader(meta, header.tensors, "test.gguf"))


def test_continuum_facts_prints_what_spec_model_facts_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, TinyModelShape())
    assert cli.main(["facts", str(path), "-o", "json", "--sha256"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["sha256"]) == 64
    assert doc["facts"]["layers"] == 4
    assert doc["facts"]["kvBytesPerTokenPerLayer"] == 256
    assert cli.main(["facts", str(tmp_path / "nope.gguf")]) == 2
