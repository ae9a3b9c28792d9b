"""KWOK nodes on the local control plane as the node agent keeps them: each node's NodeBoard
(`write_board`, a one-GPU board's status from `discrete_status`) and the agent's Lease beside the
kubelet's (`renew`, never the kubelet's own: `core.heartbeat`), fresh or long expired."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Any

from continuum_operator.core.heartbeat import agent_lease_metadata
from tests.support.builders import GiB
from tests.support.cluster import Cluster


def now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def renew(
    cluster: Cluster,
    node: str,
    *,
    renew_time: str | None = None,
    ttl: int = 600,
    namespace: str | None = None,  # the operator's --agent-lease-namespace (default: default)
) -> None:
    meta = (
        agent_lease_metadata(node) if namespace is None else agent_lease_metadata(node, namespace)
    )
    cluster.apply(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": meta,
            "spec": {
                "holderIdentity": "continuum-agent-e2e",
                "leaseDurationSeconds": ttl,
                "renewTime": renew_time or now_micro(),
            },
        }
    )


def write_board(cluster: Cluster, node: str, status: dict[str, Any]) -> None:
    cluster.apply(
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "NodeBoard", "metadata": {"name": node}}
    )
    cluster.kubectl(
        "patch", "nodeboard", node, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": status}),
    )  # fmt: skip


def discrete_status(
    device_gib: int, device_used_gib: float, host_gib: int = 256, own: int = 0
) -> dict[str, Any]:
    """A one-GPU board; `own` adds what an engine running there allocated, as the agent sees it."""
    return {
        "memoryMode": "discrete",
        "memoryModeReason": "e2e",
        "pools": [
            {"kind": "host", "capacityBytes": host_gib * GiB, "usedBytes": 8 * GiB},
            {"kind": "device", "device": 0, "capacityBytes": device_gib * GiB,
             "usedBytes": int(device_used_gib * GiB) + own},
        ],
        "gpus": [{"index": 0, "name": "e2e GPU"}],
    }  # fmt: skip


def gpu_node(
    cluster: Cluster,
    tag: str,
    status: dict[str, Any],
    *,
    fresh: bool = True,
    memory: str = "256Gi",
    ttl: int = 600,
) -> str:
    """A KWOK node of one GPU labelled `e2e-tag: <tag>`, its board `status`; its agent's Lease
    renewed now for `ttl` seconds (`fresh`) or long expired."""
    name = f"{tag}-{uuid.uuid4().hex[:4]}"
    cluster.create_fake_node(
        name, capacity={"nvidia.com/gpu": "1", "memory": memory}, labels={"e2e-tag": tag}
    )
    write_board(cluster, name, status)
    if fresh:
        renew(cluster, name, ttl=ttl)
    else:
        renew(cluster, name, renew_time="2020-01-01T00:00:00.000000Z", ttl=40)
    return name


def fresh_gpu_node(cluster: Cluster, tag: str) -> str:
    """A KWOK node with a fresh one-GPU board (80 GiB, nearly free), as the node agent would
    keep it, its Lease good for an hour."""
    return gpu_node(cluster, tag, discrete_status(80, 0.5), ttl=3600)
