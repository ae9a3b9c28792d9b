"""The GGUF header and tensor index of a file, parsed with every length bounded by the file.

A model file is hostile input: a tenant names it, and `continuum facts` runs where it lies (the
facts Job) with 256 MiB. `gguf.GGUFReader` builds numpy views for every array element and
string (500k empty strings cost it 874 MB) and believes every count (an array of 2^60 entries
in a 100-byte file spins until the memory runs out). So the header is walked here, with
`struct` over a read-only map of the file, against the GGUF layout that `gguf` describes
(`GGUFValueType`, `GGML_QUANT_SIZES`):

- every count (key-values, tensors, array entries, dimensions) and every string length is
  checked against the bytes left in the file before anything is read or allocated, and against
  a ceiling far above any real model's (`Limits`);
- arrays not kept (the tokenizer's vocabulary, long arrays no fact needs) are skipped, not
  built; numeric ones in one step, string ones by their lengths only;
- each tensor's data must lie inside the file.

The result is plain values (`GgufHeader`) that `gguf.facts` turns into `ModelFacts` without
further I/O. `file_sha256` streams the whole file: it is the model's digest for receipts.
"""

from __future__ import annotations

import hashlib
import mmap
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType
from gguf import GGUFValueType as T

__all__ = [
    "LIMITS",
    "GgufHeader",
    "GgufReadError",
    "Limits",
    "TensorEntry",
    "file_sha256",
    "read_header",
]

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


@dataclass(frozen=True, slots=True)
class Limits:
    """Ceilings on what a header may claim, each far above real models (their counts in the
    comments), so that walking the worst file the limits allow stays well under a second."""

    key_values: int = 65_536  # real models: under 100
    tensors: int = 65_536  # real models: a few thousand (experts are one tensor per layer)
    array_entries: int = 1_048_576  # real vocabularies: up to about 260k tokens or merges
    kept_array_entries: int = 65_536  # per-layer arrays: at most 4,096 layers
    kept_string_bytes: int = 1 << 20  # chat templates: tens of KiB
    name_bytes: int = 65_536  # keys and tensor names: ggml's limit is 64 bytes
    dimensions: int = 4  # GGML_MAX_DIMS


LIMITS = Limits()

# Arrays as long as the vocabulary are not facts the plan needs; skipping them keeps reading
# a 150k-token model's header fast. Their length still tells the vocabulary size.
_SKIPPED_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges")  # fmt: skip
VOCAB_LENGTH_KEY = "tokenizer.ggml.tokens#length"

# struct codes and sizes of the fixed-size value types.
_FIXED: Mapping[int, str] = {
    T.UINT8: "B", T.INT8: "b", T.UINT16: "H", T.INT16: "h", T.UINT32: "I", T.INT32: "i",
    T.FLOAT32: "f", T.BOOL: "?", T.UINT64: "Q", T.INT64: "q", T.FLOAT64: "d",
}  # fmt: skip
_STRING_LENGTH_BYTES = 8
# Smallest key-value: an empty key (its u64 length), the u32 type, a one-byte value.
_MIN_KV_BYTES = 8 + 4 + 1
# Smallest tensor info: an empty name, u32 dimensions (none), u32 type, u64 offset.
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8


