"""The operator on the real control plane: `continuum operator` as a subprocess, KWOK nodes with
NodeBoards and the agent's Leases written by the test as the node agent would (beside the
kubelet's Lease, never it: `core.heartbeat`), Engines applied with kubectl. What a user sees:
plans and conditions in status, the Deployment that runs the plan, relaunches that do not storm,
stale boards that take no plans, and clear refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.builders import ROOT
from tests.support.cluster import Cluster
from tests.support.crds import crds
from tests.support.engine_status import (
    condition,
    events,
    get_engine,
    is_condition,
    own_device_bytes,
)
from tests.support.kwok_nodes import discrete_status, gpu_node, renew, write_board
from tests.support.operator_process import (
    POD_START_TIMEOUT,
    READINGS,
    Operator,
    engine,
    operator,
    scrape_metric,
    tag,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

__all__ = ["crds", "operator", "tag"]  # fixtures, used by name

GiB = 2**30
INVALID = ROOT / "examples" / "invalid"


# --------------------------------------------------------------------------------------------
# tests


def test_an_engine_is_planned_placed_and_run_as_its_plan_says(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    node = gpu_node(cluster, tag, discrete_status(80, 0.5))
    cluster.apply(engine("coder", tag), "-n", namespace)
    body = wait_for(
        "Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log
    )
    status = body["status"]
    plan = status["plan"]
    assert plan["node"] == node and plan["schedulable"] is True
    assert status["placement"]["node"] == node
    assert status["placement"]["assumed"] is False  # confirmed once the pod was ready
    assert {p["pool"] for p in status["placement"]["pools"]} == {"host", "device/0"}
    assert condition(body, "Planned")["status"] == "True"  # type: ignore[index]
    assert condition(body, "Unschedulable")["status"] == "False"  # type: ignore[index]
    assert condition(body, "BoardStale")["status"] == "False"  # type: ignore[index]
    assert condition(body, "MemoryModeUnknown")["status"] == "False"  # type: ignore[index]
    assert status["enforcement"]["engineArgs"] is True

    deployment = cluster.get_json("deployment", "coder", "-n", namespace)
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    assert deployment["metadata"]["ownerReferences"][0]["kind"] == "Engine"
    pod_spec = deployment["spec"]["template"]["spec"]
    assert pod_spec["priorityClassName"] == "continuum-engine"
    container = pod_spec["containers"][0]
    command = container["command"]
    assert command[:2] == ["continuum", "engine"]
    assert command[command.index("--") + 1 :] == plan["engineArgs"]
    assert container["resources"]["requests"] == container["resources"]["limits"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert int(container["resources"]["limits"]["memory"]) >= plan["bytes"]["host"]["weights"]

    pods = cluster.get_json("pods", "-n", namespace, "-l", "continuum.dev/engine=coder")["items"]
    assert [p["spec"]["nodeName"] for p in pods] == [node]
    assert pods[0]["status"]["qosClass"] == "Guaranteed"
    # The pod's identity reads its own Engine and writes its status.runtime, nothing more.
    account = pod_spec["serviceAccountName"]
    who = f"--as=system:serviceaccount:{namespace}:{account}"

    def can(*args: str) -> str:
        found = cluster.kubectl("auth", "can-i", *args, "-n", namespace, who, check=False)
        return found.stdout.strip()

    assert can("watch", "engines/coder") == "yes"
    assert can("patch", "engines/coder", "--subresource=status") == "yes"
    assert can("patch", "engines/coder") == "no"
    assert can("patch", "engines/other", "--subresource=status") == "no"
    service = cluster.get_json("service", "coder", "-n", namespace)
    assert service["spec"]["selector"]["continuum.dev/engine"] == "coder"
    wait_for(
        "the Placed and PodReady events",
        lambda: (
            {"Placed", "PodReady"} <= {e["reason"] for e in events(cluster, namespace, "coder")}
        ),
        log=operator.log,
    )

    printed = cluster.kubectl("get", "engine", "coder", "-n", namespace).stdout
    assert node in printed and "True" in printed

    # What the operator owns, it restores.
    cluster.kubectl("delete", "service", "coder", "-n", namespace)
    wait_for(
        "the Service restored",
        lambda: (
            cluster.kubectl("get", "service", "coder", "-n", namespace, check=False).returncode == 0
        ),
        log=operator.log,
    )


def test_a_board_update_that_changes_the_plan_relaunches_once_not_in_a_storm(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    # Another tenant holds 17 of 24 GiB of the GPU: few layers and minds fit.
    node = gpu_node(cluster, tag, discrete_status(24, 17))
    cluster.apply(engine("coder", tag), "-n", namespace)
    body = wait_for(
        "Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log
    )
    before = body["status"]["plan"]
    assert before["mindsGrantable"] < 8
    own = own_device_bytes(body)

    # The engine runs: the agent's board now counts its bytes too. Readings of that board (Lease
    # renewals) re-plan to the same plan: nothing to weigh, no relaunch.
    write_board(cluster, node, discrete_status(24, 17, own=own))
    for _ in range(READINGS + 1):
        renew(cluster, node)
        time.sleep(1)
    # Flapping readings (the tenant's usage read wrong every other time) never agree three times
    # in a row: no relaunch.
    for i in range(6):
        write_board(cluster, node, discrete_status(24, 1 if i % 2 == 0 else 17, own=own))
        renew(cluster, node)
        time.sleep(1.5)
    body = get_engine(cluster, namespace, "coder")
    assert "relaunches" not in body["status"], body["status"].get("relaunches")
    assert body["status"]["plan"]["engineArgs"] == before["engineArgs"]

    # The tenant leaves for good: once the readings agree, exactly one relaunch.
    write_board(cluster, node, discrete_status(24, 0.5, own=own))
    for _ in range(READINGS + 1):
        renew(cluster, node)
        time.sleep(1.5)
    body = wait_for(
        "one relaunch",
        lambda: (b := get_engine(cluster, namespace, "coder"))["status"].get("relaunches") and b,
        log=operator.log,
    )
    after = body["status"]["plan"]
    assert after["mindsGrantable"] > before["mindsGrantable"]
    body = wait_for(
        "Ready after the relaunch",
        is_condition(cluster, namespace, "coder", "Ready", "True"),
        log=operator.log,
    )
    # The relaunched engine's bytes show up on the board, which then moves a little: more
    # readings, no second relaunch.
    own = own_device_bytes(body)
    for i in range(8):
        write_board(cluster, node, discrete_status(24, 0.5 if i < 4 else 0.7, own=own))
        renew(cluster, node)
        time.sleep(1)
    body = get_engine(cluster, namespace, "coder")
    assert body["status"]["relaunches"]["count"] == 1
    assert condition(body, "Ready")["status"] == "True"  # type: ignore[index]
    deployment = cluster.get_json("deployment", "coder", "-n", namespace)
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--") + 1 :] == body["status"]["plan"]["engineArgs"]
    replica_sets = cluster.get_json(
        "replicasets", "-n", namespace, "-l", "continuum.dev/engine=coder"
    )
    assert len(replica_sets["items"]) == 2  # the first launch and one relaunch
    assert [e["reason"] for e in events(cluster, namespace, "coder")].count("Relaunching") == 1
    assert (
        operator.metric("continuum_engine_relaunches_total", namespace=namespace, engine="coder")
        == 1
    )
    assert (
        operator.metric("continuum_engine_replans_weighed_total", outcome="GatheringEvidence") > 0
    )


def test_a_stale_board_takes_no_new_plans_until_its_lease_is_renewed(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    node = gpu_node(cluster, tag, discrete_status(80, 0.5), fresh=False)
    cluster.apply(engine("coder", tag), "-n", namespace)
    body = wait_for(
        "Unschedulable",
        is_condition(cluster, namespace, "coder", "Unschedulable", "True"),
        log=operator.log,
    )
    c = condition(body, "Unschedulable")
    assert c is not None and c["reason"] == "NoFreshBoard"
    assert node in c["message"] and "stale" in c["message"]
    assert "placement" not in body["status"]
    found = cluster.kubectl("get", "deployment", "coder", "-n", namespace, check=False)
    assert found.returncode != 0  # nothing runs on a stale board
    renew(cluster, node)
    body = wait_for(
        "placed once the Lease is renewed",
        is_condition(cluster, namespace, "coder", "Planned", "True"),
        log=operator.log,
    )
    assert body["status"]["placement"]["node"] == node


def test_an_unschedulable_engine_says_why_node_by_node(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    small = gpu_node(cluster, tag, discrete_status(8, 0.5, host_gib=16))
    cluster.apply(
        engine("huge", tag, contextTokensPerMind=131072, minds={"min": 16, "max": 16}),
        "-n",
        namespace,
    )
    body = wait_for(
        "Unschedulable",
        is_condition(cluster, namespace, "huge", "Unschedulable", "True"),
        log=operator.log,
    )
    c = condition(body, "Unschedulable")
    assert c is not None and c["reason"] == "InsufficientMemory"
    assert small in c["message"] and "Lower spec.minds.min" in c["message"]
    wait_for(
        "a Warning event",
        lambda: any(
            e["type"] == "Warning" and e["reason"] == "InsufficientMemory"
            for e in events(cluster, namespace, "huge")
        ),
        log=operator.log,
    )
    described = cluster.kubectl("describe", "engine", "huge", "-n", namespace).stdout
    assert "InsufficientMemory" in described


def test_an_assumed_lease_whose_pod_never_starts_is_released(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    # The Node has too little memory for the pod's Guaranteed limit: the scheduler never binds it.
    node = gpu_node(cluster, tag, discrete_status(80, 0.5), memory="256Mi")
    cluster.apply(engine("coder", tag), "-n", namespace)
    wait_for(
        "placement", is_condition(cluster, namespace, "coder", "Planned", "True"), log=operator.log
    )
    body = wait_for(
        "the lease released",
        is_condition(cluster, namespace, "coder", "Unschedulable", "True"),
        timeout=POD_START_TIMEOUT + 40,
        log=operator.log,
    )
    assert "placement" not in body["status"]
    c = condition(body, "Unschedulable")
    assert c is not None and c["reason"] == "PodNeverStarted" and node in c["message"]
    wait_for(
        "the PodNeverStarted event",
        lambda: any(e["reason"] == "PodNeverStarted" for e in events(cluster, namespace, "coder")),
        log=operator.log,
    )
    wait_for(
        "the Deployment removed",
        lambda: (
            cluster.kubectl("get", "deployment", "coder", "-n", namespace, check=False).returncode
            != 0
        ),
        log=operator.log,
    )


def test_an_engine_on_an_unknown_mode_node_says_its_device_is_ungoverned(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    status = {
        "memoryMode": "unknown",
        "memoryModeReason": "no GPU backend reported",
        "pools": [{"kind": "host", "capacityBytes": 64 * GiB, "usedBytes": 4 * GiB}],
    }
    gpu_node(cluster, tag, status)
    cluster.apply(engine("coder", tag), "-n", namespace)
    body = wait_for(
        "MemoryModeUnknown",
        is_condition(cluster, namespace, "coder", "MemoryModeUnknown", "True"),
        log=operator.log,
    )
    assert body["status"]["plan"]["governed"] is False
    assert (
        operator.metric("continuum_engine_memory_mode_unknown", namespace=namespace, engine="coder")
        == 1
    )
    assert body["status"]["plan"]["layersOnDevice"] == 0
    wait_for(
        "the MemoryModeUnknown event",
        lambda: any(
            e["reason"] == "NoMemoryModeReported" for e in events(cluster, namespace, "coder")
        ),
        log=operator.log,
    )


def test_a_spec_the_schema_admits_but_the_plan_cannot_read_gets_a_condition(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    bad = engine("bad", tag)
    bad["spec"]["model"]["facts"]["layerBytes"] = [1, 2, 3]  # the model has 32 layers
    cluster.apply(bad, "-n", namespace)
    body = wait_for(
        "InvalidSpec", is_condition(cluster, namespace, "bad", "Planned", "False"), log=operator.log
    )
    c = condition(body, "Planned")
    assert c is not None and c["reason"] == "InvalidSpec"
    assert c["message"].startswith("spec.model.facts.layerBytes:")


def _invalid_examples() -> list[Path]:
    return sorted(INVALID.glob("*.yaml"))


def _rejected_at(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# rejected-at:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"{path} has no '# rejected-at:' line")


@pytest.mark.parametrize("path", _invalid_examples(), ids=lambda p: p.stem)
def test_an_invalid_spec_is_refused_by_the_api_server_and_by_plan_at_the_same_field(
    cluster: Cluster, crds: None, namespace: str, path: Path
) -> None:
    field = _rejected_at(path)
    server = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", str(path), check=False
    )
    assert server.returncode != 0
    assert field in server.stderr, server.stderr
    offline = subprocess.run(
        [sys.executable, "-m", "continuum_operator.cli", "plan",
         "--board", str(ROOT / "examples" / "boards" / "h200-discrete.yaml"),
         "--engine", str(path)],
        capture_output=True, text=True, env={**os.environ}, check=False,
    )  # fmt: skip
    assert offline.returncode == 2
    assert f"{path}: {field}:" in offline.stderr, offline.stderr


def test_an_engine_with_only_a_model_source_has_its_facts_read_by_a_job_on_its_nodes(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    gpu_node(cluster, tag, discrete_status(80, 0.5))
    body = engine("sourced", tag)
    del body["spec"]["model"]["facts"]
    body["spec"]["model"]["source"] = {"kind": "pvc", "claimName": "models", "path": "q4.gguf"}
    body["spec"]["model"]["sha256"] = "ab" * 32
    cluster.apply(body, "-n", namespace)
    engine_now = wait_for(
        "FactsPending",
        is_condition(cluster, namespace, "sourced", "Planned", "False"),
        log=operator.log,
    )
    c = condition(engine_now, "Planned")
    assert c is not None and c["reason"] == "FactsPending"
    jobs = wait_for(
        "the facts Job",
        lambda: cluster.get_json("jobs", "-n", namespace, "-l", "continuum.dev/facts-for=sourced")[
            "items"
        ],
        log=operator.log,
    )
    pod = jobs[0]["spec"]["template"]["spec"]
    # The Job hashes the file before it reads its facts: a file of another digest is refused.
    assert pod["containers"][0]["command"] == [
        "continuum",
        "facts",
        "/models/q4.gguf",
        "-o",
        "json",
        "--expect-sha256",
        "ab" * 32,
    ]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "models"
    assert pod["nodeSelector"] == {"e2e-tag": tag}
    assert jobs[0]["metadata"]["ownerReferences"][0]["name"] == "sourced"
    assert "placement" not in engine_now["status"]


def test_a_spec_change_is_applied_at_once_by_one_relaunch(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    gpu_node(cluster, tag, discrete_status(80, 0.5))
    cluster.apply(engine("coder", tag), "-n", namespace)
    wait_for("Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log)
    cluster.kubectl(
        "patch", "engine", "coder", "-n", namespace, "--type=merge",
        "-p", json.dumps({"spec": {"minds": {"min": 1, "max": 2}}}),
    )  # fmt: skip

    def relaunched() -> Any:
        body = get_engine(cluster, namespace, "coder")
        plan = body["status"]["plan"]
        return body if plan["mindsGrantable"] == 2 and plan.get("specGeneration") == 2 else None

    body = wait_for("the new spec planned", relaunched, timeout=30, log=operator.log)
    assert body["status"]["relaunches"]["count"] == 1
    wait_for("Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log)
    deployment = cluster.get_json("deployment", "coder", "-n", namespace)
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[command.index("--parallel") + 1] == "2"


def test_deleting_an_engine_removes_what_the_operator_made_for_it(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    gpu_node(cluster, tag, discrete_status(80, 0.5))
    cluster.apply(engine("coder", tag), "-n", namespace)
    wait_for("Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log)
    cluster.kubectl("delete", "engine", "coder", "-n", namespace, "--wait=true")

    def gone() -> bool:
        left = cluster.kubectl(
            "get", "deployments,services,serviceaccounts,roles,rolebindings", "-n", namespace,
            "-l", "continuum.dev/engine=coder", "-o", "name",
        ).stdout.strip()  # fmt: skip
        return not left

    # The garbage collector of kube-controller-manager does this, once its caches are warm.
    wait_for("the owned objects garbage-collected", gone, timeout=150, log=operator.log)


def test_the_plans_estimate_error_against_the_runtimes_receipt_is_exported(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    """docs/design.md rule 5 in the operator's registry: a receipt in status.runtime (written as
    the engine runtime writes it) of the plan's own launch gives (planned - allocated) /
    allocated per side; a receipt of another launch (the engine not relaunched yet) none."""
    gpu_node(cluster, tag, discrete_status(80, 0.5))
    cluster.apply(engine("coder", tag), "-n", namespace)
    body = wait_for(
        "Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log
    )
    plan = body["status"]["plan"]
    planned = {
        side: sum(int(plan["bytes"][side][k]) for k in ("weights", "kv", "compute"))
        for side in ("device", "host")
    }
    assert planned["device"] > 0 and planned["host"] > 0
    allocated = planned["device"] * 4 // 5  # the plan over-reserved the device by a quarter

    def runtime(layers: int) -> str:
        receipt = {
            "kind": "Receipt",
            "modelSha256": "0" * 64,
            "contextTokens": plan["poolTokens"],
            "kvCacheType": plan["kvCacheType"],
            "placement": {"layersOnDevice": layers, "gpus": 1},
            "llamaBuild": "6869 (e2e)",
            "parallel": plan["mindsGrantable"],
            "buffers": [
                {"device": "CUDA0", "kind": "model", "bytes": allocated},
                {"device": "CPU_Mapped", "kind": "model", "bytes": planned["host"]},
            ],
        }
        return json.dumps({"status": {"runtime": {"receipts": [receipt]}}})

    labels = {"namespace": namespace, "engine": "coder"}
    name = "continuum_engine_plan_estimate_error_ratio"
    cluster.kubectl(
        "patch", "engine", "coder", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", runtime(plan["layersOnDevice"]),
    )  # fmt: skip
    expected = (planned["device"] - allocated) / allocated
    wait_for(
        "the device's estimate error",
        lambda: scrape_metric(operator.metrics_url, name, pool="device", **labels) == expected,
        log=operator.log,
    )
    assert scrape_metric(operator.metrics_url, name, pool="host", **labels) == 0.0

    # A receipt of another launch says nothing of this plan: the series goes.
    cluster.kubectl(
        "patch", "engine", "coder", "-n", namespace, "--subresource=status", "--type=merge",
        "-p", runtime(plan["layersOnDevice"] - 1),
    )  # fmt: skip
    wait_for(
        "no estimate error for another launch",
        lambda: scrape_metric(operator.metrics_url, name, pool="device", **labels) is None,
        log=operator.log,
    )
