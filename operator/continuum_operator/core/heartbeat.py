"""The node agent's heartbeat: one coordination.k8s.io Lease per node, and when it is fresh.

A NodeBoard is written only when it changes, so its age says nothing about the agent; the Lease
does. The agent renews it every probe interval; the operator reads it to tell a quiet board from
a stale one. The names live here so that both sides (agent/writer.py and the operator) agree.
The Lease sits beside the kubelet's own in `kube-node-lease` under a prefixed name, so the two
never collide.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

__all__ = ["LEASE_NAMESPACE", "LEASE_PREFIX", "lease_fresh", "lease_name"]

LEASE_NAMESPACE = "kube-node-lease"
LEASE_PREFIX = "continuum-agent-"
_MAX_NAME = 253


def lease_name(node: str) -> str:
    """`continuum-agent-<node>`; a node name too long for the prefix is shortened with a hash."""
    name = LEASE_PREFIX + node
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return name[: _MAX_NAME - 11].rstrip("-.") + "-" + digest


def lease_fresh(renew_time: datetime | None, duration_seconds: int, now: datetime) -> bool:
    """Whether a Lease renewed at `renew_time` for `duration_seconds` still holds at `now`."""
    if renew_time is None:
        return False
    return now < renew_time + timedelta(seconds=duration_seconds)
