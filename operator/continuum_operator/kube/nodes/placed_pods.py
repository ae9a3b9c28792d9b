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
from typing import Any
from urllib.parse import quote

from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import AsyncKubeApi, pages
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.workloads.engine_objects import ENGINE_LABEL
from continuum_operator.kube.workloads.lane_objects import LANE_LABEL
from continuum_operator.model.base import GROUP, VERSION
from continuum_operator.model.board import NodeBoard

__all__ = ["PlacedPods", "placed_by_node"]

log = logging.getLogger(__name__)

#: Pods of these labels are the operator's consumers (the label's value names the object).
CONSUMER_LABELS = ((ENGINE_LABEL, "Engine"), (LANE_LABEL, "EmbedLane"))
PODS = "/api/v1/pods"
#: What a board's spec holds at most (the CRD's bound): more pods than that on one node is not
#: a layout this operator makes; the rest go unattributed, said in the log.
PLACED_MAX = 1024
_ENDED = frozenset({"Succeeded", "Failed"})

Placed = dict[str, str]


def placed_by_node(pods: Iterable[tuple[str, str, Mapping[str, Any]]]) -> dict[str, list[Placed]]:
    """`(label, kind, pod)` to each node's list, in a stable order (so an unchanged node compares
    equal). Pods not yet bound to a node, or ended, hold nothing there."""
    out: dict[str, list[Placed]] = {}
    for label, kind, pod in pods:
        meta = pod.get("metadata") or {}
        node = (pod.get("spec") or {}).get("nodeName")
        name = (meta.get("labels") or {}).get(label)
        phase = (pod.get("status") or {}).get("phase")
        if not node or not name or not meta.get("uid") or phase in _ENDED:
            continue
        out.setdefault(str(node), []).append(
            {"uid": str(meta["uid"]), "kind": kind, "namespace": str(meta.get("namespace")),
             "name": str(name)}
        )  # fmt: skip
    for node, placed in out.items():
        placed.sort(key=lambda p: (p["kind"], p["namespace"], p["name"], p["uid"]))
        if len(placed) > PLACED_MAX:
            log.warning("node %s: %d engine and lane pods, %d attributed", node, len(placed),
                        PLACED_MAX)  # fmt: skip
            del placed[PLACED_MAX:]
    return out


def _placed_fields(pod: Mapping[str, Any]) -> dict[str, Any]:
    meta = pod.get("metadata") or {}
    return {
        "metadata": {k: meta.get(k) for k in ("uid", "namespace", "labels")},
        "spec": {"nodeName": (pod.get("spec") or {}).get("nodeName")},
        "status": {"phase": (pod.get("status") or {}).get("phase")},
    }


class PlacedPods:
    """Keeps every NodeBoard's `spec.placed` equal to the operator's pods on that node."""

    def __init__(self, api: AsyncKubeApi, cache: Cache, interval: float = 5.0) -> None:
        self.api = api
        self.cache = cache
        self.interval = interval
        self.pods: dict[str, tuple[str, str, dict[str, Any]]] = {}  # uid -> label, kind, pod
        self.listed: set[str] = set()  # the labels whose pods have been listed

    async def relist(self, label: str, kind: str) -> str:
        """The label's pods, listed into `pods` (those gone since dropped); the list's
        resourceVersion, to watch from."""
        found: dict[str, tuple[str, str, dict[str, Any]]] = {}
        version = ""
        async for page in pages(self.api, PODS, [("labelSelector", label)]):
            version = str((page.get("metadata") or {}).get("resourceVersion") or version)
            for pod in page.get("items") or []:
                cut = _placed_fields(pod)
                found[str(cut["metadata"]["uid"])] = (label, kind, cut)
        for uid in [u for u, (lab, _, _) in self.pods.items() if lab == label]:
            self.pods.pop(uid)
        self.pods.update(found)
        self.listed.add(label)
        return version

    def observe(self, label: str, kind: str, event: Mapping[str, Any]) -> None:
        """A watch event: the pod kept (cut) or dropped."""
        pod = event.get("object") or {}
        uid = str((pod.get("metadata") or {}).get("uid") or "")
        if event.get("type") == "BOOKMARK" or not uid:
            return
        if event.get("type") == "DELETED":
            self.pods.pop(uid, None)
        else:
            self.pods[uid] = (label, kind, _placed_fields(pod))

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
                    meta = (event.get("object") or {}).get("metadata") or {}
                    since = str(meta.get("resourceVersion") or since)
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
