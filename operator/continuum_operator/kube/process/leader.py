"""Leader election with a coordination.k8s.io Lease: one replica writes, the others stand by.

docs/design.md: only the operator's leader writes the grant ledger, and the leader is chosen with a
Lease (kopf's peering freezes operators of equal priority, so it is not used). The protocol is
client-go's: the holder renews `renewTime` every `renew_seconds`; a candidate takes the Lease
when its holder is empty or `leaseDurationSeconds` have passed since this process last saw the
record change, by a replace conditioned on resourceVersion, so of two candidates exactly one
wins. A leader that cannot renew within its duration stops writing at once (`is_leader` turns
False at its own deadline, before any standby may take over) and the process exits so that a
fresh start stands by.

Expiry is measured on this process's monotonic clock, from when it saw the change (client-go's
`observedTime`), never by comparing the holder's `renewTime` with our wall clock: two clocks a
few seconds apart would otherwise let a standby take a Lease its holder still counts as held,
and both would lead. The holder's deadline and the standby's are both counted on their own
clocks from the same write (the holder's from before it sent it, the standby's from after it
read it), so the holder always stops first. The cost: a standby that first sees a Lease waits a
full duration, even when the holder died long before. `renewTime` is written for people only.

The Lease's calls are blocking (`kube.client.api.KubeApi`), from a thread of its own, while the
loops' are awaited on the event loop (`kube.client.async_api`): a renewal must not wait for the
loop, which runs each pass's decisions without a pause (a full pass of the Engines' loop at 2,000
engines took 3.7 s of CPU, docs/performance.md; more on a starved machine), and kopf's watches
beside.

Neighbours: `kube.process.run` (starts the work under `lead`), `kube.client.api` (the adapter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor

from continuum_operator.core import rfc3339
from continuum_operator.kube.base import crash
from continuum_operator.kube.base.grant_settings import LeaderSettings
from continuum_operator.kube.client.api import ApiError, KubeApi
from continuum_operator.model.json_body import integer, object_at

__all__ = ["Elector", "lead"]

log = logging.getLogger("continuum.leader")


# A Lease's acquireTime and renewTime are MicroTime: RFC 3339 with microseconds.
_micro = rfc3339.format_micro
_parse = rfc3339.parse


#: Test-only: seconds added to the wall clock this process writes into the Lease, to show that
#: a skewed clock cannot make two replicas lead (tests/e2e/test_boundaries.py). Unset in a cluster.
WALL_CLOCK_OFFSET_ENV = "CONTINUUM_TEST_WALL_CLOCK_OFFSET_SECONDS"


def wall_clock() -> float:
    return time.time() + float(os.environ.get(WALL_CLOCK_OFFSET_ENV) or 0.0)


class Elector:
    def __init__(
        self,
        api: KubeApi,
        settings: LeaderSettings,
        identity: str | None = None,
        clock: Callable[[], float] = wall_clock,
        on_change: Callable[[bool], None] = lambda leading: None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.on_change = on_change
        self.settings = settings
        self.identity = identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.clock = clock  # wall time, only for the times written into the Lease
        self.monotonic = monotonic  # every deadline: ours and the holder's as we saw it
        # Our own deadline (monotonic, of arbitrary origin): last renewal + duration - margin.
        self.valid_until = -math.inf
        # The record as last read, and when (monotonic) this process saw it change.
        self.observed: tuple[str, str] | None = None
        self.observed_at = 0.0

    @property
    def path(self) -> str:
        s = self.settings
        return f"/apis/coordination.k8s.io/v1/namespaces/{s.namespace}/leases/{s.name}"

    def is_leader(self) -> bool:
        return not self.settings.enabled or self.monotonic() < self.valid_until

    def _spec(self, now: float, acquired: float | None, transitions: int) -> dict[str, object]:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self.settings.duration_seconds)),
            "acquireTime": _micro(acquired if acquired is not None else now),
            "renewTime": _micro(now),
            "leaseTransitions": transitions,
        }

    def try_acquire_or_renew(self) -> bool:
        """One round (blocking): True if this replica holds the Lease afterwards."""
        try:
            return self._round()
        except OSError as err:
            # The API server unreachable (restarting, a network cut) is a round without a
            # renewal, not a crash: the leader writes on until its own deadline (`is_leader`)
            # and steps down only if the outage outlasts it.
            log.warning("the leader Lease cannot be reached: %s", err)
            return False

    def _round(self) -> bool:
        now, started = self.clock(), self.monotonic()
        try:
            lease = self.api.request("GET", self.path)
        except ApiError as err:
            if err.status != 404:
                log.warning("reading the leader Lease failed: %s", err)
                return False
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.settings.name, "namespace": self.settings.namespace},
                "spec": self._spec(now, None, 0),
            }
            try:
                self.api.request(
                    "POST",
                    self.path.rsplit("/", 1)[0],
                    body,
                )
            except ApiError as err2:
                log.info("another replica made the leader Lease first: %s", err2)
                return False
            self._held(started)
            return True
        spec = object_at(lease, "spec")
        holder = str(spec.get("holderIdentity") or "")
        record = (str(object_at(lease, "metadata").get("resourceVersion", "")), repr(spec))
        if record != self.observed:
            # Any write is the holder's word that it still holds: counted from now, on our clock.
            self.observed, self.observed_at = record, self.monotonic()
        duration = float(integer(spec, "leaseDurationSeconds") or self.settings.duration_seconds)
        mine = holder == self.identity
        if not mine and holder and self.monotonic() < self.observed_at + duration:
            return False  # held, and renewed within its duration as we saw it: stand by
        transitions = (integer(spec, "leaseTransitions") or 0) + (0 if mine else 1)
        acquired = _parse(spec.get("acquireTime")) if mine else None
        try:
            renewed = {**lease, "spec": self._spec(now, acquired, transitions)}
            self.api.request("PUT", self.path, renewed)  # carries metadata.resourceVersion
        except ApiError as err:
            if err.status != 409:
                log.warning("writing the leader Lease failed: %s", err)
            return False
        if not mine:
            log.info("took the leader Lease %s (was %r)", self.settings.name, holder)
        self._held(started)
        return True

    def _held(self, renewed: float) -> None:
        """Renewed by a write sent at `renewed` (monotonic): others count from after it landed."""
        self.on_change(True)
        # Stop writing a little before anyone else may take over.
        self.valid_until = renewed + self.settings.duration_seconds - self.settings.margin_seconds

    def release(self) -> None:
        """On a clean stop: hand the Lease over at once (an empty holder)."""
        if not self.settings.enabled or not self.is_leader():
            return
        try:
            lease = self.api.request("GET", self.path)
            spec = object_at(lease, "spec")
            if spec.get("holderIdentity") != self.identity:
                return
            self.api.request("PUT", self.path, {**lease, "spec": {**spec, "holderIdentity": ""}})
        except (ApiError, OSError) as err:
            log.warning("releasing the leader Lease failed: %s", err)
        self.valid_until = -math.inf
        self.on_change(False)


async def lead(
    elector: Elector,
    stop: asyncio.Event,
    work: list[Callable[[asyncio.Event], Coroutine[object, None, None]]],
) -> int:
    """Stand by until this replica leads, then run `work` until `stop` or the Lease is lost.

    Returns 0 on a clean stop, 1 when leadership was lost (the caller exits: a replica that
    lost the Lease never writes again in this process).
    """
    # The Lease's calls have a thread of their own: on the event loop a renewal would wait for
    # whatever runs there (a full pass decides every engine without a pause), and one late by
    # more than the Lease's duration hands the lead to another replica mid-write.
    renewals = ThreadPoolExecutor(1, thread_name_prefix="leader-lease")
    try:
        return await _lead(elector, stop, work, renewals)
    finally:
        renewals.shutdown(wait=False)


async def _lead(
    elector: Elector,
    stop: asyncio.Event,
    work: list[Callable[[asyncio.Event], Coroutine[object, None, None]]],
    renewals: ThreadPoolExecutor,
) -> int:
    s = elector.settings
    loop = asyncio.get_running_loop()
    if s.enabled:
        while not stop.is_set():
            if await loop.run_in_executor(renewals, elector.try_acquire_or_renew):
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), s.renew_seconds)
        if stop.is_set():
            return 0
        log.info("leading as %s", elector.identity)
        crash.reached(crash.CrashPoint.LEADER_ACQUIRED)
    else:
        # The same line with or without an election: it is how a user sees that the operator's
        # loops run (the chart's NOTES.txt, docs/install.md).
        log.info("leading as %s (no leader election: this replica always leads)", elector.identity)
    working = asyncio.Event()
    tasks = [asyncio.create_task(w(working)) for w in work]
    lost = False
    try:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), s.renew_seconds)
            if stop.is_set() or not s.enabled:
                continue
            renewed = await loop.run_in_executor(renewals, elector.try_acquire_or_renew)
            if not renewed and not elector.is_leader():
                log.error("lost the leader Lease %s: stopping", s.name)
                lost = True
                break
    finally:
        working.set()
        ended = await asyncio.gather(*tasks, return_exceptions=True)
        cut = [_name(w) for w, e in zip(work, ended, strict=True) if _cancelled(e)]
        if cut:
            # A loop stops at `working`, between passes; one cancelled was cut mid-pass (kopf
            # cancels the tasks it still waits for 5 s into its shutdown: kube.process.run).
            log.warning("stopping: %s cancelled, not stopped between passes", ", ".join(cut))
        if not lost:
            await loop.run_in_executor(renewals, elector.release)
    return 1 if lost else 0


def _cancelled(ended: object) -> bool:
    return isinstance(ended, asyncio.CancelledError)


def _name(work: Callable[..., object]) -> str:
    return str(getattr(work, "__qualname__", work))
