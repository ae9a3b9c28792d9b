"""What of an EmbedLane the caches index: the node its placement charges, what of it the
engines' decisions read, and which lanes a change elsewhere may move (`kube.cache` marks them
for the lanes' reconciler). Pure functions of the bodies; no API calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["lane_hold", "lane_nodes", "lanes_of", "lanes_on"]

EngineKey = tuple[str, str]


def lane_hold(body: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """What of a lane the engines' decisions read: its placement, and whether it is measured."""
    status = (body or {}).get("status") or {}
    return status.get("placement"), (status.get("runtime") or {}).get("ready")


def lanes_on(lanes: Mapping[EngineKey, Mapping[str, Any]], nodes: set[str]) -> list[EngineKey]:
    """The lanes a change of room on `nodes` may move: placed there, or free to go anywhere."""
    return [
        key
        for key, body in lanes.items()
        if not (body.get("spec") or {}).get("engine") or not lane_nodes(body)
        or lane_nodes(body) & nodes
    ]  # fmt: skip


def lanes_of(lanes: Mapping[EngineKey, Mapping[str, Any]], engine: EngineKey) -> list[EngineKey]:
    """The lanes beside `engine` (its namespace's that name it)."""
    return [
        key
        for key, body in list(lanes.items())
        if key[0] == engine[0] and (body.get("spec") or {}).get("engine") == engine[1]
    ]


def lane_nodes(body: Mapping[str, Any] | None) -> set[str]:
    """The node a lane's placement charges (all its leases are there)."""
    raw = ((body or {}).get("status") or {}).get("placement") or {}
    node = raw.get("node") if isinstance(raw, Mapping) else None
    return {node} if isinstance(node, str) else set()
