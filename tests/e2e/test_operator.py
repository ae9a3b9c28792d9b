"""The operator on the real control plane: `continuum operator` as a subprocess, KWOK nodes with
NodeBoards and the agent's Leases written by the test as the node agent would (beside the
kubelet's Lease, never it: `core.heartbeat`), Engines applied with kubectl. What a user sees:
plans and conditions in status, the Deployment that runs the plan, relaunches that do not storm,
stale boards that take no plans, and clear refusals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from continuum_operator.core.heartbeat import (
    agent_lease_metadata,
)
from continuum_operator.kube.workloads.facts_job import source_key
from continuum_operator.manifests import parse
from continuum_operator.model.engine import Engine
from tests.e2e.conftest import ROOT, Cluster
from tests.e2e.llama_fixtures import free_port

pytestmark = pytest.mark.e2e

GiB = 2**30
POD_START_TIMEOUT = 12
COOLDOWN = 900
READINGS = 3
INVALID = ROOT / "examples" / "invalid"
# This module's operator serves only this module's Engines: Engines other tests leave behind
# (their namespaces are deleted without waiting) never land on these tests' nodes.
RUN_LABEL = ("continuum.dev/e2e-run", uuid.uuid4().hex[:10])


# --------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=established", "--timeout=60s", "-f", str(ROOT / "crds")
    )


@dataclass(frozen=True)
class Operator:
    log: Path
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the operator's /metrics (0 when the series is absent)."""
        value = scrape_metric(self.metrics_url, name, **labels)
        return 0.0 if value is None else value


def scrape_metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus endpoint, or None when the series is absent."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, crds: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """`continuum operator` with short timings. Stopped (SIGTERM) at teardown."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    port = free_port()
    cmd = [
        sys.executable, "-m", "continuum_operator.cli", "operator",
        "--kubeconfig", str(cluster.kubeconfig),
        "--resync", "1",
        "--pod-start-timeout", str(POD_START_TIMEOUT),
        "--backoff", "600",
        "--damping-readings", str(READINGS),
        "--damping-min-gain", "0.1",
        "--relaunch-cooldown", str(COOLDOWN),
        "--engine-image", "continuum-engine:e2e",
        "--metrics-port", str(port),
        "--engine-selector", "=".join(RUN_LABEL),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env)
    try:
        time.sleep(3)  # a bad flag exits within the imports' time
        if proc.poll() is not None:
            pytest.fail(f"continuum operator exited at once:\n{log.read_text()}", pytrace=False)
        yield Operator(log, f"http://127.0.0.1:{port}/metrics")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def tag(request: pytest.FixtureRequest) -> str:
    """A label value that keeps this test's engines on this test's nodes."""
    return f"t{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------------------------
# helpers: nodes, boards and Leases as the node agent would write them


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
) -> str:
    name = f"{tag}-{uuid.uuid4().hex[:4]}"
    cluster.create_fake_node(
        name, capacity={"nvidia.com/gpu": "1", "memory": memory}, labels={"e2e-tag": tag}
    )
    write_board(cluster, name, status)
    if fresh:
        renew(cluster, name)
    else:
        renew(cluster, name, renew_time="2020-01-01T00:00:00.000000Z", ttl=40)
    return name


def engine(name: str, tag: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {
            "facts": {
                "layers": 32,
                "layerBytes": 232783872,
                "inputBytes": 532676608,
                "outputBytes": 532676608,
                "kvBytesPerTokenPerLayer": 4096,
                "computeBytes": 268435456,
            }
        },
        "contextTokensPerMind": 16384,
        "minds": {"min": 1, "max": 8},
        "placement": {"nodeSelector": {"e2e-tag": tag}},
    }
    body.update(spec)
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "Engine",
            "metadata": {"name": name, "labels": dict([RUN_LABEL])}, "spec": body}  # fmt: skip


def wait_for(
    what: str, probe: Callable[[], Any], timeout: float = 60, log: Path | None = None
) -> Any:
    """Poll until `probe` returns something truthy; fail with the operator's log tail."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    tail = "\n".join(log.read_text().splitlines()[-40:]) if log and log.exists() else ""
    pytest.fail(f"timed out waiting for {what}; last: {last!r}\noperator log:\n{tail}")


def facts_read_from_file(cluster: Cluster, ns: str, name: str) -> None:
    """The Engine's status as its facts Job leaves it: KWOK runs no container, so a test on
    KWOK nodes writes what the Job would have read (the Engine's inline facts, which such a
    test takes from the file or stands in for it). With a source, only the file's facts are
    planned from (docs/security.md)."""
    body = cluster.get_json("engine", name, "-n", ns)
    key = source_key(parse(Engine, body, f"Engine {ns}/{name}"))
    read = {"source": key, "facts": body["spec"]["model"]["facts"]}
    patch = json.dumps({"status": {"modelFacts": read}})
    cluster.kubectl(
        "patch", "engine", name, "-n", ns, "--subresource=status", "--type=merge", "-p", patch
    )


def get_engine(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.get_json("engine", name, "-n", ns)
    return found


def condition(body: dict[str, Any], type_: str) -> dict[str, Any] | None:
    for c in (body.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return None


def is_condition(
    cluster: Cluster, ns: str, name: str, type_: str, status: str
) -> Callable[[], Any]:
    def probe() -> Any:
        body = get_engine(cluster, ns, name)
        c = condition(body, type_)
        return body if c is not None and c["status"] == status else None

    return probe


def events(cluster: Cluster, ns: str, name: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json(
        "events", "-n", ns, "--field-selector", f"involvedObject.name={name}"
    )["items"]
    return items


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


def own_device_bytes(body: dict[str, Any]) -> int:
    device = body["status"]["plan"]["bytes"]["device"]
    return int(device["weights"] + device["kv"] + device["compute"])


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
