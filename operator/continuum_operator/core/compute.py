"""The compute-buffer estimate, a function of context (DESIGN.md: plan it per context).

llama.cpp sizes its compute buffers by reserving the worst-case graph of one micro-batch. With
flash attention (which the engine always turns on) the part that grows with context is the
attention mask, f16, context x micro-batch; the fixed part is the logits of one micro-batch
(f32, micro-batch x vocabulary) and the activations (a few f32 rows of width n_embd per token).
Receipts replace this estimate where they exist ("GGUF facts and estimates").
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from continuum_operator.model.engine import ModelFacts

MICRO_BATCH_TOKENS = 512
# Stand-ins when the facts do not say: a 7-8B model's width and a large modern vocabulary,
# so that a missing fact overestimates rather than underestimates.
ASSUMED_EMBEDDING_LENGTH = 4096
ASSUMED_VOCAB_SIZE = 152_064
# f32 rows of width n_embd alive at the peak of one layer's graph (residual, norm, Q, K, V,
# attention output, two feed-forward halves, with room for a wider feed-forward).
ACTIVATION_ROWS = 16


class ComputeSource(StrEnum):
    FACTS = "facts"
    ESTIMATE = "estimate"
    RECEIPT = "receipt"


@dataclass(frozen=True, slots=True)
class ComputeEstimate:
    facts: ModelFacts

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

    def bytes_at(self, context_tokens: int) -> int:
        """Compute-buffer bytes of one backend at a total context of `context_tokens`."""
        if self.facts.compute_bytes is not None:
            return self.facts.compute_bytes
        n_embd = self.facts.embedding_length or ASSUMED_EMBEDDING_LENGTH
        vocab = self.facts.vocab_size or ASSUMED_VOCAB_SIZE
        ubatch = MICRO_BATCH_TOKENS
        mask = context_tokens * ubatch * 2
        logits = ubatch * vocab * 4
        activations = ubatch * n_embd * 4 * ACTIVATION_ROWS
        return mask + logits + activations
