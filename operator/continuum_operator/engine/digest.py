"""The model served is the model named: the file's sha256 checked before llama-server starts.

An Engine names its model's digest (`spec.model.sha256`); receipts are filed under it
(docs/design.md "Models reach the engine"). A file replaced in its volume at the same path would
otherwise be served as the model it replaced and inherit that model's receipts. So the engine
runtime hashes the file before it starts llama-server and refuses to serve a mismatch
(`runtime.RuntimePhase.MODEL_MISMATCH`, both digests named); the facts Job checks the same
(`continuum facts --expect-sha256`).

Hashing streams the file (8 MiB reads, constant memory) and reports its progress, because a
40 GB model takes minutes. It is skipped when this Engine's runtime already verified the same
file: the record it keeps in `status.runtime.modelFile` (path, digest, node, and the file's
size, mtime, ctime and inode, in nanoseconds where the OS has them). Why that is enough:
writing a file's bytes, replacing it by rename or copy, or changing its times all move its
ctime, and ctime cannot be set back by the file's writer (only by changing the system clock,
which takes root on the node). A match is therefore the same inode with no write since it was
hashed. What the skip trusts: whoever can patch the Engine's status (the operator and this
engine's own pod) could forge the record; `continuum engine --rehash` ignores it.

Neighbours: `engine.runtime` (calls `verify` before the first launch), `cli_facts`.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

__all__ = [
    "CHUNK_BYTES",
    "DigestCheck",
    "DigestMismatch",
    "DigestOutcome",
    "FileStamp",
    "VerifiedModel",
    "hash_file",
    "mismatch_message",
    "verify",
]

CHUNK_BYTES = 8 << 20
#: Seconds between two progress reports while a file is hashed.
PROGRESS_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class FileStamp:
    """What changes when a file's bytes do: size, mtime, ctime (ns) and inode."""

    size_bytes: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> FileStamp:
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


@dataclass(frozen=True, slots=True)
class VerifiedModel:
    """A file whose digest this runtime computed: `status.runtime.modelFile`."""

    path: str
    sha256: str
    stamp: FileStamp
    node: str | None

    def to_status(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "sha256": self.sha256,
            "node": self.node,
            "sizeBytes": self.stamp.size_bytes,
            "mtimeNs": str(self.stamp.mtime_ns),  # beyond 2^53: a JSON number would round
            "ctimeNs": str(self.stamp.ctime_ns),
            "inode": str(self.stamp.inode),
        }

    @classmethod
    def from_status(cls, doc: object) -> VerifiedModel | None:
        """The record from a status document; None where it is absent or malformed."""
        if not isinstance(doc, Mapping):
            return None
        try:
            stamp = FileStamp(
                int(doc["sizeBytes"]), int(doc["mtimeNs"]), int(doc["ctimeNs"]), int(doc["inode"])
            )
            node = doc.get("node")
            return cls(str(doc["path"]), str(doc["sha256"]), stamp, str(node) if node else None)
        except (KeyError, TypeError, ValueError):
            return None


class DigestOutcome(StrEnum):
    """How a model file's digest was had (`DigestCheck.verdict`)."""

    HASHED = "Hashed"  # computed now
    SKIPPED = "Skipped"  # the same file this runtime verified before


@dataclass(frozen=True, slots=True)
class DigestCheck:
    verdict: DigestOutcome
    actual: str
    record: VerifiedModel

    def matches(self, expected: str | None) -> bool:
        return expected is None or self.actual == expected


class DigestMismatch(ValueError):
    """The file's digest is not the one the Engine names."""


def mismatch_message(path: Path | str, actual: str, expected: str) -> str:
    return (
        f"model file {path} has sha256 {actual}, but the Engine's spec.model.sha256 is "
        f"{expected}: the file on the volume is not the model this Engine names. Put the named "
        "file back, or set spec.model.sha256 to the new file's digest (`continuum facts "
        "--sha256 FILE` prints it); nothing is served or receipted until they agree"
    )


def hash_file(
    path: Path,
    *,
    progress: Callable[[int, int, float], None] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    clock: Callable[[], float] = time.monotonic,
    every_seconds: float = PROGRESS_SECONDS,
) -> str:
    """The file's hex sha256, read in chunks; `progress(done, total, seconds)` every few
    seconds and once at the end."""
    digest = hashlib.sha256()
    total = os.stat(path).st_size
    done = 0
    start = last = clock()
    with path.open("rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
            done += len(chunk)
            now = clock()
            if progress is not None and now - last >= every_seconds:
                progress(done, total, now - start)
                last = now
    if progress is not None:
        progress(done, total, clock() - start)
    return digest.hexdigest()


def verify(
    path: Path,
    expected: str | None,
    previous: VerifiedModel | None,
    *,
    node: str | None = None,
    rehash: bool = False,
    progress: Callable[[int, int, float], None] | None = None,
) -> DigestCheck:
    """The file's digest, from the previous record when it is the same file, else hashed.

    A record is used only for the same path on the same node, with the same stamp, and only
    when it holds the digest expected: a record of another digest proves nothing about this
    one, so the file is hashed again (its digest may have become the expected one).
    """
    stamp = FileStamp.of(path)
    if (
        not rehash
        and previous is not None
        and expected is not None
        and previous.sha256 == expected
        and previous.path == str(path)
        and previous.node == node
        and previous.stamp == stamp
    ):
        return DigestCheck(DigestOutcome.SKIPPED, previous.sha256, previous)
    actual = hash_file(path, progress=progress)
    # Recorded with the stamp from before the read: a file written while it was read (its
    # digest of neither version) has another stamp by now, so the next start hashes it again.
    return DigestCheck(DigestOutcome.HASHED, actual, VerifiedModel(str(path), actual, stamp, node))
