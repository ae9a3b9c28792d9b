"""Load a GGUF with llama-cpp-python and keep llama.cpp's log: a receipt in the making.

For tests and benches on the CPU: `load_and_log(path, n_ctx=..., ...)` loads the model with
the settings the engine uses (flash attention, KV type, micro-batch), captures llama.cpp's own
log (`embed.lane.captured_llama_log`), frees the model and returns the log text.
`core.receipts.parse_llama_log` reads the buffers from it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from continuum_operator.embed.lane import captured_llama_log, llama_build

__all__ = ["llama_build", "load_and_log"]

# llama.cpp's kv type names to ggml's type ids (ggml.h: GGML_TYPE_F32 0, F16 1, Q4_0 2, Q8_0 8).
_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}


def load_and_log(
    path: str | Path,
    *,
    n_ctx: int,
    flash_attn: bool = True,
    kv_type: str = "f16",
    n_ubatch: int = 512,
    n_batch: int = 2048,
    n_threads: int = 2,
    decode: bool = False,
) -> str:
    """llama.cpp's log of loading `path` at `n_ctx` (and, with `decode`, of one short decode)."""
    llama_cpp: Any = importlib.import_module("llama_cpp")  # an extra: imported on use
    with captured_llama_log() as chunks:
        kwargs: dict[str, Any] = {
            "model_path": str(path),
            "n_ctx": n_ctx,
            "n_batch": n_batch,
            "n_ubatch": n_ubatch,
            "n_threads": n_threads,
            "flash_attn": flash_attn,
            "type_k": _GGML_TYPES[kv_type],
            "type_v": _GGML_TYPES[kv_type],
            "verbose": False,
            "seed": 0,
        }
        llm = llama_cpp.Llama(**kwargs)
        try:
            if decode:
                llm("hello world", max_tokens=2, temperature=0.0)
        finally:
            llm.close()
    return "".join(chunks)
