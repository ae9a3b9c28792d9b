"""The node agent's heartbeat: one coordination.k8s.io Lease per node, and when it is fresh.

A NodeBoard is written only when it changes, so its age says nothing about the agent; the Lease
does. The agent renews it every probe interval; the operator reads it to tell a quiet board from
a stale one. The names live here so that both sides (agent/writer.py and the operator) agree.
The Lease sits beside the kubelet's own in `kube-node-lease` under a prefixed name, so the two
never collide: the kubelet's Lease says the node is alive, this one that its board is current.
A watcher maps a Lease back to its node with `node_of_lease` (the node's name is also kept in the
`continuum.dev/node` annotation, since a long node name is shortened in the Lease's name).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import datetime, timedelta

__all__ = [
    "LEASE_NAMESPACE",
    "LEASE_PREFIX",
    "NODE_ANNOTATION",
    "lease_fresh",
    "lease_name",
    "node_of_lease",
]

LEASE_NAMESPACE = "kube-node-lease"
LEASE_PREFIX = "continuum-agent-"
NODE_ANNOTATION = "continuum.dev/node"
_MAX_NAME = 253


def lease_name(node: str) -> str:
    """`continuum-agent-<node>`; a node name too long for the prefix is shortened with a hash."""
    name = LEASE_PREFIX + node
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return name[: _MAX_NAME - 11].rstrip("-.") + "-" + digest


def node_of_lease(name: str, annotations: Mapping[str, str] | None = None) -> str | None:
    """The node whose board a Lease vouches for; None for any other Lease (the kubelet's)."""
    if not name.startswith(LEASE_PREFIX):
        return None
    node = (annotations or {}).get(NODE_ANNOTATION)
    if node and lease_name(node) == name:
        return node
    return name[len(LEASE_PREFIX) :]  # a shortened name cannot be undone: the agent annotates


def lease_fresh(renew_time: datetime | None, duration_seconds: int, now: datetime) -> bool:
    """Whether a Lease renewed at `renew_time` for `duration_seconds` still holds at `now`."""
    if renew_time is None:
        return False
    return now < renew_time + timedelta(seconds=duration_seconds)
