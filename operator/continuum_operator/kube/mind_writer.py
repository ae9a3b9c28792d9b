"""The Minds' writes (projections, finalizers) off the grants loop: worker threads, projections
first, one Mind's writes in order. Neighbours: `kube.minds` (submits them)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable

__all__ = ["FINALIZER_WRITE", "PROJECTION_WRITE", "MindWriter"]

log = logging.getLogger("continuum.grants")

# Write priorities: a grant is seen before its finalizer lands.
PROJECTION_WRITE, FINALIZER_WRITE = 0, 1


class MindWriter:
    """Writes of Minds (projections, finalizers), by `workers` daemon threads, projections
    first. One Mind's writes run one at a time, in order; a write of a Mind not yet started is
    replaced by a newer one of the same kind (it carries the newer ledger)."""

    def __init__(
        self,
        workers: int,
        may_write: Callable[[], bool],
        failed: Callable[[str], None] = lambda key: None,
    ) -> None:
        self.may_write = may_write
        self.failed = failed  # told the key of a write that raised: the next pass redoes it
        self.queue: queue.PriorityQueue[tuple[int, int, str]] = queue.PriorityQueue()
        self.pending: dict[tuple[int, str], Callable[[], None]] = {}
        self.lock = threading.Lock()
        self.key_locks: dict[str, threading.Lock] = {}
        self.seq = itertools.count()
        for i in range(workers):
            threading.Thread(target=self._work, name=f"mind-writer-{i}", daemon=True).start()

    def submit(self, priority: int, key: str, job: Callable[[], None]) -> None:
        with self.lock:
            queued = (priority, key) in self.pending
            self.pending[(priority, key)] = job
        if not queued:
            self.queue.put((priority, next(self.seq), key))

    def _work(self) -> None:
        while True:
            priority, _, key = self.queue.get()
            with self.lock:
                job = self.pending.pop((priority, key), None)
                key_lock = self.key_locks.setdefault(key, threading.Lock())
            if job is None or not self.may_write():
                continue
            with key_lock:
                try:
                    job()
                except Exception:  # one failed write must not stop the writer; a pass redoes it
                    log.exception("writing Mind %s failed", key)
                    self.failed(key)
