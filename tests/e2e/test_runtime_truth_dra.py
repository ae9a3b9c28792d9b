"""The GPU charged is the GPU the pod gets (issue 21), with Dynamic Resource Allocation on the real
API server and scheduler: two GPUs of a KWOK node published as ResourceSlices the way NVIDIA's DRA
driver publishes them (driver `gpu.nvidia.com`; each device the attributes of its
cmd/gpu-kubelet-plugin/deviceinfo.go `GpuInfo.GetDevice` since v25.8: `type`, `uuid`,
`productName`, `brand`, `architecture`, `cudaComputeCapability`, `driverVersion`,
`cudaDriverVersion`, `pcieBusID`, its PCIe root; HEAD adds `addressingMode`; no `index`), its
DeviceClass, and `continuum operator --gpu-claims dra`. The plan charges the GPU with room
(`device/1`); the engine's claim is allocated that device (the UUID the node's board reports
for it), not the other.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cluster import Cluster
from tests.support.crds import crds
from tests.support.engine_status import is_condition
from tests.support.kwok_nodes import renew, write_board
from tests.support.local_http import free_port
from tests.support.operator_process import RUN_LABEL, Operator, engine, stop, tag
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

GiB = 2**30
DRIVER = "gpu.nvidia.com"
#: The GPUs' UUIDs, as NVML gives them to the agent (its board) and to the driver (its slice).
GPU_UUIDS = [f"GPU-{uuid.uuid4()}" for _ in range(2)]
__all__ = ["crds", "tag"]  # fixtures, used by name


@pytest.fixture(scope="module")
def dra_operator(
    cluster: Cluster, crds: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """`continuum operator --gpu-claims dra`, as tests/support/operator_process.py's `operator`
    fixture, with short timings."""
    log = tmp_path_factory.mktemp("operator-dra") / "operator.log"
    port = free_port()
    cmd = [
        sys.executable, "-m", "continuum_operator.cli", "operator",
        "--kubeconfig", str(cluster.kubeconfig), "--resync", "1",
        "--engine-image", "continuum-engine:e2e", "--metrics-port", str(port),
        "--engine-selector", "=".join(RUN_LABEL), "--gpu-claims", "dra",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env)
    try:
        time.sleep(3)
        if proc.poll() is not None:
            pytest.fail(f"continuum operator exited at once:\n{log.read_text()}", pytrace=False)
        yield Operator(proc, log, f"http://127.0.0.1:{port}/metrics")
    finally:
        stop(proc)


def two_gpu_board(used_gib: tuple[float, float]) -> dict[str, Any]:
    return {
        "memoryMode": "discrete",
        "memoryModeReason": "e2e",
        "pools": [
            {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 8 * GiB},
            *(
                {"kind": "device", "device": i, "capacityBytes": 80 * GiB,
                 "usedBytes": int(used * GiB)}
                for i, used in enumerate(used_gib)
            ),
        ],
        "gpus": [
            {"index": i, "name": "NVIDIA H100 80GB HBM3", "uuid": GPU_UUIDS[i]} for i in range(2)
        ],
    }  # fmt: skip


def publish_gpus(cluster: Cluster, node: str) -> None:
    """The node's two GPUs as NVIDIA's DRA driver publishes them, and its DeviceClass."""
    cluster.apply(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {
                "selectors": [
                    {
                        "cel": {
                            "expression": f'device.driver == "{DRIVER}" && '
                            f'device.attributes["{DRIVER}"].type == "gpu"'
                        }
                    }
                ]
            },
        }
    )
    devices = [
        {
            "name": f"gpu-{i}",  # the GPU's minor number (/dev/nvidia<i>)
            "attributes": {
                "type": {"string": "gpu"},
                "uuid": {"string": GPU_UUIDS[i]},
                "productName": {"string": "NVIDIA H100 80GB HBM3"},
                "brand": {"string": "Nvidia"},
                "architecture": {"string": "Hopper"},
                "cudaComputeCapability": {"version": "9.0.0"},
                "driverVersion": {"version": "580.95.5"},
                "cudaDriverVersion": {"version": "13.0.0"},
                "pcieBusID": {"string": f"0000:{0x18 + i:02x}:00.0"},
                "resource.kubernetes.io/pcieRoot": {"string": f"pci0000:{0x10 + i:02x}"},
            },
            "capacity": {"memory": {"value": "80Gi"}},
        }
        for i in range(2)
    ]
    cluster.apply(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceSlice",
            "metadata": {"name": f"{node}-{DRIVER}"},
            "spec": {
                "driver": DRIVER,
                "nodeName": node,
                "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                "devices": devices,
            },
        }
    )


def test_the_scheduler_allocates_the_engines_claim_to_the_gpu_the_plan_charged(
    cluster: Cluster, dra_operator: Operator, namespace: str, tag: str
) -> None:
    node = f"{tag}-{uuid.uuid4().hex[:4]}"
    # No nvidia.com/gpu on the node: its GPUs are DRA devices only.
    cluster.create_fake_node(node, capacity={"nvidia.com/gpu": "0"}, labels={"e2e-tag": tag})
    publish_gpus(cluster, node)
    write_board(cluster, node, two_gpu_board((60, 0.5)))  # GPU 0 is busy: the plan takes GPU 1
    renew(cluster, node)
    cluster.apply(engine("coder", tag), "-n", namespace)
    body = wait_for(
        "Ready", is_condition(cluster, namespace, "coder", "Ready", "True"),
        timeout=90, log=dra_operator.log,
    )  # fmt: skip
    assert body["status"]["plan"]["gpus"] == [1]
    assert {p["pool"] for p in body["status"]["placement"]["pools"]} == {"host", "device/1"}
    dep = cluster.get_json("deployment", "coder", "-n", namespace)
    pod_spec = dep["spec"]["template"]["spec"]
    [claim_ref] = pod_spec["resourceClaims"]
    assert "nvidia.com/gpu" not in pod_spec["containers"][0]["resources"]["limits"]
    claims = cluster.get_json("resourceclaims", "-n", namespace)["items"]
    [claim] = [c for c in claims if c["metadata"]["name"].startswith("coder-")]
    [result] = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"], result["device"]) == (DRIVER, node, "gpu-1")
    assert claim_ref["resourceClaimTemplateName"] == "coder-gpu-1"
