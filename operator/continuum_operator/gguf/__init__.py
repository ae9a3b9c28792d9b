"""Model facts from GGUF files: the header and tensor index, never the weights.

`reader` does the file I/O (gguf.GGUFReader, sha256); `facts` turns what it read into the
`ModelFacts` an Engine's `spec.model.facts` holds, with no I/O of its own.
"""

from __future__ import annotations

from pathlib import Path

from continuum_operator.gguf.facts import FactsError, facts_from_header
from continuum_operator.gguf.reader import (
    GgufHeader,
    GgufReadError,
    TensorEntry,
    file_sha256,
    read_header,
)
from continuum_operator.model.engine import ModelFacts

__all__ = [
    "FactsError",
    "GgufHeader",
    "GgufReadError",
    "TensorEntry",
    "facts_from_header",
    "file_sha256",
    "read_facts",
    "read_header",
]


def read_facts(path: str | Path) -> ModelFacts:
    """The facts of the GGUF file at `path` (header and tensor index only)."""
    return facts_from_header(read_header(path))
