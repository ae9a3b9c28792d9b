"""Pods as the placed-pods reconciler reads them: an engine's or a lane's pod on a node."""

from __future__ import annotations

from typing import Any


def pod(
    ns: str, uid: str, node: str | None, labels: dict[str, str], phase: str = "Running"
) -> dict[str, Any]:
    spec = {"nodeName": node} if node else {}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": ns, "name": f"p-{uid}", "uid": uid, "labels": labels},
            "spec": spec, "status": {"phase": phase}}  # fmt: skip
