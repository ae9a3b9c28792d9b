"""The pods the operator placed on each node, written into that node's NodeBoard `spec.placed`.

The node agent charges a GPU process to an Engine or EmbedLane by its pod's UID (from the
process's cgroup). It used to list the pods on its node itself, but RBAC cannot bound a list to
one node (a field selector is the client's choice, not a rule), so its token could read every pod
spec in the cluster. The operator already lists pods; it tells each agent its node's share, and
the agent's only read is its own board (docs/security.md, "The node agent").

One writer: the leader, every `interval` seconds, patches only the boards whose list changed.
A board that does not exist yet (a node whose agent has not started) is skipped: the agent
creates it, and the next round fills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

from continuum_operator.kube.api import ApiError
from continuum_operator.kube.async_api import AsyncKubeApi, pages
from continuum_operator.kube.cache import Cache
from continuum_operator.kube.lane_objects import LANE_LABEL
from continuum_operator.kube.objects import ENGINE_LABEL
from continuum_operator.model.base import GROUP, VERSION
from continuum_operator.model.board import NodeBoard

__all__ = ["PlacedPods", "placed_by_node"]

log = logging.getLogger(__name__)

#: Pods of these labels are the operator's consumers (the label's value names the object).
CONSUMER_LABELS = ((ENGINE_LABEL, "Engine"), (LANE_LABEL, "EmbedLane"))
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

    async def list_pods(self) -> list[tuple[str, str, dict[str, Any]]]:
        """The engine and lane pods, a page at a time, each cut to what `placed_by_node` reads
        as its page arrives (a whole pod is kilobytes of spec and managed fields)."""
        found: list[tuple[str, str, dict[str, Any]]] = []
        for label, kind in CONSUMER_LABELS:
            async for page in pages(self.api, "/api/v1/pods", [("labelSelector", label)]):
                found.extend((label, kind, _placed_fields(pod)) for pod in page.get("items") or [])
        return found

    async def publish_once(self) -> int:
        """One round: the boards written."""
        wanted = placed_by_node(await self.list_pods())
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
        while not stop.is_set():
            try:
                await self.publish_once()
            except (ApiError, OSError) as err:
                log.warning("listing the engine and lane pods failed, retrying: %s", err)
            except Exception:  # one bad round must not stop the operator; the next retries
                log.exception("publishing the placed pods failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)
