"""The pods the operator placed on each node, written into that node's NodeBoard `spec.placed`.

The node agent charges a GPU process to an Engine or EmbedLane by its pod's UID (from the
process's cgroup). It used to list the pods on its node itself, but RBAC cannot bound a list to
one node (a field selector is the client's choice, not a rule), so its token could read every pod
spec in the cluster. The operator already lists pods; it tells each agent its node's share, and
the agent's only read is its own board (docs/security.md, "The node agent").

A reconciler on the controller kernel (`kube.base.kernel`), on the leader, as the others are: its
keys are the nodes with a board, its decision a node's list from the pods kept here (None when
the board already says it), its write the board's `spec.placed` merge patch. A node is marked
when one of its pods changes (the watches here) or its board does (the cache's `placed_queue`,
`kube.state.cache`); every node at each full resync. A board that does not exist yet (a node whose
agent has not started) is skipped: the agent creates it, and its watch event marks the node.

The pods are listed once (a page at a time) and then watched, each kept only as far as
placement reads it, by `kube.client.async_api.follow` (a stream that ends resumed from the last
resourceVersion or bookmark, a 410 listed again at once), as the engine and the lane follow
their objects. They were listed whole every round: at 2,000 engines, megabytes of pods parsed
every 5 s, the largest allocation the operator made (docs/performance.md). Not a kopf watch:
kopf takes one label selector per resource, and pods already have one (the Minds' children,
`kube.children.webhook`); a watch without one would carry every pod of the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from urllib.parse import quote

from continuum_operator.kube.base import kernel
from continuum_operator.kube.base.kernel import KernelSettings, PassHooks, WorkQueue
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import AsyncKubeApi, follow
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


class PlacedPods(PassHooks[str]):
    """Keeps every NodeBoard's `spec.placed` equal to the operator's pods on that node."""

    def __init__(
        self,
        api: AsyncKubeApi,
        cache: Cache,
        settings: KernelSettings | None = None,
        *,
        may_write: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api, self.cache, self.may_write, self.clock = api, cache, may_write, clock
        self.kernel = settings or OperatorSettings().kernels.placed
        self.queue: WorkQueue[str] = cache.placed_queue
        self.pods: dict[str, tuple[str, str, PodSeen]] = {}  # uid -> label, kind, pod
        self.on_node: dict[str, set[str]] = {}  # node -> the uids of its pods
        self.listed: set[str] = set()  # the labels whose pods have been listed
        self.written = 0  # boards written (a count for tests and the log)

    # -- the pods, kept from the list and the watch; each change marks its nodes ----------------

    def _keep(self, uid: str, entry: tuple[str, str, PodSeen] | None) -> None:
        """The pod `uid` now `entry` (None: gone); the node it left and the one it is on marked."""
        old = self.pods.pop(uid, None)
        if old is not None and (node := old[2].node):
            self.on_node[node].discard(uid)
            if not self.on_node[node]:
                del self.on_node[node]
            self.queue.mark(node)
        if entry is not None:
            self.pods[uid] = entry
            if node := entry[2].node:
                self.on_node.setdefault(node, set()).add(uid)
                self.queue.mark(node)

    async def keep_list(
        self, label: str, kind: str, items: AsyncIterator[Mapping[str, object]]
    ) -> None:
        """The label's pods as a list has them (`follow` hands them a page at a time), kept in
        `pods`; those gone since dropped."""
        found: dict[str, tuple[str, str, PodSeen]] = {}
        async for pod in items:
            seen = PodSeen.of(pod)
            found[seen.uid] = (label, kind, seen)
        for uid in [u for u, (lab, _, _) in self.pods.items() if lab == label and u not in found]:
            self._keep(uid, None)
        for uid, entry in found.items():
            if self.pods.get(uid) != entry:
                self._keep(uid, entry)
        if label not in self.listed:
            self.listed.add(label)
            if len(self.listed) == len(CONSUMER_LABELS):
                self.queue.mark_all()  # every kind listed: each node's list is news now

    def observe(self, label: str, kind: str, event: Mapping[str, object]) -> None:
        """A watch event: the pod kept (what placement reads of it) or dropped."""
        seen = PodSeen.of(event.get("object"))
        if event.get("type") == "BOOKMARK" or not seen.uid:
            return
        self._keep(seen.uid, None if event.get("type") == "DELETED" else (label, kind, seen))

    async def follow(self, label: str, kind: str) -> None:
        """The label's pods listed, then watched (`kube.client.async_api.follow`), until
        cancelled."""
        await follow(
            self.api,
            PODS,
            [("labelSelector", label)],
            partial(self.keep_list, label, kind),
            partial(self.observe, label, kind),
            what=f"the {kind} pods",
        )

    # -- the kernel's hooks ---------------------------------------------------------------------

    def keys(self) -> list[str]:
        """Every node with a board; none before every kind of pod has been listed (an empty
        list then is not news)."""
        if len(self.listed) < len(CONSUMER_LABELS):
            return []
        return sorted(self.cache.boards)

    def decide(self, node: str, now: float) -> list[Placed] | None:
        """The node's list, where its board says otherwise (None: nothing to write)."""
        if node not in self.cache.boards or len(self.listed) < len(CONSUMER_LABELS):
            return None
        mine = (self.pods[uid] for uid in self.on_node.get(node, ()))
        placed = placed_by_node(mine).get(node, [])
        return None if self.cache.board_placed.get(node, []) == placed else placed

    async def write(self, node: str, placed: list[Placed]) -> None:
        path = f"/apis/{GROUP}/{VERSION}/{NodeBoard.PLURAL}/{quote(node)}"
        try:
            await self.api.merge_patch(path, {"spec": {"placed": placed}})
        except ApiError as err:
            if err.status == 404:  # deleted meanwhile: its node went
                return
            raise  # the kernel takes the node again after a backoff
        self.cache.board_placed[node] = placed
        self.written += 1

    async def publish_once(self) -> int:
        """One pass of the kernel over the nodes marked now: the boards written."""
        before = self.written
        await kernel.drain(self, self.queue, self.kernel, may_write=self.may_write,
                           clock=self.clock)  # fmt: skip
        return self.written - before

    async def run(self, stop: asyncio.Event) -> None:
        watches = [asyncio.create_task(self.follow(label, kind))
                   for label, kind in CONSUMER_LABELS]  # fmt: skip
        try:
            await kernel.run(self, self.queue, self.kernel, stop, may_write=self.may_write,
                             clock=self.clock)  # fmt: skip
        finally:
            for task in watches:
                task.cancel()
            await asyncio.gather(*watches, return_exceptions=True)
