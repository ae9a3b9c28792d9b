"""Random-weight llama GGUF models of any shape, small enough to write in a test.

Why this exists: the operator's plans are checked against what llama.cpp really allocates (model,
KV and compute buffers), and the engine is driven as a real ``llama-server``. Both need GGUF files
whose shape we choose (layers, heads, KV heads, head size, vocabulary, dtype) without downloading a
model. The weights are random, so the text they produce is noise, but llama.cpp loads them, sizes
its buffers from the same metadata a real model carries, decodes, and embeds.

The file follows llama.cpp's ``llama`` architecture: the hyperparameter keys it requires, an SPM
("llama") tokenizer whose vocabulary has the 256 byte tokens ``<0xNN>`` and word pieces with every
prefix present (or the tokenizer falls back to single characters), and the tensors ``token_embd``,
``output_norm``, ``blk.N.*`` and, unless tied, ``output``. For llama, the head size (``key_length``)
may differ from ``n_embd / n_head`` but keys and values must share it, as must the rotary dimension.

Output is deterministic for a given shape and seed.
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import gguf
import numpy as np
import numpy.typing as npt

__all__ = ["TinyModelShape", "write_tiny_gguf"]

Dtype = Literal["f16", "f32"]

#: Token ids of the specials, as llama.cpp's SPM vocabulary expects them by default.
UNK_ID = 0
BOS_ID = 1
EOS_ID = 2
_SPECIALS = ("<unk>", "<s>", "</s>")
_N_BYTE_TOKENS = 256
#: The smallest vocabulary: three specials and the byte tokens.
MIN_VOCAB = len(_SPECIALS) + _N_BYTE_TOKENS
MAX_VOCAB = 131_072

_SPACE = "\u2581"  # SentencePiece's word-boundary marker ("▁")
_WORDS = (
    "the", "a", "an", "and", "of", "to", "in", "is", "it", "that", "for", "on", "with", "as",
    "hello", "world", "once", "upon", "time", "there", "was", "mind", "engine", "token", "model",
    "memory", "cache", "grant", "turn", "node", "pool", "plan", "lane", "embed", "llama", "tiny",
)  # fmt: skip
_ALPHABET = string.ascii_lowercase


@dataclass(frozen=True, slots=True)
class TinyModelShape:
    """The shape of a generated llama model.

    ``key_length``/``value_length`` default to ``n_embd // n_head``; when set they must be equal
    (llama.cpp's llama graph needs one head size for K, V and RoPE), and may differ from
    ``n_embd // n_head``. ``embedding`` writes an embedding model (mean pooling, no output head).
    """

    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_ff: int = 256
    vocab_size: int = 512
    context_length: int = 2048
    key_length: int | None = None
    value_length: int | None = None
    dtype: Dtype = "f16"
    embedding: bool = False
    tied_output: bool = False
    rms_norm_eps: float = 1e-5
    rope_freq_base: float = 10000.0

    def __post_init__(self) -> None:
        positive = {
            "n_layer": self.n_layer,
            "n_embd": self.n_embd,
            "n_head": self.n_head,
            "n_head_kv": self.n_head_kv,
            "n_ff": self.n_ff,
            "context_length": self.context_length,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.n_head % self.n_head_kv:
            raise ValueError(
                f"n_head ({self.n_head}) must be a multiple of n_head_kv ({self.n_head_kv})"
            )
        if not MIN_VOCAB <= self.vocab_size <= MAX_VOCAB:
            raise ValueError(
                f"vocab_size must be in [{MIN_VOCAB}, {MAX_VOCAB}], got {self.vocab_size}"
            )
        if self.key_length is None and self.value_length is None and self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) is not a multiple of n_head ({self.n_head}); "
                "set key_length"
            )
        if self.head_dim_k != self.head_dim_v:
            raise ValueError(
                f"key_length ({self.head_dim_k}) and value_length ({self.head_dim_v}) differ; "
                "llama.cpp's llama architecture needs them equal"
            )
        if self.head_dim_k < 2 or self.head_dim_k % 2:
            raise ValueError(f"head size must be even and at least 2, got {self.head_dim_k}")
        if self.dtype not in ("f16", "f32"):
            raise ValueError(f"dtype must be 'f16' or 'f32', got {self.dtype!r}")

    @property
    def head_dim_k(self) -> int:
        """Key head size (``llama.attention.key_length``)."""
        if self.key_length is not None:
            return self.key_length
        if self.value_length is not None:
            return self.value_length
        return self.n_embd // self.n_head

    @property
    def head_dim_v(self) -> int:
        """Value head size (``llama.attention.value_length``)."""
        if self.value_length is not None:
            return self.value_length
        return self.head_dim_k

    @property
    def n_embd_k_gqa(self) -> int:
        """Key width per token per layer across KV heads."""
        return self.n_head_kv * self.head_dim_k

    @property
    def n_embd_v_gqa(self) -> int:
        """Value width per token per layer across KV heads."""
        return self.n_head_kv * self.head_dim_v

    @property
    def weight_bytes_per_element(self) -> int:
        return 2 if self.dtype == "f16" else 4

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """KV-cache bytes per token at the given element size (f16 KV: 2)."""
        return self.n_layer * (self.n_embd_k_gqa + self.n_embd_v_gqa) * bytes_per_element


def vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of a synthetic SPM vocabulary of ``size`` entries.

    Layout: ``<unk>``, ``<s>``, ``</s>``, the byte tokens ``<0x00>``..``<0xFF>``, then word pieces:
    ``▁``, single letters, a few whole words with every prefix, then letter strings in
    breadth-first order (each one's prefixes come before it), with and without ``▁``. Scores fall
    with the index, so SPM's merges prefer the earlier (shorter, commoner) pieces.
    """
    if not MIN_VOCAB <= size <= MAX_VOCAB:
        raise ValueError(f"vocabulary size must be in [{MIN_VOCAB}, {MAX_VOCAB}], got {size}")
    tokens: list[str] = list(_SPECIALS)
    types: list[int] = [
        int(gguf.TokenType.UNKNOWN),
        int(gguf.TokenType.CONTROL),
        int(gguf.TokenType.CONTROL),
    ]
    tokens += [f"<0x{b:02X}>" for b in range(_N_BYTE_TOKENS)]
    types += [int(gguf.TokenType.BYTE)] * _N_BYTE_TOKENS
    seen = set(tokens)
    pieces = _pieces()
    while len(tokens) < size:
        piece = next(pieces)
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        types.append(int(gguf.TokenType.NORMAL))
    n_fixed = MIN_VOCAB
    scores = [0.0] * n_fixed + [-float(i) for i in range(size - n_fixed)]
    return tokens, scores, types


def _pieces() -> Iterator[str]:
    """Word pieces, each after all its prefixes; unbounded."""
    yield _SPACE
    yield from string.digits
    yield from string.punctuation
    yield from _ALPHABET
    yield from string.ascii_uppercase
    for word in _WORDS:
        for end in range(1, len(word) + 1):
            yield _SPACE + word[:end]
            yield word[:end]
    for length in itertools.count(1):
        for letters in itertools.product(_ALPHABET, repeat=length):
            piece = "".join(letters)
            yield _SPACE + piece
            yield piece


def _weights(
    rng: np.random.Generator, rows: int, cols: int, dtype: Dtype
) -> npt.NDArray[np.float16] | npt.NDArray[np.float32]:
    """A (rows, cols) matrix, i.e. ggml shape {cols, rows}, with small random values."""
    values = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
    if dtype == "f16":
        return values.astype(np.float16)
    return values


def write_tiny_gguf(path: str | Path, shape: TinyModelShape, seed: int = 0) -> Path:
    """Write a random-weight llama GGUF of ``shape`` to ``path`` and return the path.

    The same shape and seed always give the same bytes.
    """
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.Generator(np.random.PCG64(seed))
    tokens, scores, types = vocabulary(shape.vocab_size)

    writer = gguf.GGUFWriter(str(out), arch="llama")
    try:
        name = "tiny-embed" if shape.embedding else "tiny"
        writer.add_name(f"continuum {name} L{shape.n_layer} E{shape.n_embd} seed{seed}")
        f16 = shape.dtype == "f16"
        file_type = gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32
        writer.add_file_type(int(file_type))
        writer.add_vocab_size(shape.vocab_size)
        writer.add_context_length(shape.context_length)
        writer.add_embedding_length(shape.n_embd)
        writer.add_block_count(shape.n_layer)
        writer.add_feed_forward_length(shape.n_ff)
        writer.add_head_count(shape.n_head)
        writer.add_head_count_kv(shape.n_head_kv)
        writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
        writer.add_rope_freq_base(shape.rope_freq_base)
        if shape.key_length is not None or shape.value_length is not None:
            writer.add_key_length(shape.head_dim_k)
            writer.add_value_length(shape.head_dim_v)
            writer.add_rope_dimension_count(shape.head_dim_k)
        if shape.embedding:
            writer.add_pooling_type(gguf.PoolingType.MEAN)

        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(UNK_ID)
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)

        def matrix(name: str, rows: int, cols: int) -> None:
            # numpy (rows, cols) is ggml {cols, rows}: cols is the input width.
            writer.add_tensor(name, _weights(rng, rows, cols, shape.dtype))

        def norm(name: str) -> None:
            writer.add_tensor(name, np.ones(shape.n_embd, dtype=np.float32))

        e, ff = shape.n_embd, shape.n_ff
        matrix("token_embd.weight", shape.vocab_size, e)
        for i in range(shape.n_layer):
            blk = f"blk.{i}"
            norm(f"{blk}.attn_norm.weight")
            matrix(f"{blk}.attn_q.weight", shape.n_head * shape.head_dim_k, e)
            matrix(f"{blk}.attn_k.weight", shape.n_embd_k_gqa, e)
            matrix(f"{blk}.attn_v.weight", shape.n_embd_v_gqa, e)
            matrix(f"{blk}.attn_output.weight", e, shape.n_head * shape.head_dim_v)
            norm(f"{blk}.ffn_norm.weight")
            matrix(f"{blk}.ffn_gate.weight", ff, e)
            matrix(f"{blk}.ffn_up.weight", ff, e)
            matrix(f"{blk}.ffn_down.weight", e, ff)
        norm("output_norm.weight")
        if not (shape.tied_output or shape.embedding):
            matrix("output.weight", shape.vocab_size, e)

        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=False)
    finally:
        writer.close()
    return out
