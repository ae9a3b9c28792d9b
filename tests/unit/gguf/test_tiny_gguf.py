"""The tiny GGUF writer: files written, metadata and tensor shapes read back, determinism."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from continuum_operator.testing.tiny_gguf import MAX_VOCAB, MIN_VOCAB, vocabulary


def _fields(reader: Any) -> dict[str, Any]:
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type")
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


def _tensors(reader: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    return {t.name: (tuple(int(d) for d in t.shape), t.tensor_type.name) for t in reader.tensors}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_default_shape_reads_back(tmp_path: Path) -> None:
    shape = TinyModelShape()
    path = write_tiny_gguf(tmp_path / "m.gguf", shape)
    assert path.is_file()
    reader = gguf.GGUFReader(path)
    f = _fields(reader)
    assert f["general.architecture"] == "llama"
    assert f["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_F16)
    assert f["llama.block_count"] == 4
    assert f["llama.embedding_length"] == 128
    assert f["llama.feed_forward_length"] == 256
    assert f["llama.attention.head_count"] == 4
    assert f["llama.attention.head_count_kv"] == 2
    assert f["llama.context_length"] == 2048
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert f["tokenizer.ggml.model"] == "llama"
    assert "llama.attention.key_length" not in f
    assert "llama.pooling_type" not in f

    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert len(tokens) == len(types) == shape.vocab_size
    assert tokens[:3] == ["<unk>", "<s>", "</s>"]
    assert tokens[3] == "<0x00>" and tokens[258] == "<0xFF>"
    assert set(types[3:259]) == {int(gguf.TokenType.BYTE)}
    assert len(reader.fields["tokenizer.ggml.scores"].contents()) == shape.vocab_size

    t = _tensors(reader)
    # GGUFReader reports ggml order: {input width, output width}.
    assert t["token_embd.weight"] == ((128, 512), "F16")
    assert t["output.weight"] == ((128, 512), "F16")
    assert t["output_norm.weight"] == ((128,), "F32")
    assert t["blk.3.attn_q.weight"] == ((128, 128), "F16")
    assert t["blk.3.attn_k.weight"] == ((128, 64), "F16")
    assert t["blk.3.attn_v.weight"] == ((128, 64), "F16")
    assert t["blk.3.attn_output.weight"] == ((128, 128), "F16")
    assert t["blk.3.ffn_gate.weight"] == ((128, 256), "F16")
    assert t["blk.3.ffn_up.weight"] == ((128, 256), "F16")
    assert t["blk.3.ffn_down.weight"] == ((256, 128), "F16")
    assert t["blk.3.attn_norm.weight"] == ((128,), "F32")
    assert t["blk.3.ffn_norm.weight"] == ((128,), "F32")
    assert "blk.4.attn_q.weight" not in t
    assert len(t) == 2 + 1 + 9 * 4


def test_key_length_differs_from_embd_over_heads(tmp_path: Path) -> None:
    shape = TinyModelShape(n_embd=96, n_head=4, n_head_kv=1, key_length=40, value_length=40)
    assert shape.n_embd // shape.n_head == 24
    reader = gguf.GGUFReader(write_tiny_gguf(tmp_path / "k.gguf", shape))
    f = _fields(reader)
    assert f["llama.attention.key_length"] == 40
    assert f["llama.attention.value_length"] == 40
    assert f["llama.rope.dimension_count"] == 40
    t = _tensors(reader)
    assert t["blk.0.attn_q.weight"][0] == (96, 4 * 40)
    assert t["blk.0.attn_k.weight"][0] == (96, 1 * 40)
    assert t["blk.0.attn_v.weight"][0] == (96, 1 * 40)
    assert t["blk.0.attn_output.weight"][0] == (4 * 40, 96)
    assert shape.kv_bytes_per_token() == 4 * (40 + 40) * 2


def test_f32_tied_and_embedding_variants(tmp_path: Path) -> None:
    f32 = gguf.GGUFReader(
        write_tiny_gguf(tmp_path / "f.gguf", TinyModelShape(dtype="f32", tied_output=True))
    )
    assert _fields(f32)["general.file_type"] == int(gguf.LlamaFileType.ALL_F32)
    t = _tensors(f32)
    assert t["token_embd.weight"][1] == "F32"
    assert "output.weight" not in t

    emb = gguf.GGUFReader(write_tiny_gguf(tmp_path / "e.gguf", TinyModelShape(embedding=True)))
    assert _fields(emb)["llama.pooling_type"] == int(gguf.PoolingType.MEAN)
    assert "output.weight" not in _tensors(emb)


def test_deterministic_by_seed(tmp_path: Path) -> None:
    shape = TinyModelShape(n_layer=2, n_embd=64, n_ff=128)
    a = write_tiny_gguf(tmp_path / "a.gguf", shape, seed=7)
    b = write_tiny_gguf(tmp_path / "b.gguf", shape, seed=7)
    c = write_tiny_gguf(tmp_path / "c.gguf", shape, seed=8)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)
    assert a.stat().st_size == c.stat().st_size
    ra, rc = gguf.GGUFReader(a), gguf.GGUFReader(c)
    norm_a = next(t for t in ra.tensors if t.name == "blk.0.attn_norm.weight").data
    wq_a = next(t for t in ra.tensors if t.name == "blk.0.attn_q.weight").data
    wq_c = next(t for t in rc.tensors if t.name == "blk.0.attn_q.weight").data
    assert np.all(norm_a == 1.0)
    assert not np.array_equal(wq_a, wq_c)
    assert 0.0 < float(np.abs(wq_a.astype(np.float32)).mean()) < 0.1


def test_file_size_matches_the_shape(tmp_path: Path) -> None:
    shape = TinyModelShape()
    path = write_tiny_gguf(tmp_path / "m.gguf", shape)
    matrices = 2 * shape.vocab_size * shape.n_embd + shape.n_layer * (
        shape.n_embd * shape.n_head * shape.head_dim_k * 2
        + shape.n_embd * (shape.n_embd_k_gqa + shape.n_embd_v_gqa)
        + 3 * shape.n_embd * shape.n_ff
    )
    norms = (2 * shape.n_layer + 1) * shape.n_embd
    tensor_bytes = matrices * 2 + norms * 4
    size = path.stat().st_size
    assert tensor_bytes < size < tensor_bytes + 64 * 1024


@pytest.mark.parametrize("size", [MIN_VOCAB, 1000, MAX_VOCAB])
def test_vocabulary_every_piece_has_its_prefixes(size: int) -> None:
    tokens, scores, types = vocabulary(size)
    assert len(tokens) == len(scores) == len(types) == size
    assert len(set(tokens)) == size
    pieces = set(tokens[MIN_VOCAB:])
    for piece in tokens[MIN_VOCAB:]:
        for end in range(1, len(piece)):
            assert piece[:end] in pieces, (piece, piece[:end])
    assert scores == sorted(scores, reverse=True)


def test_128k_vocabulary_writes(tmp_path: Path) -> None:
    shape = TinyModelShape(
        n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32, vocab_size=MAX_VOCAB
    )
    path = write_tiny_gguf(tmp_path / "v.gguf", shape)
    assert path.stat().st_size > 2 * 2 * MAX_VOCAB * 32


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_head": 4, "n_head_kv": 3},
        {"vocab_size": MIN_VOCAB - 1},
        {"vocab_size": MAX_VOCAB + 1},
        {"n_embd": 100, "n_head": 3},
        {"key_length": 32, "value_length": 16},
        {"key_length": 31},
        {"n_layer": 0},
        {"dtype": "q8_0"},
    ],
)
def test_invalid_shapes_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        TinyModelShape(**kwargs)
