"""An Engine's park budget (spec.park) in its plan: the store's bytes charged to host memory
(on a unified node the one pool) like any other part of the lease, and a node without the room
refused with a reason that names it (docs/plan.md)."""

from __future__ import annotations

from typing import Any

import numpy as np

from continuum_operator.core.plan import ReasonCode, SizeTable, plan
from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.workloads import engine_objects
from continuum_operator.model.plan_status import PlanStatus
from tests.support.builders import GiB, board, board_body, engine, engine_body

PARK = 3 * GiB


def discrete(host: int = 64 * GiB) -> dict[str, object]:
    return board_body(
        "discrete",
        [
            {"kind": "host", "capacityBytes": host, "usedBytes": 0},
            {"kind": "device", "device": 0, "capacityBytes": 24 * GiB, "usedBytes": 0},
        ],
    )


def unified(capacity: int = 32 * GiB) -> dict[str, object]:
    return board_body("unified", [{"kind": "unified", "capacityBytes": capacity, "usedBytes": 0}])


def planned(board_doc: dict[str, object], **spec: object):  # type: ignore[no-untyped-def]
    e = engine(engine_body(**spec))
    assert e.spec.model.facts is not None
    return plan(board(board_doc), e.spec, e.spec.model.facts)


def test_a_host_park_is_charged_to_the_host_pool_beside_the_engine() -> None:
    without = planned(discrete())
    parked = planned(discrete(), park={"tier": "host", "bytes": PARK})
    assert parked.schedulable and parked.host.park == PARK and parked.device.park == 0
    charges, before = dict(parked.charges), dict(without.charges)
    assert charges["host"] == before["host"] + PARK
    assert charges["device/0"] == before["device/0"]  # the device part is the same
    assert parked.to_dict()["bytes"]["host"]["park"] == PARK


def test_on_a_unified_node_the_park_is_charged_to_the_one_pool() -> None:
    without = planned(unified())
    parked = planned(unified(), park={"bytes": PARK})  # tier host by default
    assert dict(parked.charges)["unified"] == dict(without.charges)["unified"] + PARK
    # Its bytes are in use, like the KV: they leave fewer minds room in the same pool.
    tight = planned(unified(12 * GiB), park={"bytes": 3 * GiB})
    loose = planned(unified(12 * GiB))
    assert tight.minds_grantable < loose.minds_grantable


def test_a_node_without_room_for_the_park_is_refused_with_the_park_named() -> None:
    refused = planned(unified(12 * GiB), park={"bytes": 11 * GiB})
    assert not refused.schedulable
    (why,) = [r for r in refused.reasons if r.code is ReasonCode.INSUFFICIENT_MEMORY]
    assert "park store 11,264 MiB included" in why.message
    assert "spec.park.bytes" in why.message


def test_the_prefilters_arrays_hold_the_park_as_the_plan_does() -> None:
    e = engine(engine_body(park={"bytes": PARK}))
    assert e.spec.model.facts is not None
    table = SizeTable(e.spec, e.spec.model.facts)
    levels = np.arange(0, table.layers + 2)
    device, host = table.in_use(levels, 2)
    for j in levels.tolist():
        assert (int(device[j]), int(host[j])) == table.at(j, 2)
    assert (
        table.at(0, 2)[1] - SizeTable(engine(engine_body()).spec, e.spec.model.facts).at(0, 2)[1]
        == PARK
    )


def test_the_engine_pod_mounts_its_park_store_and_counts_a_host_one_in_its_memory() -> None:
    def pod(**spec: object) -> tuple[dict[str, Any], PlanStatus]:
        e = engine(engine_body(**spec))
        assert e.spec.model.facts is not None
        p = PlanStatus.model_validate(plan(board(discrete()), e.spec, e.spec.model.facts).to_dict())
        d = engine_objects.deployment(e, "u", p, PodSettings(), node_has_gpus=True)
        return d["spec"]["template"]["spec"], p

    spec, _ = pod(park={"tier": "host", "bytes": PARK})
    (c,) = spec["containers"]
    cmd = c["command"]
    assert cmd[cmd.index("--park-dir") + 1] == "/park"
    assert cmd[cmd.index("--park-budget") + 1] == str(PARK)
    (volume,) = [v for v in spec["volumes"] if v["name"] == "park"]
    assert volume["emptyDir"] == {"sizeLimit": "3072Mi", "medium": "Memory"}
    assert {"name": "park", "mountPath": "/park"} in c["volumeMounts"]
    plain_spec, _ = pod()
    limit = int(c["resources"]["limits"]["memory"])
    plain_limit = int(plain_spec["containers"][0]["resources"]["limits"]["memory"])
    assert limit - plain_limit == PARK  # a memory emptyDir's pages are the pod's memory
    assert "--park-dir" not in plain_spec["containers"][0]["command"]
    disk, _ = pod(park={"tier": "disk", "bytes": PARK})
    (volume,) = [v for v in disk["volumes"] if v["name"] == "park"]
    assert volume["emptyDir"] == {"sizeLimit": "3072Mi"}  # the node's disk


def with_disk(doc: dict[str, Any], capacity: int, used: int = 0) -> dict[str, Any]:
    status = doc["status"]
    status["pools"] = [
        *status["pools"],
        {"kind": "disk", "capacityBytes": capacity, "usedBytes": used},
    ]
    return doc


def test_a_disk_park_is_charged_to_the_disk_pool_not_to_memory() -> None:
    without = planned(with_disk(discrete(), 100 * GiB))
    on_disk = planned(with_disk(discrete(), 100 * GiB), park={"tier": "disk", "bytes": PARK})
    assert on_disk.schedulable and on_disk.host.park == 0
    assert dict(on_disk.charges) == {**dict(without.charges), "disk": PARK}
    on_unified = planned(with_disk(unified(), 100 * GiB), park={"tier": "disk", "bytes": PARK})
    assert dict(on_unified.charges)["disk"] == PARK


def test_a_disk_park_is_refused_by_a_node_without_a_disk_pool_or_its_room() -> None:
    none = planned(discrete(), park={"tier": "disk", "bytes": PARK})
    assert not none.schedulable and none.reasons[-1].code is ReasonCode.NO_DISK_POOL
    assert "--disk-path" in none.reasons[-1].message
    full = planned(
        with_disk(discrete(), 10 * GiB, used=8 * GiB), park={"tier": "disk", "bytes": PARK}
    )
    assert not full.schedulable and full.reasons[-1].code is ReasonCode.INSUFFICIENT_DISK
    assert "2,048 MiB left" in full.reasons[-1].message
