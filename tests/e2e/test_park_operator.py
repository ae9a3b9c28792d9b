"""An Engine's park budget (spec.park) with the operator on a real API server and KWOK nodes:
charged to its tier of the node's board (host memory, or the disk pool), and refused with a
reason where the node lacks the room (docs/plan.md)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.builders import GiB
from tests.support.cluster import Cluster
from tests.support.crds import crds
from tests.support.engine_status import condition, is_condition
from tests.support.kwok_nodes import discrete_status, gpu_node
from tests.support.operator_process import Operator, engine, operator, tag
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

__all__ = ["crds", "operator", "tag"]  # fixtures, used by name

PARK = 4 * GiB


def with_disk(status: dict[str, Any], capacity_gib: int, used_gib: int = 0) -> dict[str, Any]:
    disk = {"kind": "disk", "capacityBytes": capacity_gib * GiB, "usedBytes": used_gib * GiB}
    return {**status, "pools": [*status["pools"], disk]}


def placed_pools(cluster: Cluster, ns: str, name: str) -> dict[str, int] | None:
    body = cluster.get_json("engine", name, "-n", ns)
    placement = (body.get("status") or {}).get("placement")
    if not placement:
        return None
    return {p["pool"]: p["bytes"] for p in placement["pools"]}


def test_a_park_budget_is_charged_to_its_tier_of_the_board(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    gpu_node(cluster, tag, with_disk(discrete_status(80, 0.5), 100))
    cluster.apply(engine("plain", tag), "-n", namespace)
    cluster.apply(engine("inhost", tag, park={"tier": "host", "bytes": PARK}), "-n", namespace)
    cluster.apply(engine("ondisk", tag, park={"tier": "disk", "bytes": PARK}), "-n", namespace)
    plain = wait_for("plain placed", lambda: placed_pools(cluster, namespace, "plain"))
    inhost = wait_for("inhost placed", lambda: placed_pools(cluster, namespace, "inhost"))
    ondisk = wait_for("ondisk placed", lambda: placed_pools(cluster, namespace, "ondisk"))
    assert inhost == {**plain, "host": plain["host"] + PARK}
    assert ondisk == {**plain, "disk": PARK}
    body = cluster.get_json("engine", "inhost", "-n", namespace)
    assert body["status"]["plan"]["bytes"]["host"]["park"] == PARK


def test_a_park_budget_the_node_has_no_room_for_is_refused_with_the_reason(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    node = gpu_node(cluster, tag, with_disk(discrete_status(80, 0.5), 10, used_gib=8))
    cluster.apply(engine("big", tag, park={"tier": "disk", "bytes": PARK}), "-n", namespace)
    body = wait_for(
        "Unschedulable",
        is_condition(cluster, namespace, "big", "Unschedulable", "True"),
        log=operator.log,
    )
    c = condition(body, "Unschedulable")
    assert c is not None and c["reason"] == "InsufficientMemory", c  # no node has room
    assert "1 with too little disk for spec.park" in c["message"], c
    assert node in c["message"] and "spec.park.bytes" in c["message"], c
