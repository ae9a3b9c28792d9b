"""The GGUF header and tensor index of a file, read with the `gguf` package.

`gguf.GGUFReader` memory-maps the file and parses the key-value metadata and the tensor index;
tensor data is only mapped, never touched here, so reading a 40 GB model costs a few pages.
The result is plain values (`GgufHeader`) that `gguf.facts` turns into `ModelFacts` without
further I/O. `file_sha256` streams the whole file: it is the model's digest for receipts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

__all__ = ["GgufHeader", "GgufReadError", "TensorEntry", "file_sha256", "read_header"]

Scalar = int | float | bool | str
MetaValue = Scalar | list[Any]


class GgufReadError(ValueError):
    """The file is missing, or is not a GGUF file this package can parse."""


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One row of the tensor index: name, type, element count and bytes in the file."""

    name: str
    type_name: str
    n_elements: int
    n_bytes: int


@dataclass(frozen=True, slots=True)
class GgufHeader:
    """Metadata (key -> value; arrays as lists, token lists left out) and the tensor index."""

    metadata: Mapping[str, MetaValue]
    tensors: tuple[TensorEntry, ...]
    source: str = ""

    @property
    def architecture(self) -> str | None:
        arch = self.metadata.get("general.architecture")
        return arch if isinstance(arch, str) else None


# Arrays as long as the vocabulary are not facts the plan needs; skipping them keeps reading
# a 150k-token model's header fast. Their length still tells the vocabulary size.
_SKIPPED_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges")  # fmt: skip
VOCAB_LENGTH_KEY = "tokenizer.ggml.tokens#length"


def read_header(path: str | Path) -> GgufHeader:
    """Parse `path`'s GGUF header and tensor index."""
    p = Path(path)
    if not p.is_file():
        raise GgufReadError(f"{p}: no such file")
    try:
        reader = gguf.GGUFReader(str(p), "r")
    except (ValueError, OSError) as err:
        raise GgufReadError(f"{p}: not a readable GGUF file ({err})") from err
    metadata: dict[str, MetaValue] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if name in _SKIPPED_ARRAYS:
            if name == "tokenizer.ggml.tokens":
                metadata[VOCAB_LENGTH_KEY] = len(field.data)
            continue
        metadata[name] = field.contents()
    tensors = tuple(
        TensorEntry(
            name=t.name,
            type_name=t.tensor_type.name,
            n_elements=int(t.n_elements),
            n_bytes=int(t.n_bytes),
        )
        for t in reader.tensors
    )
    return GgufHeader(metadata=metadata, tensors=tensors, source=str(p))


def file_sha256(path: str | Path, chunk_bytes: int = 8 << 20) -> str:
    """The hex sha256 of the whole file (the model digest receipts are keyed by)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
