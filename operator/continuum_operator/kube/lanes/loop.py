"""The lanes' reconciler on the controller kernel: which lanes it governs, their pass
(`kube.lanes.lane_pass`), and its writes (the lane's identity, NetworkPolicy and Deployment, then
its status and events)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Mapping

from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.base import events, kernel
from continuum_operator.kube.base.kernel import KernelSettings, PassHooks
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.api import ApiError, crd_path
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.lanes.lane_pass import LaneWrites, is_deleting, reconcile_lane
from continuum_operator.kube.state import lane_index
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.state.occupancy import LaneKey
from continuum_operator.kube.workloads import lane_objects
from continuum_operator.model.base import API_VERSION
from continuum_operator.model.json_body import object_at

log = logging.getLogger("continuum.operator.embedlanes")


class LaneLoop(PassHooks[LaneKey]):
    """The lanes' reconciler, on `kube.base.kernel`: a lane is decided when it, the Engine it
    follows or the room on its node changed (`kube.state.cache` marks it), and every lane at each
    full resync. Its writes: the lane's identity, NetworkPolicy and Deployment, then its status."""

    def __init__(
        self,
        api: AsyncKubeApi,
        settings: OperatorSettings,
        cache: Cache,
        clock: Callable[[], float],
        engine_labels: Mapping[str, str] | None = None,
        may_write: Callable[[], bool] = lambda: True,
    ) -> None:
        self.api, self.settings, self.cache, self.clock = api, settings, cache, clock
        self.may_write = may_write  # asked by the kernel before each lane's writes
        self.engine_labels = engine_labels  # `--engine-selector`: which lanes are this one's
        self.applied: dict[LaneKey, str] = {}  # what was last applied of each lane's pod
        self.absent: set[LaneKey] = set()  # lanes whose Deployment this process deleted

    @property
    def kernel(self) -> KernelSettings:
        return self.settings.kernels.lanes

    async def run(self, stop: asyncio.Event) -> None:
        await kernel.run(
            self, self.cache.lane_queue, self.kernel, stop,
            may_write=self.may_write, clock=self.clock,
        )  # fmt: skip

    async def pass_once(self) -> int:
        """One pass of the kernel over the lanes marked now."""
        return await kernel.drain(
            self, self.cache.lane_queue, self.kernel, may_write=self.may_write, clock=self.clock
        )

    def keys(self) -> list[LaneKey]:
        return [k for k, b in list(self.cache.lanes.items()) if self._takes(b)]

    def _takes(self, body: Mapping[str, object]) -> bool:
        return not is_deleting(body) and lane_index.decided_here(
            body, self.cache.engines, self.cache.ledgers, self.engine_labels
        )

    def decide(self, key: LaneKey, now: float) -> LaneWrites | None:
        body = self.cache.lanes.get(key)
        if body is None or not self._takes(body):
            return None
        return reconcile_lane(body, self.cache.snapshot(), now, self.settings)

    async def write(self, key: LaneKey, writes: LaneWrites) -> None:
        """The pod's objects, then one status patch; a failure (but the lane's being gone) has
        the kernel take the lane again."""
        applied = await self.apply_workload(key, writes)
        if writes.status_patch is not None:
            ns, name = key
            try:
                answer = await self.api.merge_patch(
                    crd_path("embedlanes", ns, name, "status"), writes.status_patch
                )
            except ApiError as err:
                if err.status == 404:
                    return
                raise
            # Recorded at once, so the next decision (lane or engine) sees these bytes.
            self.cache.observe_lane(answer, deleted=False, nudge=False)
            for event in writes.events:
                log.info("EmbedLane %s/%s: %s: %s", ns, name, event.reason, event.message)
                await self.post_event(answer, event)
        if not applied:
            raise RuntimeError(f"EmbedLane {key[0]}/{key[1]}'s pod was not applied")

    async def apply_workload(self, key: LaneKey, writes: LaneWrites) -> bool:
        """The lane's identity and NetworkPolicy, then its Deployment, when
        they changed (its pod reviews tokens from its start: the binding goes first). False
        when a write failed."""
        if writes.deployment is None:
            # Deleted once after a start too: what an earlier process applied is not in memory.
            if key in self.applied or key not in self.absent:
                log.info("EmbedLane %s/%s: no pod: %s", *key, writes.no_pod)
                name = lane_objects.name_for(key[1])
                try:
                    await self.api.delete(f"/apis/apps/v1/namespaces/{key[0]}/deployments/{name}")
                except ApiError as err:
                    if err.status != 404:
                        log.warning("deleting Deployment %s/%s failed: %s", key[0], name, err)
                        return False
                self.applied.pop(key, None)
                self.absent.add(key)
            return True
        digest = repr((writes.identity, writes.network_policy, writes.deployment))
        if self.applied.get(key) == digest:
            return True
        policy = () if writes.network_policy is None else (writes.network_policy,)
        try:
            for obj in (*writes.identity, *policy, writes.deployment):
                await self.api.apply(obj)
        except ApiError as err:
            log.warning("applying EmbedLane %s/%s's pod failed: %s", *key, err)
            return False
        self.applied[key] = digest
        self.absent.discard(key)
        return True

    async def post_event(self, lane: Mapping[str, object], event: events.Event) -> None:
        await events.post(
            self.api,
            events.reference(API_VERSION, "EmbedLane", object_at(lane, "metadata")),
            event,
            instance=socket.gethostname(),
            now=format_seconds(self.clock()),
            log=log,
        )
