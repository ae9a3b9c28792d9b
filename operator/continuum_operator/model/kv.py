"""The KV cache's cell types (llama.cpp --cache-type-k/-v), and their size against f16: read by
the Engine's spec, the plan and receipts alike."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["KvCacheType"]


class KvCacheType(StrEnum):
    F32 = "f32"
    F16 = "f16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"

    @property
    def bytes_ratio_to_f16(self) -> tuple[int, int]:
        """Bytes of this type per bytes of f16, as a fraction (llama.cpp block sizes)."""
        return {
            KvCacheType.F32: (2, 1),
            KvCacheType.F16: (1, 1),
            # q8_0: 34 bytes per block of 32 values, f16: 64 bytes for the same 32.
            KvCacheType.Q8_0: (34, 64),
            # q4_0: 18 bytes per block of 32 values.
            KvCacheType.Q4_0: (18, 64),
        }[self]
