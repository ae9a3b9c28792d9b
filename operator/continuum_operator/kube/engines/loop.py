"""The Engines' reconciler, on the controller kernel (`kube.base.kernel`): every engine, one at a
time, from the cache to the API.

Watch events (`kube.state.handlers`) only feed the cache, which marks the engines they can change in
its `engine_queue`; the kernel decides each marked engine against a fresh snapshot
(`kube.engines.reconcile`, no API calls), then applies the writes: one status patch when something
changed, the Deployment and Service when their launch changed, and the events. Engines are
decided one after another, so two engines never lease the same bytes: each decision's status
patch is assumed in the cache before the next engine is decided, while the writes go out
`loop.engine_writers` at a time (its kernel settings: `OperatorSettings.kernels.engines`).

A pass decides only the engines that may decide differently: those whose inputs changed (their
Engine, Deployment, Job or Service, or a board, Lease, Node, engine or lane on their node; the
engines not placed yet when any node's room changed), those whose board went stale or fresh by
the clock alone, and every engine that is not quiet (`_quiet`: its last pass wrote something,
or a deadline may still fire; an engine that fits nowhere is quiet, as every change of a
node's room marks it), at least every `loop.resync_seconds`. Every
`full_resync_seconds` a pass decides every engine, as a safety net.
Neighbours: `kube.client.async_api` (the adapter), `kube.state.cache`, `kube.engines.reconcile`,
`kube.engines.facts_read`.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from continuum_operator.core.conditions import ConditionType
from continuum_operator.core.damping import Outcome
from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.base import events, kernel
from continuum_operator.kube.base.kernel import KernelSettings, WorkQueue
from continuum_operator.kube.base.metrics import OperatorMetrics
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.api import ApiError, crd_path, path_of
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.engines.engine_pass import Event, Memory, Writes
from continuum_operator.kube.engines.facts_read import read_job_facts, read_job_failure
from continuum_operator.kube.engines.pool_metrics import PoolMetrics
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.ledger import grant_ledger
from continuum_operator.kube.state.cache import Cache, EngineKey, JobEntry
from continuum_operator.kube.state.occupancy import is_fresh, lease_is_fresh
from continuum_operator.kube.workloads import engine_objects
from continuum_operator.kube.workloads.priority_classes import priority_classes
from continuum_operator.model.base import API_VERSION
from continuum_operator.model.json_body import at, text

log = logging.getLogger("continuum.operator")

# The longest a relaunch's Deployment waits for the old engine's grants to drain: well past the
# grace deadline (30 s by default) that ends every drain.
DRAIN_HOLD_SECONDS = 180.0
# What damping said of an engine that nothing but a new board reading can change.
_SETTLED = (None, Outcome.UNCHANGED, Outcome.GAIN_TOO_SMALL)


@dataclass(frozen=True, slots=True)
class FactsToRead:
    """An engine's decision waits for what its facts Job found: read it first (the read's
    answer marks the engine, decided then with the facts or the Job's error)."""

    job: JobEntry


EngineWrites = Writes | FactsToRead


