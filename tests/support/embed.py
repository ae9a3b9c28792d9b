"""A word-counting embedding model standing in for llama-cpp-python in the lane tests."""

from __future__ import annotations

from pathlib import Path

from continuum_operator.embed.lane import LoadedContext


class WordModel:
    """LaneModel's surface: a token per word (plus BOS), contexts in steps of 256 cells."""

    def __init__(self) -> None:
        self.model = Path("words.gguf")
        self.cells = 0

    def count_tokens(self, texts: list[str]) -> list[int]:
        return [len(t.split()) + 1 for t in texts]

    def ensure(self, tokens: int) -> LoadedContext | None:
        cells = -(-tokens // 256) * 256
        if self.cells >= cells:
            return None
        self.cells = cells
        return LoadedContext(cells=cells, receipt=None, log_text="")

    def calibrate(self, tokens: int) -> LoadedContext | None:
        return self.ensure(tokens)

    def embed(self, texts: list[str]) -> list[list[float]]:
        return [[1.0, 0.0] for _ in texts]

    def close(self) -> None:
        self.cells = 0
