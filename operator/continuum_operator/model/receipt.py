"""A receipt: one load of one model by one llama.cpp build, and the buffers it allocated
(docs/receipts.md). The document receipt files hold, and the engine and lane runtimes report in
their `status.runtime.receipts`; `core.receipts` files and reads them (its log parser, its book).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import Field

from continuum_operator.model.base import Bytes, Spec
from continuum_operator.model.kv import KvCacheType

__all__ = [
    "BufferKind",
    "Receipt",
    "ReceiptBuffer",
    "ReceiptKey",
    "ReceiptPlacement",
    "is_host_buffer",
]


class BufferKind(StrEnum):
    MODEL = "model"
    KV = "kv"
    COMPUTE = "compute"
    OUTPUT = "output"
    RECURRENT = "recurrent"  # a recurrent or hybrid model's per-sequence state (Mamba, Jamba)


def is_host_buffer(device: str) -> bool:
    """Whether a llama.cpp buffer type lives in host memory (`CPU*`, pinned `*_Host`)."""
    return device.upper().startswith("CPU") or device.endswith("_Host")


class ReceiptBuffer(Spec):
    """One buffer llama.cpp allocated, as its load log names it."""

    device: str = Field(min_length=1, max_length=64, description="llama.cpp's buffer type name.")
    kind: BufferKind = Field(description="model, kv, compute, output or recurrent.")
    bytes: Bytes = Field(description="Its size, as the log prints it (MiB, two decimals).")


class ReceiptPlacement(Spec):
    """Where the model ran: layers on the device (as --n-gpu-layers counts) and GPUs used."""

    layers_on_device: int = Field(
        default=0, ge=0, le=4097, description="Layers on the device (--n-gpu-layers)."
    )
    gpus: int = Field(default=0, ge=0, le=64, description="GPUs it was split over.")


class Receipt(Spec):
    """One load of one model by one llama.cpp build, and the buffers it allocated."""

    model_config = Spec.model_config | {"extra": "ignore"}

    kind: Literal["Receipt"] = Field(default="Receipt", description="Receipt.")
    model_sha256: str = Field(pattern="^[0-9a-f]{64}$", description="The model file's digest.")
    context_tokens: int = Field(ge=1, le=16_777_216, description="--ctx-size asked for.")
    kv_cache_type: KvCacheType = Field(
        default=KvCacheType.F16, description="--cache-type-k/-v: f32, f16, q8_0 or q4_0."
    )
    placement: ReceiptPlacement = Field(default_factory=ReceiptPlacement)
    llama_build: str = Field(
        min_length=1, max_length=128, description="The llama.cpp build, as its log names it."
    )
    parallel: int = Field(default=1, ge=1, le=4096, description="--parallel (sequences).")
    micro_batch_tokens: int = Field(default=512, ge=1, le=1 << 20, description="--ubatch-size.")
    flash_attention: bool = Field(default=True, description="Flash attention on.")
    buffers: list[ReceiptBuffer] = Field(
        default_factory=list, max_length=256, description="The buffers it allocated."
    )
    source: str = Field(default="", max_length=1024, description="Where the numbers came from.")

    @property
    def key(self) -> ReceiptKey:
        return ReceiptKey(
            model_sha256=self.model_sha256,
            context_tokens=self.context_tokens,
            kv_cache_type=self.kv_cache_type,
            layers_on_device=self.placement.layers_on_device,
            gpus=self.placement.gpus,
            llama_build=self.llama_build,
            parallel=self.parallel,
            micro_batch_tokens=self.micro_batch_tokens,
            flash_attention=self.flash_attention,
        )

    @property
    def complete(self) -> bool:
        """Whether it names every part a load allocates: the weights, the per-sequence memory
        (KV cache, or a recurrent model's state) and the compute graph. One lacking any (a
        load log cut short, a report written by hand) would charge that part nothing."""
        kinds = {b.kind for b in self.buffers}
        per_sequence = BufferKind.KV in kinds or BufferKind.RECURRENT in kinds
        return BufferKind.MODEL in kinds and BufferKind.COMPUTE in kinds and per_sequence

    def total(self, kind: BufferKind | None = None, *, host: bool | None = None) -> int:
        """Bytes of the buffers of `kind` (all kinds if None) on the host, device or both."""
        return sum(
            b.bytes
            for b in self.buffers
            if (kind is None or b.kind is kind)
            and (host is None or is_host_buffer(b.device) == host)
        )


@dataclass(frozen=True, slots=True)
class ReceiptKey:
    model_sha256: str
    context_tokens: int
    kv_cache_type: KvCacheType
    layers_on_device: int
    gpus: int
    llama_build: str
    parallel: int
    micro_batch_tokens: int
    flash_attention: bool
