"""The park store of one engine: reclaimed minds' contexts saved by llama-server and restored
at their next grant (docs/gateway.md, "A turn cut off"). The decisions are `engine.park`'s;
this module calls llama-server's slot actions and keeps the files.

llama-server saves and restores a slot to and from a file of its `--slot-save-path`; the
gateway, beside it in the same container, names every file itself (from nothing a client
sends), keeps an index of whose each is (`index.json`, so a runtime restarted on the same
launch shape finds them again), and deletes them. Minds never reach a slot action: the gateway
refuses `POST /slots/{id}` to them (docs/gateway.md, "Every route").
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from continuum_operator.engine.admission import GrantTable
from continuum_operator.engine.metrics import EngineMetrics
from continuum_operator.engine.park import (
    Dropped,
    NotParked,
    Parked,
    evictions,
    gone_minds,
    park_verdict,
)
from continuum_operator.engine.upstream import UpstreamDown

__all__ = ["ParkSettings", "ParkStore", "Resumed"]

log = logging.getLogger(__name__)

INDEX = "index.json"
PREFIX = "park-"
#: The only names the store's files have (the gateway's own): an index naming another is
#: not read, so nothing outside the store is ever deleted or restored through it.
FILE_NAME = re.compile(r"^park-[0-9a-f]{24}-[0-9a-f]{12}$")
#: Saves smaller than this are not timed for the write rate.
RATE_MIN_BYTES = 4 * 2**20

#: POST `body` to llama-server's `path`: its status and JSON (`UpstreamDown` if not reached).
Post = Callable[[str, Any], Awaitable[tuple[int, Any]]]


@dataclass(frozen=True, slots=True)
class ParkSettings:
    """Where an engine parks contexts, and how much it may."""

    #: llama-server's `--slot-save-path`: the store's directory, the gateway's alone.
    path: Path
    #: The Engine's park budget, in bytes of the store's tier.
    budget_bytes: int
    #: The launch shape parks are restored into (model digest and slot context): a park saved
    #: under another is dropped.
    shape: str
    #: Bytes a saved token takes before any save taught the real figure: the KV cache's bytes
    #: per cell (the load log's), 0 where unknown (then nothing is parked until one is known).
    bytes_per_token: float = 0.0
    #: The store's write rate assumed before a save measured it (bytes per second).
    write_bytes_per_second: float = 100e6


@dataclass(frozen=True, slots=True)
class Resumed:
    """A context restored into her slot before her first request of a new grant."""

    tokens: int
    bytes: int
    seconds: float


@dataclass
class ParkStore:
    settings: ParkSettings
    post: Post
    metrics: EngineMetrics
    clock: Callable[[], float] = time.time
    #: Called whenever the parks change (the runtime publishes status.runtime.park).
    changed: Callable[[], None] | None = None
    parked: dict[str, Parked] = field(default_factory=dict)
    #: Learned from saves: the largest bytes per saved token, the slowest write rate.
    bytes_per_token: float = 0.0
    write_rate: float = 0.0
    #: The saves in flight: each mind's ends when her save is answered (or given up), and
    #: the files they write, which no index names until then.
    saving: dict[str, asyncio.Event] = field(default_factory=dict)
    writing: set[str] = field(default_factory=set)
    #: Minds parked at their own ask (`POST /v1/park`) who have asked nothing since: the
    #: operator gives their slots to minds waiting (core.grants, `Parked`).
    idle: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.bytes_per_token = self.settings.bytes_per_token
        self.write_rate = self.settings.write_bytes_per_second

    # --- the files ----------------------------------------------------------------------------

    def load(self) -> None:
        """Take up the parks an earlier runtime left: those of this launch shape are kept,
        the others dropped, and files no index names deleted."""
        self.settings.path.mkdir(parents=True, exist_ok=True)
        try:
            listed = json.loads((self.settings.path / INDEX).read_text())
        except (OSError, ValueError):
            listed = []
        found = [p for p in map(_entry, listed if isinstance(listed, list) else []) if p]
        for p in sorted(found, key=lambda p: p.at):
            if p.shape == self.settings.shape and (self.settings.path / p.file).is_file():
                self.parked[p.mind] = p
            else:
                self._delete(p, Dropped.SHAPE)
        self.sweep()
        self._save_index()

    def sweep(self) -> None:
        """Delete the store's files that no index names and no save in flight writes: a save
        given up at the reclaim's deadline, which llama-server may still have written after
        (it cannot be cancelled), or a file an earlier runtime left."""
        kept = {p.file for p in self.parked.values()} | self.writing
        for path in self.settings.path.glob(PREFIX + "*"):
            if path.name not in kept:
                path.unlink(missing_ok=True)
                log.info("deleted %s, a park no index names (a save given up)", path.name)

    def _save_index(self) -> None:
        text = json.dumps([asdict(p) for p in self.parked.values()])
        tmp = self.settings.path / (INDEX + ".tmp")
        with contextlib.suppress(OSError):
            tmp.write_text(text)
            os.replace(tmp, self.settings.path / INDEX)
        self._gauge()
        self._publish()

    def _delete(self, p: Parked, why: Dropped) -> None:
        (self.settings.path / p.file).unlink(missing_ok=True)
        if self.parked.get(p.mind) == p:
            del self.parked[p.mind]
        self.metrics.park_dropped(why.value)
        log.info("dropped the parked context of %s (%s)", p.mind, why.value)

    def _gauge(self) -> None:
        self.metrics.parked_now({m: p.bytes for m, p in self.parked.items()})

    def used_bytes(self) -> int:
        return sum(p.bytes for p in self.parked.values())

    # --- park, resume, forget -----------------------------------------------------------------

    def verdict(self, tokens: int, deadline: float) -> NotParked | None:
        """Why a slot of at most `tokens` tokens would not be saved before `deadline` (counted
        as a skip), or None: a save would be started."""
        verdict = park_verdict(
            budget=self.settings.budget_bytes,
            tokens=tokens,
            bytes_per_token=self.bytes_per_token,
            write_bytes_per_second=self.write_rate,
            seconds_left=deadline - self.clock(),
        )
        if verdict.reason is not None:
            self.metrics.park_skipped(verdict.reason.value)
        return verdict.reason

    async def park(self, mind: str, slot: int, tokens: int, deadline: float) -> Parked | NotParked:
        """Save her slot (at most `tokens` tokens) if it can be saved before `deadline`."""
        if (why := self.verdict(tokens, deadline)) is not None:
            return why
        expected = int(tokens * self.bytes_per_token)
        done = self.saving[mind] = asyncio.Event()
        name = f"{PREFIX}{hashlib.sha256(mind.encode()).hexdigest()[:24]}-{secrets.token_hex(6)}"
        self.writing.add(name)
        try:
            return await self._park(mind, slot, name, expected)
        finally:
            # Answered, failed or given up (cancelled at the deadline): a file no index names
            # is deleted now, and by the next sweep if llama-server writes it later.
            self.writing.discard(name)
            if all(p.file != name for p in self.parked.values()):
                (self.settings.path / name).unlink(missing_ok=True)
            if self.saving.get(mind) is done:
                del self.saving[mind]
            done.set()

    async def _park(self, mind: str, slot: int, name: str, expected: int) -> Parked | NotParked:
        old = self.parked.get(mind)
        if old is not None:
            self._delete(old, Dropped.REPLACED)
        for p in evictions(self.parked, self.settings.budget_bytes, expected):
            self._delete(p, Dropped.EVICTED)
        status, payload = await self.post(f"/slots/{slot}?action=save", {"filename": name})
        saved = _figures(payload, "n_saved", "n_written")
        if status != 200 or saved is None or saved[0] <= 0:
            log.warning("slot %d of %s not saved: %s %s", slot, mind, status, payload)
            self.metrics.park_skipped(NotParked.SAVE_FAILED.value)
            return NotParked.SAVE_FAILED
        n_tokens, n_bytes, ms = saved
        self._learn(n_tokens, n_bytes, ms)
        p = Parked(mind, name, n_tokens, n_bytes, self.settings.shape, self.clock())
        # The real size may exceed the estimate: the store's budget holds all the same.
        for old_park in evictions(self.parked, self.settings.budget_bytes, n_bytes):
            self._delete(old_park, Dropped.EVICTED)
        if n_bytes > self.settings.budget_bytes:
            self.metrics.park_skipped(NotParked.TOO_LARGE.value)
            return NotParked.TOO_LARGE
        self.parked[mind] = p
        self.metrics.parked(n_tokens, n_bytes)
        self._save_index()
        return p

    def _learn(self, tokens: int, n_bytes: int, ms: float) -> None:
        """A save's figures: the most bytes a token took, and the write rate, an average of
        the saves large enough to time it (a small one's time is its fixed cost: learning
        from it would refuse every large park as too slow)."""
        self.bytes_per_token = max(self.bytes_per_token, n_bytes / max(1, tokens))
        if ms > 0 and n_bytes >= RATE_MIN_BYTES:
            rate = n_bytes / (ms / 1000)
            self.write_rate = (self.write_rate + rate) / 2 if self.write_rate > 0 else rate

    def went_idle(self, mind: str) -> None:
        """She parked herself: reported idle until she asks anything again."""
        if mind not in self.idle:
            self.idle.add(mind)
            self._publish()

    def back(self, mind: str) -> None:
        """She asks again (a request, a turn): no longer idle."""
        if mind in self.idle:
            self.idle.discard(mind)
            self._publish()

    def _publish(self) -> None:
        if self.changed is not None:
            self.changed()

    def waiting(self, mind: str) -> bool:
        """She has a park to restore, or one being saved (her save runs behind her release)."""
        return mind in self.parked or mind in self.saving

    async def resume(self, mind: str, slot: int) -> Resumed | None:
        """Restore her parked context into `slot` (which holds nothing of another mind's),
        once a save of hers in flight has ended: what was restored, or None where she has
        none or it no longer fits this launch."""
        if (saving := self.saving.get(mind)) is not None:
            await saving.wait()
        p = self.parked.pop(mind, None)
        if p is None:
            return None
        try:
            if p.shape != self.settings.shape:
                self.metrics.park_dropped(Dropped.SHAPE.value)
                return None
            started = time.monotonic()
            try:
                status, payload = await self.post(
                    f"/slots/{slot}?action=restore", {"filename": p.file}
                )
            except UpstreamDown as err:
                status, payload = 0, str(err)
            restored = _figures(payload, "n_restored", "n_read")
            if status != 200 or restored is None:
                log.warning("the parked context of %s not restored: %s %s", mind, status, payload)
                self.metrics.park_dropped(Dropped.RESTORE_FAILED.value)
                return None
            self.metrics.resumed(restored[0])
            return Resumed(restored[0], restored[1], time.monotonic() - started)
        finally:
            (self.settings.path / p.file).unlink(missing_ok=True)
            self._save_index()

    def forget(self, table: GrantTable) -> None:
        """Delete the parks of minds the table says are gone or refused."""
        gone = gone_minds(table, self.parked)
        for mind, why in gone.items():
            self._delete(self.parked[mind], why)
        if gone:
            self._save_index()
        self.sweep()
        left = {m for m in self.idle if table.entry(m) is None and not table.left_out}
        if left:  # her Mind deleted: nothing to report of her
            self.idle -= left
            self._publish()

    def to_status(self) -> dict[str, Any]:
        return {
            "budgetBytes": self.settings.budget_bytes,
            "parkedBytes": self.used_bytes(),
            "parkedContexts": len(self.parked),
            "minds": [
                {"mind": p.mind, "tokens": p.tokens, "bytes": p.bytes}
                for p in sorted(self.parked.values(), key=lambda p: p.at)
            ],
            "idle": sorted(self.idle),
        }


def _entry(raw: Any) -> Parked | None:
    """One park of the index, or None where it is not one of the gateway's own."""
    try:
        p = Parked(**raw)
    except TypeError:
        return None
    typed = all(isinstance(v, str) for v in (p.mind, p.file, p.shape)) and all(
        isinstance(v, int) for v in (p.tokens, p.bytes)
    )
    if not typed or not isinstance(p.at, int | float) or not FILE_NAME.match(p.file):
        return None
    return p


def _figures(payload: Any, tokens_key: str, bytes_key: str) -> tuple[int, int, float] | None:
    """(tokens, bytes, milliseconds) of llama-server's answer to a save or restore."""
    if not isinstance(payload, dict):
        return None
    try:
        tokens, n_bytes = int(payload[tokens_key]), int(payload[bytes_key])
    except (KeyError, TypeError, ValueError):
        return None
    timings = payload.get("timings")
    key = "save_ms" if tokens_key == "n_saved" else "restore_ms"
    ms = float(timings.get(key) or 0.0) if isinstance(timings, dict) else 0.0
    return tokens, n_bytes, ms