class _Cursor:
    """A read position in the mapped file that refuses to read past its end."""

    def __init__(self, buf: mmap.mmap, source: str, order: str) -> None:
        self.buf, self.source, self.order = buf, source, order
        self.size = len(buf)
        self.pos = 0

    @property
    def left(self) -> int:
        return self.size - self.pos

    def fail(self, what: str) -> GgufReadError:
        return GgufReadError(f"{self.source}: not a readable GGUF file: {what}")

    def take(self, n: int, what: str) -> int:
        """Reserve `n` bytes at the cursor; the offset they start at."""
        if n > self.left:
            raise self.fail(
                f"truncated: {what} needs {n} bytes at offset {self.pos}, the file has "
                f"{self.left} left"
            )
        at = self.pos
        self.pos += n
        return at

    def fixed(self, code: str, what: str) -> Any:
        at = self.take(struct.calcsize(code), what)
        return struct.unpack_from(self.order + code, self.buf, at)[0]

    def count(self, what: str, each_bytes: int, ceiling: int) -> int:
        """A u64 count of items of at least `each_bytes`, bounded by the file and the ceiling."""
        n = int(self.fixed("Q", f"the count of {what}"))
        if n * each_bytes > self.left:
            raise self.fail(
                f"{what}: {n} claimed, of at least {each_bytes} bytes each, but only "
                f"{self.left} bytes are left in the file"
            )
        if n > ceiling:
            raise self.fail(f"{what}: {n} claimed, more than the {ceiling} this reader accepts")
        return n

    def string(self, what: str, keep_bytes: int) -> str | None:
        """A length-prefixed string; None (skipped, not read) when longer than `keep_bytes`."""
        n = int(self.fixed("Q", f"the length of {what}"))
        at = self.take(n, what)
        if n > keep_bytes:
            return None
        return bytes(self.buf[at : at + n]).decode("utf-8", errors="replace")


