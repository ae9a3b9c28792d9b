"""Runtime truth (issue 21) on the real API server, KWOK nodes, `continuum operator` as a
subprocess: what the engine runtime writes to `status.runtime` (as `continuum engine` writes it;
KWOK runs no container) reaches the operator's next plan, conditions and metrics; the pod's CPUs
follow the plan and the node's cores.

What needs a real pod (a replaced model file refused by the runtime itself, llama-server's
thread count seen in its process, a crash loop stopped) is in
tests/unit/kube/engines/test_runtime_truth.py against a stand-in llama-server, and on a real node in
the node's own tests.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from continuum_operator.core.receipts import LOG_RESOLUTION_BYTES
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ANNOTATION
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
from tests.support.operator_process import Operator, engine, operator, tag
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

# Fixtures, used by name: the CRDs, the operator that places engines (short timings), a tag
# per test.
__all__ = ["crds", "operator", "tag"]

SHA = "ab" * 32
BUILD = "6869 (e2e)"
GiB = 2**30


def patch_runtime(cluster: Cluster, ns: str, name: str, runtime: dict[str, Any]) -> None:
    cluster.kubectl(
        "patch", "engine", name, "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"runtime": runtime}}),
    )  # fmt: skip


def launch_of(cluster: Cluster, ns: str, name: str) -> str:
    dep = cluster.get_json("deployment", name, "-n", ns)
    return str(dep["metadata"]["annotations"][LAUNCH_ANNOTATION])


def named_engine(label: str, **spec: Any) -> dict[str, Any]:
    body = engine("coder", label, **spec)
    body["spec"]["model"]["sha256"] = SHA
    return body


def test_a_receipt_in_status_runtime_makes_the_next_plans_bytes_the_receipts(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    gpu_node(cluster, tag, discrete_status(80, 0.5))
    cluster.apply(named_engine(tag), "-n", namespace)
    body = wait_for(
        "Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log
    )
    plan = body["status"]["plan"]
    assert plan["source"] == "estimate"
    launch = launch_of(cluster, namespace, "coder")
    dev, host = plan["bytes"]["device"], plan["bytes"]["host"]
    buffers = [
        {"device": "CUDA0", "kind": "model", "bytes": dev["weights"] * 9 // 10},
        {"device": "CUDA0", "kind": "kv", "bytes": dev["kv"] * 9 // 10},
        {"device": "CUDA0", "kind": "compute", "bytes": dev["compute"] // 2},
        {"device": "CPU_Mapped", "kind": "model", "bytes": host["weights"]},
        {"device": "CPU", "kind": "compute", "bytes": host["compute"] // 3},
    ]
    receipt = {
        "kind": "Receipt",
        "modelSha256": SHA,
        "contextTokens": plan["poolTokens"],
        "kvCacheType": plan["kvCacheType"],
        "placement": {"layersOnDevice": plan["layersOnDevice"], "gpus": len(plan["gpus"])},
        "llamaBuild": BUILD,
        "parallel": plan["mindsGrantable"],
        "buffers": buffers,
        "source": "e2e: as continuum engine files a load",
    }
    patch_runtime(
        cluster,
        namespace,
        "coder",
        {"phase": "Serving", "ready": True, "receipts": [receipt], "llamaBuild": BUILD,
         "launch": launch, "restarts": 0},
    )  # fmt: skip

    def planned_from_receipt() -> Any:
        found = get_engine(cluster, namespace, "coder")
        return found if found["status"]["plan"].get("source") == "receipt" else None

    body = wait_for("a plan from the receipt", planned_from_receipt, log=operator.log)
    new = body["status"]["plan"]

    def side(device: bool, *kinds: str) -> int:
        return sum(
            b["bytes"] + LOG_RESOLUTION_BYTES
            for b in buffers
            if b["kind"] in kinds and b["device"].startswith("CUDA") == device
        )

    assert new["bytes"]["device"]["weights"] == side(True, "model")
    assert new["bytes"]["device"]["kv"] == side(True, "kv")
    assert new["bytes"]["device"]["compute"] == side(True, "compute", "output")
    assert new["bytes"]["host"]["weights"] == side(False, "model")
    assert new["bytes"]["host"]["compute"] == side(False, "compute", "output")
    assert new["receipt"]["modelSha256"] == SHA and new["engineArgs"] == plan["engineArgs"]
    # The lease is the plan's; the running launch was re-charged, not relaunched.
    pools = {p["pool"]: p["bytes"] for p in body["status"]["placement"]["pools"]}
    assert pools == {c["pool"]: c["bytes"] for c in new["charges"]}
    assert pools["device/0"] < {c["pool"]: c["bytes"] for c in plan["charges"]}["device/0"]
    assert launch_of(cluster, namespace, "coder") == launch
    assert "relaunches" not in body["status"]
    # llama-server restarts (its report has no receipt for a while): the plan keeps its receipt.
    patch_runtime(cluster, namespace, "coder", {"phase": "Restarting", "receipts": []})
    time.sleep(3)  # three resyncs
    assert get_engine(cluster, namespace, "coder")["status"]["plan"]["source"] == "receipt"


def test_the_runtimes_report_of_the_current_launch_sets_ready_degraded_and_the_metric(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    gpu_node(cluster, tag, discrete_status(80, 0.5))
    cluster.apply(named_engine(tag), "-n", namespace)
    wait_for("Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log)
    launch = launch_of(cluster, namespace, "coder")
    labels = {"namespace": namespace, "engine": "coder", "cause": "Crashed"}
    patch_runtime(cluster, namespace, "coder", {"phase": "Serving", "restarts": 0,
                                                "launch": launch})  # fmt: skip
    wait_for(
        "the baseline read",
        lambda: "restarts" in get_engine(cluster, namespace, "coder")["status"]["runtime"],
    )
    time.sleep(2)
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    line = "llama_model_load: error loading model: tensor data is not within file bounds"
    patch_runtime(
        cluster,
        namespace,
        "coder",
        {"phase": "Serving", "restarts": 3, "launch": launch,
         "lastExit": {"code": 1, "at": at, "line": line}},
    )  # fmt: skip
    body = wait_for(
        "Degraded EngineRestarted",
        lambda: (
            (c := condition(get_engine(cluster, namespace, "coder"), "Degraded")) is not None
            and c["reason"] == "EngineRestarted"
            and c
        ),
        log=operator.log,
    )
    assert line in body["message"]
    wait_for("3 crashed relaunches", lambda: operator.metric(
        "continuum_engine_relaunches_total", **labels) == 3, log=operator.log)  # fmt: skip
    mismatch = f"model file /models/m.gguf has sha256 {'ef' * 32}, but ... {SHA}"
    patch_runtime(cluster, namespace, "coder", {"phase": "ModelMismatch", "message": mismatch})
    ready = wait_for(
        "Ready False ModelDigestMismatch",
        lambda: (
            (c := condition(get_engine(cluster, namespace, "coder"), "Ready")) is not None
            and c["reason"] == "ModelDigestMismatch"
            and c
        ),
        log=operator.log,
    )
    assert ready["status"] == "False" and "ef" * 32 in ready["message"] and SHA in ready["message"]


def test_an_engine_with_its_layers_on_the_host_gets_cpus_from_the_nodes_cores(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    gpu_node(cluster, tag, discrete_status(80, 0.5))  # KWOK's node: 32 allocatable CPUs
    cluster.apply(named_engine(tag, offload="none"), "-n", namespace)
    wait_for("Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log)
    dep = cluster.get_json("deployment", "coder", "-n", namespace)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    # Every layer on the host: half the node's 32 CPUs (--engine-cpu-share 0.5), whole.
    assert container["resources"]["limits"]["cpu"] == "16"
    assert container["resources"]["requests"] == container["resources"]["limits"]
    command = container["command"]
    assert command[command.index("--threads") + 1] == "16"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pods = cluster.get_json("pods", "-n", namespace, "-l", "continuum.dev/engine=coder")["items"]
    assert [p["status"]["qosClass"] for p in pods] == ["Guaranteed"]


def two_gpu_status(used: tuple[int, int]) -> dict[str, Any]:
    """A two-GPU board; `used` is each GPU's measured bytes."""
    return {
        "memoryMode": "discrete",
        "memoryModeReason": "e2e",
        "pools": [
            {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 8 * GiB},
            *(
                {"kind": "device", "device": i, "capacityBytes": 80 * GiB, "usedBytes": n}
                for i, n in enumerate(used)
            ),
        ],
        "gpus": [{"index": 0, "name": "e2e GPU"}, {"index": 1, "name": "e2e GPU"}],
    }


