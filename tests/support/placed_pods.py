"""Pods as the placed-pods reconciler reads them: an engine's or a lane's pod on a node; and a
list of them handed to it as `kube.client.async_api.follow` hands one (a page at a time)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from continuum_operator.kube.client.async_api import pages
from continuum_operator.kube.client.body import bodies
from continuum_operator.kube.nodes.placed_pods import PODS, PlacedPods


def pod(
    ns: str, uid: str, node: str | None, labels: dict[str, str], phase: str = "Running"
) -> dict[str, Any]:
    spec = {"nodeName": node} if node else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": ns, "name": f"p-{uid}", "uid": uid, "labels": labels},
            "spec": spec, "status": {"phase": phase}}  # fmt: skip


async def list_pods(publisher: PlacedPods, label: str, kind: str) -> None:
    """The label's pods listed into `publisher`, as its watch's list is (a page at a time)."""

    async def items() -> AsyncIterator[Mapping[str, object]]:
        async for page in pages(publisher.api, PODS, [("labelSelector", label)]):
            for item in bodies(page.get("items")):
                yield item

    await publisher.keep_list(label, kind, items())
