"""The real llama.cpp on generated models: llama-cpp-python and llama-server.

These pin the facts the planner relies on: a generated GGUF loads and decodes, llama.cpp's KV
buffer is exactly 2 x n_layer x n_head_kv x head_dim x bytes x n_ctx (head_dim from the model's
key/value length, not n_embd / n_head), embeddings pool to one vector, and llama-server splits
its context over slots and serves a request on the slot asked for.
"""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from continuum_operator.testing.tiny_gguf import BOS_ID, MAX_VOCAB, vocabulary
from tests.support.llama_server import LlamaLog, TinyModel, import_llama_cpp
from tests.support.local_http import http_json

pytestmark = pytest.mark.e2e

MIB = 1024 * 1024
F16_BYTES = 2


def _load(path: Path, **kwargs: Any) -> contextlib.closing[Any]:
    llama_cpp = import_llama_cpp()
    kwargs.setdefault("n_threads", 2)
    kwargs.setdefault("verbose", False)
    kwargs.setdefault("seed", 0)
    return contextlib.closing(llama_cpp.Llama(model_path=str(path), **kwargs))


def _kv_summary(log: LlamaLog) -> dict[str, float]:
    """`llama_kv_cache: size = X MiB (N cells, L layers, S/S seqs), K (f16): X MiB, V (f16): ...`"""
    m = re.search(
        r"llama_kv_cache:\s+size =\s*([0-9.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers,"
        r"\s*(\d+)(?:/\d+)? seqs\), K \((\w+)\):\s*([0-9.]+) MiB, V \((\w+)\):\s*([0-9.]+) MiB",
        log.text,
    )
    assert m, f"no KV summary in llama.cpp's log:\n{log.text[-3000:]}"
    assert m.group(5) == m.group(7) == "f16"
    return {
        "size_mib": float(m.group(1)),
        "cells": int(m.group(2)),
        "layers": int(m.group(3)),
        "seqs": int(m.group(4)),
        "k_mib": float(m.group(6)),
        "v_mib": float(m.group(8)),
    }


def test_llama_cpp_python_completes(tiny_model: TinyModel) -> None:
    with _load(tiny_model.path, n_ctx=256) as llm:
        out = llm("Once upon a time", max_tokens=4, temperature=0.0)
    assert isinstance(out["choices"][0]["text"], str)
    assert 1 <= out["usage"]["completion_tokens"] <= 4
    assert out["usage"]["prompt_tokens"] >= 2


KV_CASES = {
    # the shared tiny model: head_dim = n_embd / n_head = 32
    "l4-e128-h4-kv2": (TinyModelShape(context_length=4096), 512),
    "l4-e128-h4-kv2-2k": (TinyModelShape(context_length=4096), 2048),
    # head_dim 48 while n_embd / n_head = 32: the KV cache must follow key_length
    "l8-e256-h8-kv4-k48": (
        TinyModelShape(
            n_layer=8,
            n_embd=256,
            n_head=8,
            n_head_kv=4,
            n_ff=512,
            key_length=48,
            value_length=48,
            context_length=4096,
        ),
        2048,
    ),
    # head_dim 40 while n_embd / n_head = 24, MQA, f32 weights (the KV stays f16)
    "l3-e96-h4-kv1-k40-f32": (
        TinyModelShape(
            n_layer=3,
            n_embd=96,
            n_head=4,
            n_head_kv=1,
            n_ff=192,
            key_length=40,
            value_length=40,
            dtype="f32",
            context_length=4096,
        ),
        1024,
    ),
}


