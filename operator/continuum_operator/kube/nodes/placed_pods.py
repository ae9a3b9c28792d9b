"""The pods the operator placed on each node, written into that node's NodeBoard `spec.placed`.

The node agent charges a GPU process to an Engine or EmbedLane by its pod's UID (from the
process's cgroup). It used to list the pods on its node itself, but RBAC cannot bound a list to
one node (a field selector is the client's choice, not a rule), so its token could read every pod
spec in the cluster. The operator already lists pods; it tells each agent its node's share, and
the agent's only read is its own board (docs/security.md, "The node agent").

One writer: the leader, every `interval` seconds, patches only the boards whose list changed.
A board that does not exist yet (a node whose agent has not started) is skipped: the agent
creates it, and the next round fills it.

The pods are listed once (a page at a time) and then watched, each kept only as far as
placement reads it. They were listed whole every round: at 2,000 engines, megabytes of pods
parsed every 5 s, the largest allocation the operator made (docs/performance.md). Not a kopf
watch: kopf takes one label selector per resource, and pods already have one (the Minds'
children, `kube.children.webhook`); a watch without one would carry every pod of the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import quote

from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import AsyncKubeApi, pages
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.workloads.engine_objects import ENGINE_LABEL
from continuum_operator.kube.workloads.lane_objects import LANE_LABEL
from continuum_operator.model.base import GROUP, VERSION
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.json_body import labels_at, text

__all__ = ["PlacedPods", "PodSeen", "placed_by_node"]

log = logging.getLogger(__name__)

#: Pods of these labels are the operator's consumers (the label's value names the object).
CONSUMER_LABELS = ((ENGINE_LABEL, "Engine"), (LANE_LABEL, "EmbedLane"))
PODS = "/api/v1/pods"
#: What a board's spec holds at most (the CRD's bound): more pods than that on one node is not
#: a layout this operator makes; the rest go unattributed, said in the log.
PLACED_MAX = 1024
_ENDED = frozenset({"Succeeded", "Failed"})

Placed = dict[str, str]


@dataclass(frozen=True, slots=True)
class PodSeen:
    """What a board's `spec.placed` reads of one of the operator's pods; the rest of the Pod
    (its containers, most of its status) is not kept."""

    uid: str
    namespace: str
    labels: Mapping[str, str]
    node: str | None  # spec.nodeName: None until it is bound
    phase: str | None

    @classmethod
    def of(cls, pod: object) -> PodSeen:
        """A Pod as the API sends it, read."""
        return cls(
            uid=text(pod, "metadata", "uid") or "",
            namespace=text(pod, "metadata", "namespace") or "",
            labels=labels_at(pod, "metadata", "labels"),
            node=text(pod, "spec", "nodeName"),
            phase=text(pod, "status", "phase"),
        )


def placed_by_node(pods: Iterable[tuple[str, str, PodSeen]]) -> dict[str, list[Placed]]:
    """`(label, kind, pod)` to each node's list, in a stable order (so an unchanged node compares
    equal). Pods not yet bound to a node, or ended, hold nothing there."""
    out: dict[str, list[Placed]] = {}
    for label, kind, pod in pods:
        name = pod.labels.get(label)
        if not pod.node or not name or not pod.uid or pod.phase in _ENDED:
            continue
        out.setdefault(pod.node, []).append(
            {"uid": pod.uid, "kind": kind, "namespace": pod.namespace, "name": name}
        )
    for node, placed in out.items():
        placed.sort(key=lambda p: (p["kind"], p["namespace"], p["name"], p["uid"]))
        if len(placed) > PLACED_MAX:
            log.warning("node %s: %d engine and lane pods, %d attributed", node, len(placed),
                        PLACED_MAX)  # fmt: skip
            del placed[PLACED_MAX:]
    return out


class PlacedPods:
    """Keeps every NodeBoard's `spec.placed` equal to the operator's pods on that node."""

    def __init__(self, api: AsyncKubeApi, cache: Cache, interval: float = 5.0) -> None:
        self.api = api
        self.cache = cache
        self.interval = interval
        self.pods: dict[str, tuple[str, str, PodSeen]] = {}  # uid -> label, kind, pod
        self.listed: set[str] = set()  # the labels whose pods have been listed

    async def relist(self, label: str, kind: str) -> str:
        """The label's pods, listed into `pods` (those gone since dropped); the list's
        resourceVersion, to watch from."""
        found: dict[str, tuple[str, str, PodSeen]] = {}
        version = ""
        async for page in pages(self.api, PODS, [("labelSelector", label)]):
            version = text(page, "metadata", "resourceVersion") or version
            for pod in page.get("items") or []:
                seen = PodSeen.of(pod)
                found[seen.uid] = (label, kind, seen)
        for uid in [u for u, (lab, _, _) in self.pods.items() if lab == label]:
            self.pods.pop(uid)
        self.pods.update(found)
        self.listed.add(label)
        return version

    def observe(self, label: str, kind: str, event: Mapping[str, object]) -> None:
        """A watch event: the pod kept (what placement reads of it) or dropped."""
        seen = PodSeen.of(event.get("object"))
        if event.get("type") == "BOOKMARK" or not seen.uid:
            return
        if event.get("type") == "DELETED":
            self.pods.pop(seen.uid, None)
        else:
            self.pods[seen.uid] = (label, kind, seen)

    async def follow(self, label: str, kind: str, stop: asyncio.Event) -> None:
        """List, then watch from the list's version for as long as this replica leads; a
        version too old (410) lists again, a lost stream watches again from the last seen."""
        since = ""
        while not stop.is_set():
            try:
                if not since:
                    since = await self.relist(label, kind)
                async for event in self.api.watch(PODS, [("labelSelector", label)], since):
                    self.observe(label, kind, event)
                    since = text(event, "object", "metadata", "resourceVersion") or since
            except ApiError as err:
                if err.status != 410:
                    log.warning("watching the %s pods failed, listing again: %s", kind, err)
                since = ""
            except OSError as err:
                log.warning("watching the %s pods failed, retrying: %s", kind, err)
            else:
                continue  # the server ended the stream (its timeout): watch on
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    async def publish_once(self) -> int:
        """One round: the boards written (none before every kind of pod has been listed: an
        empty list then is not news)."""
        if len(self.listed) < len(CONSUMER_LABELS):
            return 0
        wanted = placed_by_node(self.pods.values())
        written = 0
        for node in sorted(self.cache.boards):
            placed = wanted.get(node, [])
            if self.cache.board_placed.get(node, []) == placed:
                continue
            path = f"/apis/{GROUP}/{VERSION}/{NodeBoard.PLURAL}/{quote(node)}"
            try:
                await self.api.merge_patch(path, {"spec": {"placed": placed}})
            except ApiError as err:
                if err.status != 404:  # deleted meanwhile: its node went
                    log.warning("writing NodeBoard %s spec.placed failed: %s", node, err)
                continue
            self.cache.board_placed[node] = placed
            written += 1
        return written

    async def run(self, stop: asyncio.Event) -> None:
        watches = [asyncio.create_task(self.follow(label, kind, stop))
                   for label, kind in CONSUMER_LABELS]  # fmt: skip
        try:
            while not stop.is_set():
                try:
                    await self.publish_once()
                except Exception:  # one bad round must not stop the operator; the next retries
                    log.exception("publishing the placed pods failed")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.interval)
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