def read_header(path: str | Path, limits: Limits = LIMITS) -> GgufHeader:
    """Parse `path`'s GGUF header and tensor index; GgufReadError says what is wrong and where."""
    p = Path(path)
    if not p.is_file():
        raise GgufReadError(f"{p}: no such file")
    try:
        with p.open("rb") as f:
            if p.stat().st_size == 0:
                raise GgufReadError(f"{p}: not a readable GGUF file: it is empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, str(p), limits)
    except OSError as err:
        raise GgufReadError(f"{p}: cannot be read ({err})") from err


def _parse(buf: mmap.mmap, source: str, limits: Limits) -> GgufHeader:
    cur = _Cursor(buf, source, "<")
    magic = cur.fixed("I", "the magic number")
    if magic != GGUF_MAGIC:
        raise cur.fail("it does not start with the GGUF magic number")
    version = cur.fixed("I", "the version")
    if version & 0xFFFF == 0:  # a big-endian file read as little-endian
        cur.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise cur.fail(f"GGUF version {version}; versions 2 and 3 are read")
    n_tensors = int(cur.fixed("Q", "the tensor count"))
    n_kv = cur.count("key-values", _MIN_KV_BYTES, limits.key_values)
    if n_tensors * _MIN_TENSOR_BYTES > cur.left:
        raise cur.fail(
            f"tensors: {n_tensors} claimed, of at least {_MIN_TENSOR_BYTES} bytes each, but "
            f"only {cur.left} bytes are left in the file"
        )
    if n_tensors > limits.tensors:
        raise cur.fail(f"tensors: {n_tensors} claimed, more than the {limits.tensors} accepted")

    metadata: dict[str, MetaValue] = {}
    for i in range(n_kv):
        key = cur.string(f"the name of key-value {i}", limits.name_bytes)
        if key is None:
            raise cur.fail(f"the name of key-value {i} is longer than {limits.name_bytes} bytes")
        if key in metadata or (key == "tokenizer.ggml.tokens" and VOCAB_LENGTH_KEY in metadata):
            raise cur.fail(f"key {key!r} appears twice")
        value, length = _value(cur, key, limits)
        if value is not None:
            metadata[key] = value
        if key == "tokenizer.ggml.tokens":
            metadata[VOCAB_LENGTH_KEY] = length or 0

    tensors: list[tuple[str, int, int, int]] = []  # name, type, elements, offset
    names: set[str] = set()
    for i in range(n_tensors):
        name = cur.string(f"the name of tensor {i}", limits.name_bytes)
        if name is None:
            raise cur.fail(f"the name of tensor {i} is longer than {limits.name_bytes} bytes")
        if name in names:
            raise cur.fail(f"tensor {name!r} appears twice")
        names.add(name)
        n_dims = int(cur.fixed("I", f"the dimensions of tensor {name}"))
        if n_dims > limits.dimensions:
            raise cur.fail(f"tensor {name} has {n_dims} dimensions; ggml has at most 4")
        elements = 1
        for d in range(n_dims):
            elements *= int(cur.fixed("Q", f"dimension {d} of tensor {name}"))
        type_id = int(cur.fixed("I", f"the type of tensor {name}"))
        offset = int(cur.fixed("Q", f"the data offset of tensor {name}"))
        tensors.append((name, type_id, elements, offset))

    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise cur.fail(f"general.alignment is {alignment!r}; it must be a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    entries = tuple(
        _tensor(cur, name, type_id, elements, offset, data_start)
        for name, type_id, elements, offset in tensors
    )
    return GgufHeader(metadata=metadata, tensors=entries, source=source)


def _value(cur: _Cursor, key: str, limits: Limits) -> tuple[MetaValue | None, int | None]:
    """One key's value (None: skipped) and, for an array, its length."""
    vtype = int(cur.fixed("I", f"the type of {key}"))
    if vtype in _FIXED:
        return _fixed_value(cur, vtype, key), None
    if vtype == T.STRING:
        return cur.string(f"the value of {key}", limits.kept_string_bytes), None
    if vtype != T.ARRAY:
        raise cur.fail(f"{key} has value type {vtype}, which GGUF does not define")
    etype = int(cur.fixed("I", f"the entry type of {key}"))
    if etype == T.ARRAY:
        raise cur.fail(f"{key} is an array of arrays, which llama.cpp does not read")
    if etype != T.STRING and etype not in _FIXED:
        raise cur.fail(f"{key} is an array of value type {etype}, which GGUF does not define")
    each = _STRING_LENGTH_BYTES if etype == T.STRING else struct.calcsize(_FIXED[etype])
    n = cur.count(f"the entries of {key}", each, limits.array_entries)
    keep = key not in _SKIPPED_ARRAYS and n <= limits.kept_array_entries
    if etype == T.STRING:
        if not keep:
            _skip_strings(cur, key, n)
            return None, n
        kept = [cur.string(f"entry {j} of {key}", limits.kept_string_bytes) for j in range(n)]
        return [s or "" for s in kept], n
    at = cur.take(n * each, f"the entries of {key}")
    if not keep:
        return None, n
    return list(struct.unpack_from(f"{cur.order}{n}{_FIXED[etype]}", cur.buf, at)), n


def _skip_strings(cur: _Cursor, key: str, n: int) -> None:
    """Step over `n` strings by their lengths alone (a vocabulary: the one long walk)."""
    unpack, buf, size, pos = struct.Struct(cur.order + "Q").unpack_from, cur.buf, cur.size, cur.pos
    for j in range(n):
        if pos + 8 > size:
            cur.pos = pos
            raise cur.fail(f"truncated: entry {j} of {key} starts past the end of the file")
        pos += 8 + unpack(buf, pos)[0]
        if pos > size:
            cur.pos = pos
            raise cur.fail(f"truncated: entry {j} of {key} ends past the end of the file")
    cur.pos = pos


def _fixed_value(cur: _Cursor, vtype: int, key: str) -> Scalar:
    value = cur.fixed(_FIXED[vtype], f"the value of {key}")
    return bool(value) if vtype == T.BOOL else value


def _tensor(
    cur: _Cursor, name: str, type_id: int, elements: int, offset: int, data_start: int
) -> TensorEntry:
    try:
        qtype = GGMLQuantizationType(type_id)
        block, type_bytes = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cur.fail(f"tensor {name} has type {type_id}, which ggml does not define") from None
    if elements % block:
        raise cur.fail(f"tensor {name}: {elements} elements are not whole {qtype.name} blocks")
    n_bytes = elements // block * type_bytes
    if data_start + offset + n_bytes > cur.size:
        raise cur.fail(
            f"tensor {name}'s data ({n_bytes} bytes at offset {offset}) ends past the end of "
            f"the file ({cur.size} bytes)"
        )
    return TensorEntry(name=name, type_name=qtype.name, n_elements=elements, n_bytes=n_bytes)


def file_sha256(path: str | Path, chunk_bytes: int = 8 << 20) -> str:
    """The hex sha256 of the whole file (the model digest receipts are keyed by)."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()
