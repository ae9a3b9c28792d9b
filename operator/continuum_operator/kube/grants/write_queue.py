"""The Minds' writes (projections, finalizers) and the TokenQuotas' status, off the grants
loop's pass: asyncio tasks, at most `workers` at once, projections first, one Mind's writes in
order. Neighbours: `kube.grants.loop` (submits them), `kube.grants.mind_writes` (the writes).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections.abc import Awaitable, Callable

from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import NotLeading

__all__ = ["FINALIZER_WRITE", "PROJECTION_WRITE", "MindWriter", "Write"]

log = logging.getLogger("continuum.grants")

# Write priorities: a grant is seen before its finalizer lands.
PROJECTION_WRITE, FINALIZER_WRITE = 0, 1

#: One write: a coroutine function (its API calls awaited, `kube.client.async_api`).
Write = Callable[[], Awaitable[None]]


class MindWriter:
    """Writes of Minds (projections, finalizers) and TokenQuotas' status, as asyncio tasks of
    the event loop that submits them, at most `workers` in flight, projections first. The
    writes of one key (a Mind) run one at a time, in order: a later one waits for the one in
    flight. A write of a key not yet started is replaced by a newer one of the same kind (it
    carries the newer ledger). A write that raises is told to `failed` (the loop takes its
    engine again after a backoff)."""

    def __init__(
        self,
        workers: int,
        may_write: Callable[[], bool],
        failed: Callable[[str], None] = lambda key: None,
    ) -> None:
        self.workers = max(1, workers)
        self.may_write = may_write
        self.failed = failed
        self.pending: dict[tuple[int, str], Write] = {}
        self.heap: list[tuple[int, int, str]] = []  # (priority, submitted, key)
        self.busy: set[str] = set()  # keys with a write in flight
        self.tasks: set[asyncio.Task[None]] = set()
        self.seq = itertools.count()

    def submit(self, priority: int, key: str, write: Write) -> None:
        """Queue a write (from the event loop); it starts as soon as there is room."""
        if (priority, key) not in self.pending:
            heapq.heappush(self.heap, (priority, next(self.seq), key))
        self.pending[(priority, key)] = write
        self._pump()

    def _pump(self) -> None:
        """Start the first writes whose key has none in flight, while there is room."""
        waiting: list[tuple[int, int, str]] = []
        while self.heap and len(self.tasks) < self.workers:
            item = heapq.heappop(self.heap)
            priority, _, key = item
            if key in self.busy:
                waiting.append(item)  # after the one in flight
                continue
            write = self.pending.pop((priority, key), None)
            if write is None or not self.may_write():
                continue
            self.busy.add(key)
            task = asyncio.get_running_loop().create_task(self._run(key, write))
            self.tasks.add(task)
            task.add_done_callback(self._done(key))
        for item in waiting:
            heapq.heappush(self.heap, item)

    def _done(self, key: str) -> Callable[[asyncio.Task[None]], None]:
        def done(task: asyncio.Task[None]) -> None:
            self.tasks.discard(task)
            self.busy.discard(key)
            if not task.cancelled():
                self._pump()

        return done

    async def _run(self, key: str, write: Write) -> None:
        try:
            await write()
        except NotLeading:
            log.info("writing %s: not sent, this replica no longer leads", key)
        except Exception as err:  # one failed write must not stop the others; it is redone
            if isinstance(err, ApiError):
                log.warning("writing %s failed: %s", key, err)
            else:
                log.exception("writing %s failed", key)
            self.failed(key)

    async def drained(self) -> None:
        """Until every write queued has run (or been dropped: not leading)."""
        while self.tasks or (self.heap and self.may_write()):
            if self.tasks:
                await asyncio.gather(*list(self.tasks), return_exceptions=True)
            else:
                self._pump()
        self.heap.clear()
        self.pending.clear()

    def drop(self) -> None:
        """Forget the writes not started (a leader stepping down)."""
        self.heap.clear()
        self.pending.clear()
