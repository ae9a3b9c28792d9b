"""ModelFacts from a GGUF header and tensor index, as llama.cpp would place the tensors.

Pure: takes the `GgufHeader` the reader made and returns `ModelFacts`. What llama.cpp does,
and so what the facts say (checked against llama.cpp's source vendored in llama-cpp-python
0.3.36 and its receipts on generated models):

- Layer bytes: the sum of `blk.N.*` tensor sizes, one entry per layer.
- Input: `token_embd` (and position/type embeddings, the embedding norm): always on the host.
- Output: every other tensor (`output.weight`, `output_norm`, ...), offloaded with the output
  layer. A tied head (no `output.weight`) makes llama.cpp create the output tensor as a
  duplicate of `token_embd` in the output layer's buffer: on a GPU that is a second copy of the
  token embeddings, so `outputBytes` counts them; on the host the mapped file already holds
  them, so `outputHostBytes` counts only the rest (the norm).
- KV per layer per cell at f16: 2 x n_head_kv(il) x (key_length + value_length), with the head
  sizes from `attention.key_length` / `value_length` and n_embd / n_head only where those are
  absent; n_head_kv may be one number or one per layer. MLA models (`key_length_mla`) cache K
  only, as llama.cpp does.
- Sliding window: a per-cell rate cannot say that a window layer holds only the window's cells
  whatever the context, so the facts carry the window and the list of window layers, and the
  plan sizes those layers at llama.cpp's window cells (`core.kvcells`).
- Mixture of experts: expert counts are read; the plan says expert offload is not planned.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from continuum_operator.gguf.reader import VOCAB_LENGTH_KEY, GgufHeader
from continuum_operator.model.engine import ModelFacts

__all__ = ["SWA_PATTERNS", "FactsError", "facts_from_header"]


class FactsError(ValueError):
    """The header lacks a fact the plan needs, or contradicts itself."""


# The sliding-window layer pattern llama.cpp assumes per architecture when the file has no
# `attention.sliding_window_pattern` (models/*.cpp, load_swa_pattern): (period, dense_first).
# dense_first: the first layer of each period is full; otherwise the last one is.
SWA_PATTERNS: Mapping[str, tuple[int, bool]] = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "gemma3n": (5, False),
    "gemma-embedding": (6, False),
    "cohere2": (4, False),
    "cohere2moe": (4, True),
    "exaone4": (4, False),
    "exaone-moe": (4, False),
    "llama4": (4, False),
    "gpt-oss": (2, False),
    "olmo2": (4, False),
    "afmoe": (4, False),
    "smallthinker": (4, True),
    "mellum": (4, False),
    "muse-glimmer": (4, False),
    "plamo3": (8, False),
    "laguna": (4, True),
    "modern-bert": (3, True),
}

_INPUT_TENSORS = ("token_embd.", "token_embd_norm.", "token_types.", "position_embd.")
_BLOCK = re.compile(r"^blk\.(\d+)\.")
# Encoders without an output head: no tied copy of the token embeddings.
_NO_OUTPUT_HEAD = frozenset({"bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2",
                             "jina-bert-v3", "modern-bert", "neo-bert", "t5encoder"})  # fmt: skip
F16_BYTES = 2
MAX_LAYERS = 4096  # ModelFacts.layers' bound


def facts_from_header(header: GgufHeader) -> ModelFacts:
    meta = header.metadata
    arch = header.architecture
    if arch is None:
        raise FactsError(f"{header.source}: no general.architecture in the GGUF header")

    def key(name: str) -> Any:
        return meta.get(f"{arch}.{name}")

    n_layer = _block_count(header, arch, key)
    tensors = _tensor_bytes(header, arch, n_layer)
    attention = _attention(header, arch, key, n_layer)
    n_embd = attention.embedding_length

    vocab = (
        _int(key("vocab_size"))
        or _int(meta.get(VOCAB_LENGTH_KEY))
        or (
            tensors.token_embd_elements // n_embd
            if n_embd and tensors.token_embd_elements
            else None
        )
    )
    n_ff = _per_layer(key("feed_forward_length"), n_layer)
    n_ff_exp = _int(key("expert_feed_forward_length"))
    ffn = max([*n_ff, n_ff_exp or 0]) or None

    heads_kv: int | list[int] | None = _one_or_list(attention.head_count_kv)
    try:
        return ModelFacts(
            architecture=arch,
            layers=n_layer,
            layer_bytes=_one_or_list(tensors.layer_bytes),
            input_bytes=tensors.input_bytes,
            output_bytes=tensors.output_bytes,
            output_host_bytes=tensors.output_host_bytes,
            kv_bytes_per_token_per_layer=_one_or_list(attention.kv_rates),
            embedding_length=n_embd or None,
            head_count=attention.head_count or None,
            head_count_kv=heads_kv,
            key_length=attention.key_length,
            value_length=0 if attention.mla else attention.value_length,
            feed_forward_length=ffn,
            vocab_size=vocab,
            context_length=_int(key("context_length")),
            sliding_window=attention.window if attention.window_layers else None,
            sliding_window_layers=attention.window_layers,
            expert_count=_int(key("expert_count")),
            expert_used_count=_int(key("expert_used_count")),
        )
    except ValidationError as err:  # a header that contradicts itself, or numbers out of range
        problems = "; ".join(
            f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in err.errors()
        )
        raise FactsError(
            f"{header.source}: the header's facts cannot be planned: {problems}"
        ) from None


def _block_count(header: GgufHeader, arch: str, key: Callable[[str], Any]) -> int:
    n_layer = _int(key("block_count"))
    if not n_layer:
        raise FactsError(f"{header.source}: no {arch}.block_count in the GGUF header")
    if not 0 < n_layer <= MAX_LAYERS:  # before anything is sized by it
        raise FactsError(
            f"{header.source}: {arch}.block_count is {n_layer}; a model has 1 to {MAX_LAYERS}"
        )
    return n_layer


@dataclass(frozen=True, slots=True)
class _TensorBytes:
    """The tensor index summed where llama.cpp places each tensor."""

    layer_bytes: list[int]
    input_bytes: int
    output_bytes: int
    output_host_bytes: int | None
    token_embd_elements: int


def _tensor_bytes(header: GgufHeader, arch: str, n_layer: int) -> _TensorBytes:
    layer_bytes = [0] * n_layer
    input_bytes = 0
    output_bytes = 0
    token_embd_bytes = 0
    token_embd_elements = 0
    has_output = False
    for t in header.tensors:
        m = _BLOCK.match(t.name)
        if m:
            il = int(m.group(1))
            if il >= n_layer:
                raise FactsError(f"{header.source}: tensor {t.name} names layer {il} of {n_layer}")
            layer_bytes[il] += t.n_bytes
        elif t.name.startswith(_INPUT_TENSORS):
            input_bytes += t.n_bytes
            if t.name == "token_embd.weight":
                token_embd_bytes, token_embd_elements = t.n_bytes, t.n_elements
        else:
            output_bytes += t.n_bytes
            has_output = has_output or t.name == "output.weight"

    output_host: int | None = None
    if not has_output and token_embd_bytes and arch not in _NO_OUTPUT_HEAD:
        output_host = output_bytes
        output_bytes += token_embd_bytes
    return _TensorBytes(layer_bytes, input_bytes, output_bytes, output_host, token_embd_elements)


@dataclass(frozen=True, slots=True)
class _Attention:
    """The attention shape as the header gives it, and the KV cache rate per layer it makes."""

    embedding_length: int | None
    head_count: int | None
    head_count_kv: list[int]
    key_length: int | None
    value_length: int | None
    mla: bool
    window: int | None
    window_layers: list[int]
    kv_rates: list[int]


def _attention(
    header: GgufHeader, arch: str, key: Callable[[str], Any], n_layer: int
) -> _Attention:
    n_embd = _int(key("embedding_length"))
    n_head_list = _per_layer(key("attention.head_count"), n_layer)
    n_head = max(n_head_list) if n_head_list else None
    n_head_kv_list = _per_layer(key("attention.head_count_kv"), n_layer) or n_head_list
    head0 = n_head_list[0] if n_head_list else 0
    key_length = _int(key("attention.key_length")) or (
        n_embd // head0 if n_embd and head0 else None
    )
    value_length = _int(key("attention.value_length")) or key_length
    mla = _int(key("attention.key_length_mla")) is not None

    window = _int(key("attention.sliding_window")) or None
    window_layers = (
        _window_layers(key("attention.sliding_window_pattern"), SWA_PATTERNS.get(arch), n_layer)
        if window
        else []
    )
    key_length_swa = _int(key("attention.key_length_swa")) or key_length
    value_length_swa = _int(key("attention.value_length_swa")) or value_length

    kv_rates: list[int] = []
    if n_head_kv_list and key_length and value_length:
        swa = set(window_layers)
        for il, heads in enumerate(n_head_kv_list):
            k_len = key_length_swa if il in swa else key_length
            v_len = 0 if mla else (value_length_swa if il in swa else value_length)
            kv_rates.append(heads * ((k_len or 0) + (v_len or 0)) * F16_BYTES)
    else:
        raise FactsError(
            f"{header.source}: cannot size the KV cache: {arch}.attention.head_count (or "
            "head_count_kv) and a head size (key_length, or embedding_length / head_count) "
            "are missing"
        )
    return _Attention(
        embedding_length=n_embd,
        head_count=n_head,
        head_count_kv=n_head_kv_list,
        key_length=key_length,
        value_length=value_length,
        mla=mla,
        window=window,
        window_layers=window_layers,
        kv_rates=kv_rates,
    )


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return int(max(value))
    return None


def _per_layer(value: Any, n_layer: int) -> list[int]:
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value] * n_layer
    if isinstance(value, list) and len(value) >= n_layer:
        return [int(v) for v in value[:n_layer]]
    return []


def _one_or_list(values: Sequence[int]) -> int | list[int]:
    return values[0] if values and all(v == values[0] for v in values) else list(values)


def _window_layers(pattern: Any, default: tuple[int, bool] | None, n_layer: int) -> list[int]:
    """Indices of the sliding-window layers, as llama.cpp's load_swa_pattern decides them."""
    if isinstance(pattern, list) and pattern:
        return [il for il in range(min(n_layer, len(pattern))) if bool(pattern[il])]
    period, dense_first = default if default is not None else (0, False)
    if isinstance(pattern, int) and not isinstance(pattern, bool):
        period = pattern
    elif default is None:
        # A window with no pattern known for the architecture: llama.cpp does not use it.
        return []
    if dense_first:
        return [il for il in range(n_layer) if period == 0 or il % period != 0]
    return [il for il in range(n_layer) if period == 0 or il % period < period - 1]
