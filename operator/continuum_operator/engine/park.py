"""Parked contexts, decided: whether a reclaimed slot is saved, what a full store evicts, whose
context a grant table says is gone (docs/gateway.md, "A turn cut off"). Pure: no I/O; the
gateway's `engine.parking` saves, restores and deletes the files.

A parked context is one mind's slot, saved by llama-server (`/slots/{id}?action=save`) into the
engine's park store: a directory of the node's host memory or disk with a budget of bytes. It
is restored only into a slot of the same launch shape (model digest and slot context) and only
for the mind it was saved from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum

from continuum_operator.core.grants import REFUSALS, GrantReason
from continuum_operator.engine.admission import GrantTable
from continuum_operator.model.mind import GrantState

__all__ = [
    "PARKING",
    "Dropped",
    "NotParked",
    "ParkVerdict",
    "Parked",
    "Parking",
    "evictions",
    "gone_minds",
    "park_verdict",
]

#: A save is started only if twice its expected time, and this margin for the erase that
#: follows, fit before the reclaim's deadline: a save llama-server has begun cannot be
#: cancelled (its main loop writes the file), so a late one would delay the release.
ERASE_MARGIN_SECONDS = 0.5
SAVE_TIME_FACTOR = 2.0


class NotParked(StrEnum):
    """Why a reclaimed slot was erased without being parked (the metric's label)."""

    NO_STORE = "NoStore"  # the engine declares no park budget
    EMPTY = "Empty"  # the slot held nothing of hers
    SIZE_UNKNOWN = "SizeUnknown"  # no save yet, and the KV cache's bytes per cell unknown
    TOO_LARGE = "TooLarge"  # larger than the whole store
    NO_TIME = "NoTime"  # the save could not finish before the reclaim's deadline
    SAVE_FAILED = "SaveFailed"  # llama-server did not save it


class Parking(Enum):
    """A reclaimed slot whose save was started behind its release: its outcome comes later."""

    PARKING = "Parking"


PARKING = Parking.PARKING


class Dropped(StrEnum):
    """Why a parked context was deleted unrestored (the metric's label)."""

    EVICTED = "Evicted"  # the oldest, to make room for a newer park
    MIND_GONE = "MindGone"  # her Mind was deleted (she left the grant table)
    REFUSED = "Refused"  # her grant was refused
    SHAPE = "ShapeChanged"  # saved under another model or slot shape
    RESTORE_FAILED = "RestoreFailed"  # llama-server did not restore it
    REPLACED = "Replaced"  # she was parked again


@dataclass(frozen=True, slots=True)
class Parked:
    """One mind's context in the park store: a file the gateway named, never a client."""

    mind: str
    file: str
    tokens: int
    bytes: int
    #: The launch shape it was saved under (model digest and slot context).
    shape: str
    at: float


@dataclass(frozen=True, slots=True)
class ParkVerdict:
    """Whether to save a reclaimed slot: `reason` None to save it, with its expected bytes."""

    reason: NotParked | None
    expected_bytes: int
    expected_seconds: float


def park_verdict(
    *,
    budget: int,
    tokens: int,
    bytes_per_token: float,
    write_bytes_per_second: float,
    seconds_left: float,
) -> ParkVerdict:
    """Whether a slot of at most `tokens` tokens is saved before the reclaim's deadline.

    The expected size is the tokens times the bytes a saved token took (learned from the
    engine's saves, else the KV cache's bytes per cell); the expected time, that size at the
    write rate seen. Too large for the store, or too slow for the time left: erased, not
    parked, and the reclaim is as fast as without a store.
    """
    expected = int(tokens * max(0.0, bytes_per_token))
    seconds = expected / write_bytes_per_second if write_bytes_per_second > 0 else float("inf")
    if budget <= 0:
        return ParkVerdict(NotParked.NO_STORE, expected, seconds)
    if tokens <= 0:
        return ParkVerdict(NotParked.EMPTY, expected, seconds)
    if bytes_per_token <= 0:
        return ParkVerdict(NotParked.SIZE_UNKNOWN, expected, seconds)
    if expected > budget:
        return ParkVerdict(NotParked.TOO_LARGE, expected, seconds)
    if seconds * SAVE_TIME_FACTOR + ERASE_MARGIN_SECONDS > seconds_left:
        return ParkVerdict(NotParked.NO_TIME, expected, seconds)
    return ParkVerdict(None, expected, seconds)


def evictions(parked: Mapping[str, Parked], budget: int, incoming: int) -> list[Parked]:
    """The parks to delete, least recently parked first, so that `incoming` bytes fit."""
    used = sum(p.bytes for p in parked.values())
    out: list[Parked] = []
    for p in sorted(parked.values(), key=lambda p: p.at):
        if used + incoming <= budget:
            break
        out.append(p)
        used -= p.bytes
    return out


def gone_minds(table: GrantTable, parked: Mapping[str, Parked]) -> dict[str, Dropped]:
    """The parked minds whose context the grant table says is to be deleted: her Mind deleted
    (she is no longer listed in a table that lists everyone, or her slot is reclaimed for
    `MindDeleted`) or her grant refused."""
    out: dict[str, Dropped] = {}
    for mind in parked:
        e = table.entry(mind)
        if e is None:
            if not table.left_out:  # a long queue's tail is not listed: absent is not gone
                out[mind] = Dropped.MIND_GONE
        elif e.reason == GrantReason.MIND_DELETED and e.state is not GrantState.GRANTED:
            out[mind] = Dropped.MIND_GONE
        elif e.state is GrantState.QUEUED and e.reason in REFUSALS:
            out[mind] = Dropped.REFUSED
    return out