@pytest.mark.parametrize("name", list(KV_CASES))
def test_kv_buffer_matches_the_shape(name: str, tmp_path: Path, llama_log: LlamaLog) -> None:
    shape, n_ctx = KV_CASES[name]
    path = write_tiny_gguf(tmp_path / f"{name}.gguf", shape)
    with _load(path, n_ctx=n_ctx) as llm:
        # it also decodes at this head size
        out = llm("hello world", max_tokens=2, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1

    expected = 2 * shape.n_layer * shape.n_head_kv * shape.head_dim_k * F16_BYTES * n_ctx
    assert expected == shape.kv_bytes_per_token(F16_BYTES) * n_ctx
    buffers = llama_log.mib(r"llama_kv_cache:\s+CPU KV buffer size")
    assert buffers, f"no KV buffer line in llama.cpp's log:\n{llama_log.text[-3000:]}"
    assert buffers[-1] == pytest.approx(round(expected / MIB, 2), abs=0.005)
    kv = _kv_summary(llama_log)
    assert kv["cells"] == n_ctx
    assert kv["layers"] == shape.n_layer
    assert kv["size_mib"] == pytest.approx(round(expected / MIB, 2), abs=0.005)
    assert kv["k_mib"] == pytest.approx(round(expected / 2 / MIB, 2), abs=0.005)
    assert kv["v_mib"] == kv["k_mib"]
    # and what the file says is what llama.cpp read
    assert re.search(rf"n_embd_head_k\s*=\s*{shape.head_dim_k}\b", llama_log.text)
    assert re.search(rf"n_head_kv\s*=\s*{shape.n_head_kv}\b", llama_log.text)


def test_embedding_variant_pools_to_one_vector(tmp_path: Path) -> None:
    shape = TinyModelShape(embedding=True)
    path = write_tiny_gguf(tmp_path / "embed.gguf", shape)
    with _load(path, n_ctx=256, embedding=True) as llm:
        result = llm.create_embedding("the engine holds a pool of memory")
    assert len(result["data"]) == 1
    vector = result["data"][0]["embedding"]
    assert len(vector) == shape.n_embd
    assert all(isinstance(x, float) and math.isfinite(x) for x in vector)
    assert any(x != 0.0 for x in vector)


def test_128k_vocabulary_tokenizes_into_word_pieces(tmp_path: Path) -> None:
    shape = TinyModelShape(
        n_layer=1, n_embd=64, n_head=2, n_head_kv=1, n_ff=64, vocab_size=MAX_VOCAB
    )
    path = write_tiny_gguf(tmp_path / "v128k.gguf", shape)
    tokens, _, _ = vocabulary(MAX_VOCAB)
    index = {t: i for i, t in enumerate(tokens)}
    with _load(path, n_ctx=256) as llm:
        assert llm.n_vocab() == MAX_VOCAB
        # whole words, including one of the last synthetic pieces
        last = tokens[-1]
        ids = llm.tokenize(f"hello world {last}".encode())
        assert ids == [BOS_ID, index["\u2581hello"], index["\u2581world"], index["\u2581" + last]]
        assert index["\u2581" + last] >= MAX_VOCAB - 2
        # a character outside the vocabulary falls back to byte tokens
        ids = llm.tokenize("é".encode(), add_bos=False)
        assert [tokens[i] for i in ids][-2:] == ["<0xC3>", "<0xA9>"]
        out = llm("hello", max_tokens=2, temperature=0.0)
    assert out["usage"]["completion_tokens"] >= 1


def test_llama_server_serves_two_slots(llama_server: str) -> None:
    status, slots = http_json(f"{llama_server}/slots")
    assert status == 200, slots
    assert [s["id"] for s in slots] == [0, 1]
    assert [s["n_ctx"] for s in slots] == [512, 512]

    status, body = http_json(
        f"{llama_server}/completion",
        {"prompt": "Once upon a time", "n_predict": 4, "id_slot": 1, "temperature": 0.0},
    )
    assert status == 200, body
    assert body["id_slot"] == 1
    assert 1 <= body["tokens_predicted"] <= 4
    assert isinstance(body["content"], str)

    status, props = http_json(f"{llama_server}/props")
    assert status == 200, props
    assert props["total_slots"] == 2
