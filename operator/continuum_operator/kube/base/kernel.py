"""The controller kernel: a keyed work queue and the loop that drains it, in the shape of
controller-runtime's and Kueue's (docs/architecture.md, "Reconcilers").

A reconciler supplies every key it governs, a decision per key from the cache as it is now
(`decide`, no API calls) and the writes of a decision (`write`); the watches mark keys dirty.
The kernel does the rest, once for every reconciler on it: it waits for a mark or the resync
period, waits the debounce so a burst of events is one pass, decides only the keys marked
(every key at a resync: the safety net for a missed event), sends each key's writes only if
`may_write` says this replica still leads (asked at each key's write, not once a pass: a Lease
lost mid-pass stops the writes not sent yet; the process's API adapter asks it again at each
call, `AsyncKubeApi.writing_while`, so a key whose writes had begun sends none after), and takes
a key whose write failed again after a backoff that doubles from `retry_seconds` up to
`max_retry_seconds` (a conflict, the API server away) without holding up the others.

Keys are decided one at a time, in the reconciler's `order`, so a decision sees every decision
before it: a reconciler whose writes others must see records them in the cache as it decides
(the Engines' loop assumes its status patch, as kube-scheduler assumes a pod). Their writes go
out up to `writers` at a time (one per key: a key is decided once a pass) and the pass ends
when all have answered. A reconciler whose decisions change by the clock alone (a deadline, a
board going stale) gets a pass at least every `pass_seconds` and marks those keys in
`before_pass`.

Neighbours: `kube.state.cache` (the watches, which mark), `kube.engines.loop` (the Engines'
reconciler), `kube.lanes.loop` (the lanes'), `kube.grants.loop` (the grants', on the leader).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from continuum_operator.kube.client.async_api import NotLeading

__all__ = ["KernelSettings", "PassHooks", "Reconciler", "WorkQueue", "drain", "run"]

log = logging.getLogger("continuum.kernel")

K = TypeVar("K", bound=Hashable)
W = TypeVar("W")


@dataclass(frozen=True, slots=True)
class KernelSettings:
    resync_seconds: float = 60.0  # every key decided at least this often
    debounce_seconds: float = 0.2  # after the first mark, before the pass
    retry_seconds: float = 1.0  # a failed key's first wait; doubled per failure
    max_retry_seconds: float = 60.0
    pass_seconds: float | None = None  # a pass at least this often, marked or not
    writers: int = 1  # keys whose writes are in flight at once, within a pass


@dataclass
class WorkQueue(Generic[K]):
    """Dirty keys, a resync flag and the keys waiting out a retry; the loop takes them all at
    once. Touched only on the event loop (the watches, the writes' answers, the clock's
    wake-ups): no lock, and a mark sets `changed` directly."""

    changed: asyncio.Event = field(default_factory=asyncio.Event)
    _dirty: set[K] = field(default_factory=set)
    _all: bool = True  # the first pass decides every key
    _retry: dict[K, tuple[float, float]] = field(default_factory=dict)  # key -> (due, wait)
    resynced_at: float | None = None  # when a pass last decided every key

    def mark(self, *keys: K, wake: bool = True) -> None:
        """Decide `keys` at the next pass; `wake=False` leaves the pass to its time (the
        answer of one's own write: the key is decided again, with no pass of its own)."""
        if not keys:
            return
        self._dirty.update(keys)
        if wake:
            self.wake()

    def mark_all(self) -> None:
        self._all = True
        self.wake()

    def wake(self) -> None:
        """A pass soon, with no key marked: for a reconciler whose `before_pass` finds them."""
        self.changed.set()

    def take(self, every: Iterable[K], now: float) -> list[K]:
        """The keys to decide now, in order: the marked (every key after `mark_all`) and the
        retries that are due; the marks are cleared."""
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

    def before_pass(self, queue: WorkQueue[K], now: float) -> None:
        """Mark what changed by the clock alone, before the pass takes its keys."""
        ...

    def order(self, keys: list[K]) -> list[K]:
        """The order in which a pass decides its keys."""
        ...

    def decide(self, key: K, now: float) -> W | None:
        """What `key` needs, from the cache alone (None: it is gone, nothing to do)."""
        ...

    async def write(self, key: K, writes: W) -> None:
        """Apply a decision; raise to have the key taken again after a backoff."""
        ...

    def after_pass(self, now: float) -> None:
        """Once every write of the pass has answered."""
        ...


class PassHooks(Generic[K]):
    """The hooks of a reconciler that needs none: nothing marked by the clock, keys in the
    queue's order, nothing to do after a pass."""

    def before_pass(self, queue: WorkQueue[K], now: float) -> None:
        return None

    def order(self, keys: list[K]) -> list[K]:
        return keys

    def after_pass(self, now: float) -> None:
        return None


async def drain(
    reconciler: Reconciler[K, W],
    queue: WorkQueue[K],
    settings: KernelSettings,
    *,
    may_write: Callable[[], bool] = lambda: True,
    clock: Callable[[], float] = time.time,
) -> int:
    """One pass: decide and write every key due now, each write only while `may_write`
    (asked before each). Returns how many keys it decided."""
    if not may_write():
        return 0  # not leading: the marks wait for this replica to lead
    now = clock()
    if queue.resynced_at is None or now - queue.resynced_at >= settings.resync_seconds:
        queue.mark_all()  # the safety net for a missed event
        queue.resynced_at = now
    reconciler.before_pass(queue, now)
    keys = reconciler.order(queue.take(reconciler.keys(), clock()))
    room = asyncio.Semaphore(max(1, settings.writers))
    writing: set[asyncio.Task[None]] = set()

    def failed(key: K) -> None:
        log.exception("reconciling %r failed; retrying after a backoff", key)
        queue.failed(key, clock(), settings)

    async def write(key: K, writes: W) -> None:
        try:
            # Asked at each write, not once a pass: a Lease lost mid-pass stops the writes not
            # yet sent (another replica may lead now); the key waits, marked, for a leader.
            if not may_write():
                queue.mark(key, wake=False)
                return
            await reconciler.write(key, writes)
        except NotLeading:
            queue.mark(key, wake=False)  # the Lease was lost between two of the key's writes
        except Exception:
            failed(key)
        else:
            queue.succeeded(key)
        finally:
            room.release()

    # One key's failure (a decision that raised, a write refused) must not stop the others or
    # the loop: it is taken again after its backoff.
    for key in keys:
        try:
            writes = reconciler.decide(key, clock())
        except Exception:
            failed(key)
            continue
        if writes is None:
            queue.succeeded(key)
            continue
        await room.acquire()
        task = asyncio.create_task(write(key, writes))
        writing.add(task)
        task.add_done_callback(writing.discard)
    if writing:
        await asyncio.gather(*writing)
    reconciler.after_pass(clock())
    return len(keys)


async def _first(*events: asyncio.Event) -> None:
    """Until one of `events` is set (a mark, or the stop: a shutdown does not wait out the
    resync)."""
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()


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
    at least every `pass_seconds`, and every key at each resync."""
    queue.resynced_at = None  # a replica that starts to lead decides every key first
    queue.mark_all()
    last_pass = clock()
    while not stop.is_set():
        now = clock()
        wake = (queue.resynced_at or now) + settings.resync_seconds
        if settings.pass_seconds is not None:
            wake = min(wake, last_pass + settings.pass_seconds)
        retry = queue.next_retry()
        if retry is not None:
            wake = min(wake, retry)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_first(queue.changed, stop), max(0.0, wake - now))
        if stop.is_set():
            return
        await asyncio.sleep(settings.debounce_seconds)
        last_pass = clock()
        await drain(reconciler, queue, settings, may_write=may_write, clock=clock)
