"""The node agent's heartbeat: one coordination.k8s.io Lease per node, and when it is fresh.

A NodeBoard is written only when it changes, so its age says nothing about the agent; the Lease
does. The agent renews it every probe interval; the operator reads it to tell a quiet board from
a stale one. The names live here so that both sides (agent/writer.py and the operator) agree.
The Lease lives in the agent's own namespace (the chart's release namespace; `default` outside a
cluster), not in `kube-node-lease`: the agent has no right there, so it cannot touch the
kubelets' heartbeats, and an admission policy binds each agent to its own node's Lease and board
(charts/continuum/templates/agent-node-binding.yaml, docs/security.md). A watcher maps a Lease
back to its node with `node_of_lease` (the node's name is also kept in the `continuum.dev/node`
annotation, since a long node name is shortened in the Lease's name).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from continuum_operator.model.base import label_selector

__all__ = [
    "AGENT_LEASE_LABELS",
    "AGENT_LEASE_SELECTOR",
    "LEASE_NAMESPACE",
    "LEASE_PREFIX",
    "NODE_ANNOTATION",
    "agent_lease_metadata",
    "lease_fresh",
    "lease_name",
    "node_of_lease",
]

#: Where agent Leases live when no namespace is given ($POD_NAMESPACE is, in a cluster).
LEASE_NAMESPACE = "default"
LEASE_PREFIX = "continuum-agent-"
NODE_ANNOTATION = "continuum.dev/node"
# What the operator's watch selects agent Leases by, on the API server: kopf watches Leases in
# every namespace, the kubelets renew theirs every 10 s (100 a second at 1,000 nodes), and none
# of them need reach the operator.
AGENT_LEASE_LABELS = {"app.kubernetes.io/managed-by": "continuum-agent"}
AGENT_LEASE_SELECTOR = label_selector(AGENT_LEASE_LABELS)
_MAX_NAME = 253


def lease_name(node: str) -> str:
    """`continuum-agent-<node>`; a node name too long for the prefix is shortened with a hash."""
    name = LEASE_PREFIX + node
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return name[: _MAX_NAME - 11].rstrip("-.") + "-" + digest


def agent_lease_metadata(node: str, namespace: str = LEASE_NAMESPACE) -> dict[str, Any]:
    """The metadata of a node's agent Lease: its name, the labels the operator selects it by,
    and the node it vouches for (a shortened name cannot be undone)."""
    return {
        "name": lease_name(node),
        "namespace": namespace,
        "labels": dict(AGENT_LEASE_LABELS),
        "annotations": {NODE_ANNOTATION: node},
    }


def node_of_lease(name: str, annotations: Mapping[str, str] | None = None) -> str | None:
    """The node whose board a Lease vouches for; None for any other Lease (the kubelet's) and for
    one whose annotation names a node the name is not that node's: the admission policy pins
    the annotation to the writing agent's node, so such a Lease vouches for no board."""
    if not name.startswith(LEASE_PREFIX):
        return None
    node = (annotations or {}).get(NODE_ANNOTATION)
    if node:
        return node if lease_name(node) == name else None
    return name[len(LEASE_PREFIX) :]  # a shortened name cannot be undone: the agent annotates


def lease_fresh(renew_time: datetime | None, duration_seconds: int, now: datetime) -> bool:
    """Whether a Lease renewed at `renew_time` for `duration_seconds` still holds at `now`."""
    if renew_time is None:
        return False
    return now < renew_time + timedelta(seconds=duration_seconds)
