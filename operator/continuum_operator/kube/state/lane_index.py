"""What of an EmbedLane the caches index: the node its placement charges, what of it the
engines' decisions read, which lanes a change elsewhere may move (`kube.state.cache` marks them for
the lanes' reconciler), and which lanes this operator decides. Pure functions of the bodies; no
API calls.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from continuum_operator.model.json_body import at, labels_at, text

if TYPE_CHECKING:  # the cache imports this module: the key's one definition is the cache's
    from continuum_operator.kube.state.cache import EngineKey

__all__ = ["decided_here", "lane_hold", "lane_nodes", "lanes_of", "lanes_on"]


def lane_hold(body: Mapping[str, object] | None) -> tuple[object, object]:
    """What of a lane the engines' decisions read: its placement, and whether it is measured
    (compared as written, for a change)."""
    return at(body, "status", "placement"), at(body, "status", "runtime", "ready")


def lanes_on(lanes: Mapping[EngineKey, Mapping[str, object]], nodes: set[str]) -> list[EngineKey]:
    """The lanes a change of room on `nodes` may move: placed there, or free to go anywhere."""
    return [
        key
        for key, body in lanes.items()
        if not at(body, "spec", "engine") or not lane_nodes(body) or lane_nodes(body) & nodes
    ]


def lanes_of(lanes: Mapping[EngineKey, Mapping[str, object]], engine: EngineKey) -> list[EngineKey]:
    """The lanes beside `engine` (its namespace's that name it)."""
    return [
        key
        for key, body in list(lanes.items())
        if key[0] == engine[0] and at(body, "spec", "engine") == engine[1]
    ]


def lane_nodes(body: Mapping[str, object] | None) -> set[str]:
    """The node a lane's placement charges (all its leases are there)."""
    node = text(body, "status", "placement", "node")
    return {node} if node is not None else set()


def decided_here(
    body: Mapping[str, object],
    engines: Mapping[EngineKey, object],
    ledgers: Mapping[EngineKey, object],
    labels: Mapping[str, str] | None,
) -> bool:
    """Whether this operator decides the lane: every lane, without `--engine-selector`. With
    one, a lane beside an Engine it serves; never one beside an Engine another operator serves
    (its GrantLedger is watched here: it lives), whatever the lane's labels say (deciding it
    too, two operators overwrote its status and its pod at each resync); else a lane labelled
    as the selector asks (a model of its own, or an Engine nobody serves)."""
    if not labels:
        return True
    engine, namespace = text(body, "spec", "engine"), text(body, "metadata", "namespace")
    if engine is not None and namespace is not None:
        beside = (namespace, engine)
        if beside in engines:
            return True
        if beside in ledgers:
            return False
    own = labels_at(body, "metadata", "labels")
    return all(own.get(k) == v for k, v in labels.items())
