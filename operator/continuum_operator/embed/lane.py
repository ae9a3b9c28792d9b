"""One embedding context on llama-cpp-python, sized to what the lane has embedded.

llama.cpp allocates a context's buffers (KV cells, the graph of one micro-batch, the output
buffer) when the context is made, so a lane's bytes follow the context it holds, not the
request it serves. `LaneModel` holds a context of `cells` tokens (padded to 256 as llama.cpp
pads) and makes a larger one only when an admitted request needs it; an embedding is one batch
(`n_batch = n_ubatch = cells`), mean-pooled. Each load's llama.cpp log is captured and filed as
a receipt (`core.receipts`) under the model's digest, the context and the build, so the
operator charges measured bytes instead of the estimate.

Blocking: call it from a thread (`embed.runtime` does, one call at a time).
Neighbours: `core.embed` (what the bytes mean), `testing.llama_load` (the same log capture).
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from continuum_operator.core.compute import kv_cells_per_sequence
from continuum_operator.core.receipts import Receipt, parse_llama_log

__all__ = [
    "LaneModel",
    "LoadedContext",
    "captured_llama_log",
    "gpu_offload_supported",
    "llama_build",
]

# llama.cpp's log callback is process-wide: one load captures at a time.
_log_lock = threading.Lock()
_WORDS = ("the", "lane", "embeds", "memory", "of", "a", "node", "pool", "tokens", "engine")


def _llama_cpp() -> Any:
    import llama_cpp

    return llama_cpp


def llama_build() -> str:
    """The build receipts are filed under: llama-cpp-python's version (it pins llama.cpp)."""
    return f"llama-cpp-python {_llama_cpp().__version__}"


@contextmanager
def captured_llama_log() -> Iterator[list[str]]:
    """llama.cpp's log while the block runs, as the chunks it writes (joined, the log text).

    Through `llama_cpp.llama_log_set` with our callback: llama-cpp-python's own logger maps the
    levels wrongly and drops lines when not verbose. Its logger is put back on leaving."""
    llama_cpp = _llama_cpp()
    chunks: list[str] = []

    def on_log(level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
        if text:
            chunks.append(text.decode("utf-8", "replace"))

    callback = llama_cpp.llama_log_callback(on_log)
    with _log_lock:
        llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
        try:
            yield chunks
        finally:
            from llama_cpp import _logger

            llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


def gpu_offload_supported() -> bool:
    """Whether this llama.cpp can offload to a GPU (`llama_supports_gpu_offload()`)."""
    return bool(_llama_cpp().llama_supports_gpu_offload())


@dataclass(frozen=True, slots=True)
class LoadedContext:
    cells: int
    receipt: Receipt | None
    log_text: str


class LaneModel:
    """A model loaded for embeddings, with a context that only grows."""

    def __init__(
        self,
        model: Path,
        *,
        model_sha256: str | None,
        n_gpu_layers: int = 0,
        n_threads: int = 2,
        flash_attn: bool = True,
    ) -> None:
        self.model = model
        self.model_sha256 = model_sha256
        self.n_gpu_layers = n_gpu_layers
        self.n_threads = n_threads
        self.flash_attn = flash_attn
        self._llm: Any = None
        self.cells = 0
        self.loads: list[LoadedContext] = []

    def close(self) -> None:
        if self._llm is not None:
            self._llm.close()
            self._llm = None
            self.cells = 0

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens of each input as the embedding will see them (with BOS)."""
        llm = self._llm if self._llm is not None else self._load(256).llm
        return [len(llm.tokenize(t.encode("utf-8"))) for t in texts]

    def ensure(self, tokens: int) -> LoadedContext | None:
        """Hold a context of at least `tokens`; returns the new load, or None when it holds one."""
        cells = kv_cells_per_sequence(tokens)
        if self._llm is not None and self.cells >= cells:
            return None
        loaded = self._load(cells)
        return loaded.context

    def calibrate(self, tokens: int) -> LoadedContext | None:
        """A pass at `tokens`: the context is made at that size and one input that fills it is
        embedded, so the buffers the floor stands for are allocated and measured before the
        first request."""
        loaded = self.ensure(tokens)
        text = " ".join(_WORDS[i % len(_WORDS)] for i in range(self.cells))
        self._llm.embed(text, normalize=True, truncate=True)
        return loaded

    def embed(self, texts: list[str]) -> list[list[float]]:
        """Mean-pooled, normalised embeddings; the context must hold the largest input."""
        assert self._llm is not None, "ensure() a context first"
        out = self._llm.embed(texts, normalize=True, truncate=False)
        return [list(map(float, v)) for v in out]

    # -- loading ----------------------------------------------------------------------------

    @dataclass(frozen=True, slots=True)
    class _Loaded:
        llm: Any
        context: LoadedContext

    def _load(self, cells: int) -> LaneModel._Loaded:
        llama_cpp = _llama_cpp()
        # The old context goes first: the lane never holds two (its lease covers one).
        self.close()
        with captured_llama_log() as chunks:
            llm = llama_cpp.Llama(
                model_path=str(self.model),
                n_ctx=cells,
                n_batch=cells,
                n_ubatch=cells,
                n_threads=self.n_threads,
                n_gpu_layers=self.n_gpu_layers,
                flash_attn=self.flash_attn,
                embedding=True,
                pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                verbose=False,
                seed=0,
            )
        self._llm = llm
        self.cells = cells
        text = "".join(chunks)
        receipt = None
        if self.model_sha256 is not None:
            try:
                receipt = parse_llama_log(text).receipt(
                    model_sha256=self.model_sha256,
                    context_tokens=cells,
                    llama_build=llama_build(),
                    gpus=1 if self.n_gpu_layers else 0,
                    source=f"continuum embed: {self.model.name}",
                )
            except ValueError:
                receipt = None
        context = LoadedContext(cells=cells, receipt=receipt, log_text=text)
        self.loads.append(context)
        return LaneModel._Loaded(llm, context)
