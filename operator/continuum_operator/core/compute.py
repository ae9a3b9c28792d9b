"""The compute-buffer estimate, made before loading (docs/design.md: plan it per context).

llama.cpp sizes each backend's compute buffer by allocating the worst-case graph of one
micro-batch (ggml-alloc reuses a tensor's memory once its last reader has run, so the buffer is
the graph's peak of live tensors, not their sum). With `n_tokens = micro-batch`:

- The logits of the micro-batch, f32 `vocab x n_tokens`, live at the end of the graph.
- The attention of one layer: with flash attention, the f16 mask `kv_cells x n_tokens`; without
  it, the f32 scores `kv_cells x n_tokens x n_head` (softmax in place) and an f32 mask.
- Activations: a few f32 rows per token, of width n_embd, n_ff and the Q/K/V/attention widths.

`kv_cells` is the KV size of one sequence (llama.cpp pads it to 256); with one stream per
sequence (`--parallel` without `--kv-unified`) each stream attends over its own cells, so the
attention terms follow the context per mind, not the pool. The output buffer (llama.cpp's
`output buffer size`: f32 logits of one token per sequence) is on the host.

The coefficients were fitted to receipts of generated tiny models (bench/estimate.py holds
shapes out of that fit) and rounded up: the estimate aims at never under and within 3% of the
total. Receipts replace this estimate where they exist (`core.receipts`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from continuum_operator.model.engine import ModelFacts

__all__ = [
    "ASSUMED_EMBEDDING_LENGTH",
    "ASSUMED_VOCAB_SIZE",
    "KV_CELL_PAD",
    "MICRO_BATCH_TOKENS",
    "ComputeEstimate",
    "ComputeSource",
    "graph_bytes",
    "kv_cells_per_sequence",
    "window_cells_per_sequence",
]

MICRO_BATCH_TOKENS = 512
#: llama.cpp pads the KV cache (and a sliding window's cache) to 256 cells per sequence.
KV_CELL_PAD = 256
# Stand-ins when the facts do not say: a 7-8B model's width and a large modern vocabulary,
# so that a missing fact overestimates rather than underestimates.
ASSUMED_EMBEDDING_LENGTH = 4096
ASSUMED_VOCAB_SIZE = 152_064
F32 = 4
F16 = 2


def _pad(n: int, to: int = KV_CELL_PAD) -> int:
    return -(-n // to) * to


def kv_cells_per_sequence(context_tokens: int) -> int:
    """KV cells llama.cpp allocates per sequence for a context of `context_tokens`."""
    return _pad(max(1, context_tokens))


def window_cells_per_sequence(
    context_tokens: int, window: int, micro_batch: int = MICRO_BATCH_TOKENS
) -> int:
    """KV cells of a sliding-window layer per sequence: the window plus one micro-batch."""
    return _pad(min(kv_cells_per_sequence(context_tokens), window + micro_batch))


class ComputeSource(StrEnum):
    FACTS = "facts"
    ESTIMATE = "estimate"
    RECEIPT = "receipt"


@dataclass(frozen=True, slots=True)
class GraphShape:
    """The facts the graph's size depends on, with stand-ins filled in."""

    n_embd: int
    n_head: int
    n_head_kv: int
    head_k: int
    head_v: int
    n_ff: int
    vocab: int

    @classmethod
    def of(cls, facts: ModelFacts) -> GraphShape:
        n_embd = facts.embedding_length or ASSUMED_EMBEDDING_LENGTH
        n_head = facts.head_count or max(1, n_embd // 128)
        kv = facts.head_count_kv
        n_head_kv = (
            max(kv) if isinstance(kv, list) and kv else kv if isinstance(kv, int) else n_head
        )
        head_k = facts.key_length or max(1, n_embd // n_head)
        head_v = facts.value_length if facts.value_length is not None else head_k
        return cls(
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=max(1, n_head_kv),
            head_k=head_k,
            head_v=max(head_v, head_k),
            n_ff=facts.feed_forward_length or 4 * n_embd,
            vocab=facts.vocab_size or ASSUMED_VOCAB_SIZE,
        )


def graph_bytes(
    shape: GraphShape,
    kv_cells: int,
    *,
    micro_batch: int = MICRO_BATCH_TOKENS,
    flash_attention: bool = True,
) -> int:
    """One backend's compute buffer for the worst-case graph of one micro-batch.

    The peak of three phases, in f32 rows of the micro-batch (`t x 4` bytes each):

    - attention: the mask (f16 with flash attention; f32 and the f32 scores of every head
      without), the residual and norm rows (4 x n_embd), Q and its rotation (2 x n_head x
      head_k), and the new K and V rows;
    - feed-forward: the mask (still live: every layer reads it), gate, up and their product
      (3 x n_ff) and 4 rows of n_embd;
    - output: the logits (vocab) and 3 rows of n_embd (4 without flash attention).

    ggml-alloc's best-fit placement leaves holes: measured buffers of the layer phases run up
    to 6% above the sum of their live tensors, so those phases carry `FRAGMENTATION`. The
    logits of a small vocabulary sometimes land above the freed mask instead of in its place
    (a few 8k-vocabulary shapes, never at 32k or more); that is not modelled.
    """
    e, f, v = shape.n_embd, shape.n_ff, shape.vocab
    q = shape.n_head * shape.head_k
    kv = shape.n_head_kv * (shape.head_k + shape.head_v)
    if flash_attention:
        mask = kv_cells * F16 / F32  # in rows of t x f32
        scores = 0.0
        output = v + 3 * e
    else:
        mask = float(kv_cells)
        scores = float(kv_cells * shape.n_head)
        output = v + 4 * e
    attention = scores + mask + FRAGMENTATION * (4 * e + 2 * q + kv)
    ffn = mask + FRAGMENTATION * (3 * f + 4 * e)
    rows = max(attention, ffn, output) + INPUT_ROWS
    return int(rows * micro_batch * F32)


#: Headroom on the activations of a layer for ggml-alloc's holes (see graph_bytes).
FRAGMENTATION = 1.08
#: Inputs (token ids, positions, KV indices, output ids) and the allocator's alignment slack.
INPUT_ROWS = 8


@dataclass(frozen=True, slots=True)
class ComputeEstimate:
    facts: ModelFacts
    micro_batch: int = MICRO_BATCH_TOKENS
    flash_attention: bool = True

    @property
    def source(self) -> ComputeSource:
        return (
            ComputeSource.FACTS if self.facts.compute_bytes is not None else ComputeSource.ESTIMATE
        )

    @property
    def assumed(self) -> list[str]:
        """The facts the estimate had to assume, for the plan's reasons."""
        missing = []
        if self.facts.embedding_length is None:
            missing.append(f"embeddingLength={ASSUMED_EMBEDDING_LENGTH}")
        if self.facts.vocab_size is None:
            missing.append(f"vocabSize={ASSUMED_VOCAB_SIZE}")
        return missing if self.facts.compute_bytes is None else []

    def graph_bytes(self, context_per_mind: int, minds: int = 1) -> int:
        """One backend's compute buffer with `minds` streams of `context_per_mind` tokens."""
        if self.facts.compute_bytes is not None:
            return self.facts.compute_bytes
        cells = kv_cells_per_sequence(context_per_mind)
        return graph_bytes(
            GraphShape.of(self.facts),
            cells,
            micro_batch=self.micro_batch_of(cells, minds),
            flash_attention=self.flash_attention,
        )

    def micro_batch_of(self, cells: int, minds: int) -> int:
        """The micro-batch llama.cpp runs: clamped to the context (n_ubatch <= n_ctx)."""
        return min(self.micro_batch, cells * minds)

    def bytes_at(self, context_tokens: int) -> int:
        """Compute-buffer bytes of one backend at a context of `context_tokens` (one stream)."""
        return self.graph_bytes(context_tokens, 1)

    def output_bytes(self, sequences: int = 1) -> int:
        """The host output buffer: f32 logits of one token per sequence."""
        return GraphShape.of(self.facts).vocab * max(1, sequences) * F32

    def host_input_bytes(self, context_per_mind: int, minds: int = 1) -> int:
        """The host's compute buffer when every layer is offloaded: the looked-up embeddings
        and the attention mask (f16, a stream's cells by the micro-batch), which the host
        builds for the device. The mask's term was missing until an H200 showed it: CUDA_Host
        held 38.13 MiB at a 32,768-token context where the embeddings are 6 MiB
        (tests/fixtures/h200)."""
        if self.facts.compute_bytes is not None:
            return 0
        cells = kv_cells_per_sequence(context_per_mind)
        t = self.micro_batch_of(cells, minds)
        return 2 * t * GraphShape.of(self.facts).n_embd * F32 + cells * t * F16