def test_a_gpu_the_agent_finds_the_engine_on_recharges_its_lease_without_a_relaunch(
    cluster: Cluster, operator: Operator, namespace: str, tag: str
) -> None:
    """`--gpu-claims device-plugin` (the default): the plan charged device/0, the agent's board
    says the engine's process runs on GPU 1 (as the device plugin may choose); the lease moves
    to device/1 and the pod stays as it is."""
    node = f"{tag}-{uuid.uuid4().hex[:4]}"
    cluster.create_fake_node(node, capacity={"nvidia.com/gpu": "2"}, labels={"e2e-tag": tag})
    write_board(cluster, node, two_gpu_status((GiB // 2, GiB // 2)))
    renew(cluster, node)
    cluster.apply(engine("coder", tag), "-n", namespace)
    body = wait_for(
        "Ready", is_condition(cluster, namespace, "coder", "Ready", "True"), log=operator.log
    )
    assert body["status"]["plan"]["gpus"] == [0]
    pools = {p["pool"]: p["bytes"] for p in body["status"]["placement"]["pools"]}
    assert set(pools) == {"host", "device/0"}
    launch = launch_of(cluster, namespace, "coder")
    own = own_device_bytes(body)
    seen = two_gpu_status((GiB // 2, GiB // 2 + own))
    seen["consumers"] = [{"kind": "Engine", "namespace": namespace, "name": "coder",
                          "pool": "device", "device": 1, "usedBytes": own}]  # fmt: skip
    seen["consumerGpus"] = [{"kind": "Engine", "namespace": namespace, "name": "coder",
                             "gpus": [1]}]  # fmt: skip
    write_board(cluster, node, seen)
    renew(cluster, node)

    def moved() -> dict[str, Any] | None:
        got = get_engine(cluster, namespace, "coder")
        held = {p["pool"] for p in got["status"]["placement"]["pools"]}
        return got if held == {"host", "device/1"} else None

    body = wait_for("the lease on device/1", moved, log=operator.log)
    status = body["status"]
    assert {p["pool"]: p["bytes"] for p in status["placement"]["pools"]} == {
        "host": pools["host"], "device/1": pools["device/0"]
    }  # fmt: skip
    assert status["plan"]["gpus"] == [1] and status["placement"]["gpus"] == [1]
    assert launch_of(cluster, namespace, "coder") == launch  # not relaunched
    assert (status.get("relaunches") or {}).get("count", 0) == 0
    assert condition(body, "Ready")["status"] == "True"  # type: ignore[index]
    wait_for(
        "the GpuMismatch event",
        lambda: "GpuMismatch" in {e["reason"] for e in events(cluster, namespace, "coder")},
        log=operator.log,
    )