class Loop:
    def __init__(
        self,
        api: AsyncKubeApi,
        settings: OperatorSettings,
        cache: Cache,
        clock: Callable[[], float] = time.time,
        metrics: OperatorMetrics | None = None,
        may_write: Callable[[], bool] = lambda: True,
    ) -> None:
        self.api = api
        self.may_write = may_write  # asked by the kernel before each engine's writes
        self.settings = settings
        self.cache = cache
        self.clock = clock  # the cache's too (`kube.process.run` gives both the one clock)
        self.metrics = metrics or OperatorMetrics()
        self.pools = PoolMetrics(self.metrics.registry)
        self.memory: dict[str, Memory] = {}
        self.services: dict[EngineKey, str] = {}
        self.drain_held: dict[EngineKey, float] = {}  # since when a relaunch waits for a drain
        self.recorded: set[EngineKey] = set()  # engines with metric series
        # Engines skipped until their inputs change (`_quiet`), what each last said of its
        # schedulability, each board's freshness at the last pass, and the last full pass.
        self.quiet: set[EngineKey] = set()
        self.unschedulable: dict[EngineKey, bool] = {}
        self.fresh: dict[str, bool] = {}
        self.facts_unread: set[EngineKey] = set()  # whose facts Job's answer could not be read
        self.instance = socket.gethostname()
        self.queue: WorkQueue[EngineKey] = cache.engine_queue
        self.kernel: KernelSettings = settings.kernels.engines

    async def install_priority_classes(self) -> None:
        for pc in priority_classes(self.settings.pods):
            await self.api.apply(pc)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.install_priority_classes()
                break
            except (ApiError, OSError) as err:
                log.warning("installing the priority classes failed, retrying: %s", err)
                await asyncio.sleep(2)
        await kernel.run(
            self.reconciler(), self.queue, self.kernel, stop,
            may_write=self.may_write, clock=self.clock,
        )  # fmt: skip

    async def pass_once(self) -> None:
        """One pass of the kernel over the engines marked now."""
        await kernel.drain(
            self.reconciler(), self.queue, self.kernel, may_write=self.may_write, clock=self.clock
        )

    def reconciler(self) -> kernel.Reconciler[EngineKey, EngineWrites]:
        return self

    def keys(self) -> list[EngineKey]:
        return list(self.cache.engines)

    def order(self, keys: list[EngineKey]) -> list[EngineKey]:
        return self._order(set(keys))

    def _order(self, only: set[EngineKey] | None = None) -> list[EngineKey]:
        """Placed engines first, then the oldest; with `only`, those engines alone."""

        def key(item: tuple[EngineKey, Mapping[str, object]]) -> tuple[int, str, EngineKey]:
            body = item[1]
            placed = bool(at(body, "status", "placement"))
            created = text(body, "metadata", "creationTimestamp") or ""
            return (0 if placed else 1, created, item[0])

        engines = self.cache.engines
        items = (
            list(engines.items())
            if only is None
            else [(k, b) for k in only if (b := engines.get(k)) is not None]
        )
        return [k for k, _ in sorted(items, key=key)]

    def before_pass(self, queue: WorkQueue[EngineKey], now: float) -> None:
        """Mark what changed by the clock alone: the engines on a board that went stale (or
        fresh) with no event, and every engine not quiet (a deadline may fire)."""
        leases = dict(self.cache.leases)
        nodes = set(self.cache.boards) | set(leases) | set(self.fresh)
        ttl = self.settings.freshness.default_ttl_seconds
        turned = []
        fresh: dict[str, bool] = {}
        for node in nodes:
            fresh[node] = lease_is_fresh(leases.get(node), now, ttl)
            if self.fresh.get(node) != fresh[node]:
                turned.append(node)
        self.fresh = fresh
        self.cache.mark_nodes(turned, wake=False)
        self.cache.mark_unplaced()
        queue.mark(*(set(self.cache.engines) - self.quiet), wake=False)

    def _quiet(self, key: EngineKey, writes: Writes) -> bool:
        """Whether the engine's next pass would decide the same unless its inputs change: this
        one wrote nothing, its pod is ready on its own plan (or it fits nowhere), and no
        deadline is pending (pod
        start timeout, node-gone hold, relaunch cooldown or evidence, drain hold, facts Job)."""
        if writes.status_patch is not None or writes.events:
            return False
        if writes.facts_job is not None or writes.damping not in _SETTLED:
            return False
        if writes.memory.node_gone_since is not None or key in self.drain_held:
            return False
        body = self.cache.engines.get(key)
        if body is None:
            return False
        status = body.get("status") or {}
        generation = body["metadata"].get("generation")
        if (status.get("plan") or {}).get("specGeneration") not in (None, generation):
            return False  # a spec change held for a fresh board
        ready = any(
            c.get("type") == ConditionType.READY and c.get("status") == "True"
            for c in status.get("conditions") or []
        )
        # An engine that fits nowhere decides again only when a node's room changes, and every
        # such change marks the engines not placed (`Cache.mark_unplaced`): thousands that fit
        # nowhere cost nothing a pass.
        if not ready and not writes.unschedulable:
            return False
        if self._launch_pending(key, writes) or self._service_pending(key, writes):
            return False
        return not (writes.delete_workload and key in self.cache.deployments)

    def _service_pending(self, key: EngineKey, writes: Writes) -> bool:
        """The Service and identity this decision wants are not written as wanted yet."""
        return writes.service is not None and (
            self.services.get(key) != _service_digest(writes) or key not in self.cache.services
        )

    def _launch_pending(self, key: EngineKey, writes: Writes) -> bool:
        """The Deployment this decision wants is not the one running (or there is none)."""
        if writes.deployment is None:
            return False
        desired = writes.deployment["metadata"]["annotations"][engine_objects.LAUNCH_ANNOTATION]
        current = self.cache.deployments.get(key)
        return current is None or current.launch != desired

    def record(self, key: EngineKey, writes: Writes) -> None:
        m = self.metrics
        for event in writes.events:
            if event.reason == "Relaunching":
                m.record_relaunch(*key)
            elif event.reason == "Placed":
                m.record_placement()
            elif event.reason == "PodNeverStarted":
                m.record_pod_start_timeout()
        if writes.damping is not None:
            m.record_weighed(writes.damping)
        m.set_memory_mode_unknown(key[0], key[1], writes.memory_mode_unknown)
        self.recorded.add(key)

    def record_boards(self) -> None:
        """Each board's freshness (its agent's Lease), as the placement sees it now, and its
        pools' figures against the leases just written."""
        snap = self.cache.snapshot()
        now, ttl = self.clock(), self.settings.freshness.default_ttl_seconds
        self.metrics.set_boards_fresh({n: is_fresh(snap, n, now, ttl) for n in snap.boards})
        self.pools.record(snap)

    def decide(self, key: EngineKey, now: float) -> EngineWrites | None:
        """The engine's writes from the cache (its facts Job's answer first, when it has one
        not read yet); its status patch is assumed in the cache at once, so the next engine is
        decided against the bytes this one leases while the patch is in flight."""
        self.quiet.discard(key)
        body = self.cache.engines.get(key)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.unschedulable.pop(key, None)
            return None
        uid = str(body["metadata"].get("uid", ""))
        memory = self.memory.get(uid, Memory())
        job = self.cache.jobs.get(key)
        if job is not None and job.succeeded and not _has_facts(body, job.source):
            # A read that failed is tried again after one decision that says why.
            if key not in self.facts_unread:
                return FactsToRead(job)
            self.facts_unread.discard(key)
        elif job is not None and job.failed and memory.facts_error is None:
            return FactsToRead(job)
        # The cache's own maps: `reconcile` is pure and awaits nothing.
        writes = reconcile(body, self.cache.view(), memory, now, self.settings)
        self.memory[uid] = writes.memory
        self.record(key, writes)
        self.unschedulable[key] = writes.unschedulable
        if writes.status_patch is not None:
            # A failed patch drops it (`_write_status`).
            self.cache.assume_status(key, writes.status_patch)
        if self._quiet(key, writes):
            self.quiet.add(key)
        current = self.cache.engines.get(key) or body
        self.metrics.set_plan(*key, (current.get("status") or {}).get("plan"))
        self.metrics.set_estimate_error(*key, current.get("status"))
        self.metrics.record_runtime_restarts(*key, current.get("status"))
        return writes

    async def write(self, key: EngineKey, writes: EngineWrites) -> None:
        """One engine's writes: its status patch, then (once it landed) its workload's."""
        if isinstance(writes, FactsToRead):
            await self._read_facts(key, writes.job)
            return
        body = self.cache.engines.get(key)
        try:
            written, engine = await self.apply_status(key, writes)
        except BaseException:
            # Not an API answer (the connection broke): the patch is not assumed past it.
            if writes.status_patch is not None:
                self.cache.settle_status(key, None)
            raise
        if writes.status_patch is not None:
            self.cache.settle_status(key, engine if written else None)
        if not written or body is None:
            return
        deployment, served = await self.apply_workload(key, body, writes)
        if served:
            self.cache.services.add(key)
        if deployment is not None:
            self.cache.observe_deployment(deployment, deleted=False, nudge=False)

    async def _read_facts(self, key: EngineKey, job: JobEntry) -> None:
        body = self.cache.engines.get(key)
        if body is None:
            return
        uid = str(body["metadata"].get("uid", ""))
        if job.succeeded:
            read, error = await read_job_facts(self.api, key, job, self.clock())
            if read is not None:
                self.cache.observe_engine(read, deleted=False)
            else:
                self.facts_unread.add(key)
        else:
            error = await read_job_failure(self.api, key, job)
        self.memory[uid] = replace(self.memory.get(uid, Memory()), facts_error=error)
        self.queue.mark(key)

    def after_pass(self, now: float) -> None:
        """What the pass leaves: the gauges, and nothing kept of engines gone."""
        live_keys = set(self.cache.engines)
        for gone in set(self.unschedulable) - live_keys:
            del self.unschedulable[gone]
        self.quiet &= live_keys
        self.facts_unread &= live_keys
        self.metrics.unschedulable.set(sum(self.unschedulable.values()))
        self.record_boards()
        live = {str(b["metadata"].get("uid", "")) for b in self.cache.engines.values()}
        for uid in set(self.memory) - live:
            del self.memory[uid]
        for key in self.recorded - set(self.cache.engines):
            self.metrics.forget(*key)
            self.services.pop(key, None)
        self.recorded &= set(self.cache.engines)

    async def apply_status(
        self, key: EngineKey, writes: Writes
    ) -> tuple[bool, dict[str, Any] | None]:
        """The status patch, if any. Returns whether the workload's writes may follow (not
        after a failed status write), and the engine as written."""
        ns, name = key
        if writes.status_patch is None:
            return True, None
        try:
            path = crd_path("engines", ns, name, "status")
            return True, await self.api.merge_patch(path, writes.status_patch)
        except ApiError as err:
            if err.status != 404:  # 404: the engine was deleted meanwhile
                log.warning("writing Engine %s/%s failed: %s", ns, name, err)
            return False, None

    async def apply_workload(
        self, key: EngineKey, body: dict[str, Any], writes: Writes
    ) -> tuple[dict[str, Any] | None, bool]:
        """The workload's writes and the events. Returns the Deployment as written and whether
        the Service was applied. On the event loop, as the cache it reads (the Deployment and
        facts Job known) is: between two of its writes the watches may have changed it."""
        ns, name = key
        deployment = None
        served = False
        try:
            if writes.service is not None and self._service_pending(key, writes):
                # Before the Deployment: its pods are refused until their ServiceAccount exists.
                for obj in (*writes.identity, writes.service):
                    await self.api.apply(obj)
                self.services[key] = _service_digest(writes)
                served = True
            if writes.deployment is not None and self._launch_pending(key, writes):
                if key in self.cache.deployments and self.held_for_drain(key, body):
                    pass  # a pass after the drain applies it
                else:
                    self.drain_held.pop(key, None)
                    deployment = await self.api.apply(writes.deployment)
            if writes.facts_job is not None:
                known = self.cache.jobs.get(key)
                if known is None or known.name != writes.facts_job["metadata"]["name"]:
                    try:
                        await self.api.create(writes.facts_job)
                    except ApiError as err:
                        if err.status != 409:  # 409: created by an earlier pass
                            raise
            if writes.delete_workload and key in self.cache.deployments:
                await self.api.delete(path_of({**_stub("apps/v1", "Deployment", ns, name)}))
                await self.api.delete(path_of({**_stub("v1", "Service", ns, name)}))
                self.services.pop(key, None)
            for event in writes.events:
                await self.post_event(body, event)
        except ApiError as err:
            if err.status != 404:  # 404: the engine was deleted meanwhile
                log.warning("writing Engine %s/%s failed: %s", ns, name, err)
        return deployment, served

    def held_for_drain(self, key: EngineKey, body: dict[str, Any]) -> bool:
        """Whether a relaunch's Deployment must wait: the running engine still holds grants of
        its own launch (Recreate would stop its pod before the gateway reports their release).
        The grants loop ends every drain by the grace deadline; past DRAIN_HOLD_SECONDS the
        Deployment goes out anyway, so a stuck ledger never pins an engine to its old plan."""
        engine = self.cache.engines.get(key) or body  # with this pass's status patch
        if not grant_ledger.holds_another_launch(engine.get("status") or {}):
            return False
        now = self.clock()
        if key not in self.drain_held:
            self.drain_held[key] = now
            log.info("Engine %s/%s: relaunch waits for the drain of its grants", *key)
        if now - self.drain_held[key] < DRAIN_HOLD_SECONDS:
            return True
        log.warning("Engine %s/%s: drain not over after %d s; relaunching", *key,
                    DRAIN_HOLD_SECONDS)  # fmt: skip
        return False

    async def post_event(self, body: dict[str, Any], event: Event) -> None:
        meta = body["metadata"]
        log.info(
            "Engine %s/%s: %s: %s", meta["namespace"], meta["name"], event.reason, event.message
        )
        await events.post(
            self.api,
            events.reference(API_VERSION, "Engine", meta),
            event,
            instance=self.instance,
            now=format_seconds(self.clock()),
            log=log,
        )


def _service_digest(writes: Writes) -> str:
    """What the Service and identity of a decision were written as (rewritten when it changes)."""
    return repr((writes.service, writes.identity))


def _has_facts(body: Mapping[str, object], source: str) -> bool:
    return bool(source) and text(body, "status", "modelFacts", "source") == source


def _stub(api_version: str, kind: str, ns: str, name: str) -> dict[str, Any]:
    return {"apiVersion": api_version, "kind": kind, "metadata": {"name": name, "namespace": ns}}
