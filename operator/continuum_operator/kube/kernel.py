"""The controller kernel: a keyed work queue and the loop that drains it, in the shape of
controller-runtime's and Kueue's (docs/architecture.md, "Reconcilers").

A reconciler supplies every key it governs, a decision per key from the cache as it is now
(`decide`, no API calls) and the writes of a decision (`write`); the watches mark keys dirty.
The kernel does the rest, once for every reconciler on it: it waits for a mark or the resync
period, waits the debounce so a burst of events is one pass, decides only the keys marked
(every key at a resync: the safety net for a missed event), writes only while `may_write`
says this replica leads, and takes a key whose write failed again after a backoff that
doubles from `retry_seconds` up to `max_retry_seconds` (a conflict, the API server away)
without holding up the others. One key is decided and written at a time, in key order, so a
decision sees every write before it (the cache records them at once).

Neighbours: `kube.cache` (the watches, which mark), `kube.embedlanes` (the lanes' reconciler).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = ["KernelSettings", "Reconciler", "WorkQueue", "drain", "run"]

log = logging.getLogger("continuum.kernel")

K = TypeVar("K", bound=Hashable)
W = TypeVar("W")


@dataclass(frozen=True, slots=True)
class KernelSettings:
    resync_seconds: float = 60.0  # every key decided at least this often
    debounce_seconds: float = 0.2  # after the first mark, before the pass
    retry_seconds: float = 1.0  # a failed key's first wait; doubled per failure
    max_retry_seconds: float = 60.0


@dataclass
class WorkQueue(Generic[K]):
    """Dirty keys, a resync flag and the keys waiting out a retry. Marks may come from the
    event loop or from a writer's thread (the caches record writes' answers there); the loop
    takes them all at once."""

    changed: asyncio.Event = field(default_factory=asyncio.Event)
    _dirty: set[K] = field(default_factory=set)
    _all: bool = True  # the first pass decides every key
    _retry: dict[K, tuple[float, float]] = field(default_factory=dict)  # key -> (due, wait)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None  # the draining loop's, once it runs

    def mark(self, *keys: K) -> None:
        if not keys:
            return
        with self._lock:
            self._dirty.update(keys)
        self._wake()

    def mark_all(self) -> None:
        with self._lock:
            self._all = True
        self._wake()

    def _wake(self) -> None:
        # asyncio.Event is not thread-safe: from another thread, set it in its own loop.
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if self._loop is None or running is self._loop:
            self.changed.set()
        else:
            self._loop.call_soon_threadsafe(self.changed.set)

    def take(self, every: Iterable[K], now: float) -> list[K]:
        """The keys to decide now, in order: the marked (every key after `mark_all`) and the
        retries that are due; the marks are cleared."""
        with self._lock:
            keys = set(every) if self._all else set(self._dirty)
            keys |= {k for k, (due, _) in self._retry.items() if due <= now}
            self._dirty, self._all = set(), False
            self.changed.clear()
        return sorted(keys, key=repr)

    def failed(self, key: K, now: float, settings: KernelSettings) -> None:
        """Take `key` again after its backoff (each failure in a row doubles it)."""
        _, wait = self._retry.get(key, (0.0, settings.retry_seconds / 2))
        wait = min(wait * 2, settings.max_retry_seconds)
        self._retry[key] = (now + wait, wait)

    def succeeded(self, key: K) -> None:
        self._retry.pop(key, None)

    def next_retry(self) -> float | None:
        """When the earliest retry is due (None: none is waiting)."""
        return min((due for due, _ in self._retry.values()), default=None)


class Reconciler(Protocol[K, W]):
    def keys(self) -> Iterable[K]:
        """Every key this reconciler governs now (a resync decides them all)."""
        ...

    def decide(self, key: K, now: float) -> W | None:
        """What `key` needs, from the cache alone (None: it is gone, nothing to do)."""
        ...

    async def write(self, key: K, writes: W) -> None:
        """Apply a decision; raise to have the key taken again after a backoff."""
        ...


async def drain(
    reconciler: Reconciler[K, W],
    queue: WorkQueue[K],
    settings: KernelSettings,
    *,
    may_write: Callable[[], bool] = lambda: True,
    clock: Callable[[], float] = time.time,
) -> int:
    """One pass: decide and write every key due now. Returns how many keys it decided."""
    if not may_write():
        return 0  # not leading: the marks wait for this replica to lead
    keys = queue.take(reconciler.keys(), clock())
    for key in keys:
        # One key's failure (a decision that raised, a write refused) must not stop the others
        # or the loop: it is taken again after its backoff.
        try:
            writes = reconciler.decide(key, clock())
            if writes is not None:
                await reconciler.write(key, writes)
        except Exception:
            log.exception("reconciling %r failed; retrying after a backoff", key)
            queue.failed(key, clock(), settings)
        else:
            queue.succeeded(key)
    return len(keys)


async def run(
    reconciler: Reconciler[K, W],
    queue: WorkQueue[K],
    settings: KernelSettings,
    stop: asyncio.Event,
    *,
    may_write: Callable[[], bool] = lambda: True,
    clock: Callable[[], float] = time.time,
) -> None:
    """Drain the queue until `stop`: on a mark (after the debounce), at a retry's due time,
    and every key at each resync."""
    queue._loop = asyncio.get_running_loop()
    queue.mark_all()  # a replica that starts to lead decides every key first
    last_resync = clock()
    while not stop.is_set():
        now = clock()
        wake = last_resync + settings.resync_seconds
        retry = queue.next_retry()
        if retry is not None:
            wake = min(wake, retry)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(queue.changed.wait(), max(0.0, wake - now))
        if stop.is_set():
            return
        if clock() - last_resync >= settings.resync_seconds:
            queue.mark_all()
            last_resync = clock()
        await asyncio.sleep(settings.debounce_seconds)
        await drain(reconciler, queue, settings, may_write=may_write, clock=clock)
