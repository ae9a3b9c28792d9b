"""The node agent against a real API server: its NodeBoard status and its node's Lease written.

Runs `continuum agent --once` as a process for a KWOK node (this machine's own readings, no
NVIDIA here: an unknown board with a governed host pool), then a recorded 8-GPU machine through
the agent's own code in-process, so that a rich board (device pools, consumers, cap mechanisms)
is checked against the generated CRD schema by the API server itself.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from continuum_operator.agent import nvml
from continuum_operator.agent.run import Agent, AgentSettings
from continuum_operator.agent.writer import AgentApi, connect
from continuum_operator.core.heartbeat import LEASE_NAMESPACE, lease_name, node_of_lease
from continuum_operator.kube.base.kernel import KernelSettings
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.nodes.placed_pods import PlacedPods
from continuum_operator.kube.state.cache import Cache
from continuum_operator.model.board import NodeBoard, NodeBoardStatus
from continuum_operator.testing.fake_nvml import FakeNvml
from tests.support.builders import ROOT
from tests.support.cluster import Cluster
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

FIXTURES = ROOT / "tests" / "fixtures" / "probes"


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/nodeboards.continuum.dev"
    )


def run_agent(cluster: Cluster, node: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "continuum_operator.cli", "agent", "--once",
         "--node-name", node, "--kubeconfig", str(cluster.kubeconfig), *extra],
        capture_output=True, text=True, timeout=120, check=False, env=cluster.env,
    )  # fmt: skip


def parse_rfc3339(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_one_cycle_writes_the_board_status_and_the_nodes_lease(
    cluster: Cluster, crds: None, gpu_node: str
) -> None:
    before = datetime.now(UTC) - timedelta(seconds=5)
    first = run_agent(cluster, gpu_node)
    assert first.returncode == 0, first.stderr
    assert "board written" in first.stdout

    board = cluster.get_json("nodeboard", gpu_node)
    status = NodeBoard.model_validate(board).status
    assert status.memory_mode == "unknown"  # no NVIDIA on this machine, never a guess
    assert status.memory_mode_reason.startswith("no NVIDIA: ")
    (host,) = status.pools
    assert host.kind == "host" and host.capacity_bytes > 0 and host.used_bytes is not None
    node_uid = cluster.get_json("node", gpu_node)["metadata"]["uid"]
    assert board["metadata"]["ownerReferences"][0]["uid"] == node_uid

    lease = cluster.get_json("lease", "-n", LEASE_NAMESPACE, lease_name(gpu_node))
    assert lease["spec"]["leaseDurationSeconds"] == 40
    assert lease["spec"]["holderIdentity"].startswith("continuum-agent")
    renewed = parse_rfc3339(lease["spec"]["renewTime"])
    assert renewed >= before
    assert lease["metadata"]["ownerReferences"][0]["uid"] == node_uid
    meta = lease["metadata"]
    assert node_of_lease(meta["name"], meta.get("annotations")) == gpu_node
    # the kubelet's (here KWOK's) own Lease is left alone
    assert lease_name(gpu_node) != gpu_node

    # A second cycle on a quiet node renews the Lease and leaves the board as it was. (The
    # threshold is raised so that other work on this shared machine cannot move the host pool
    # past it between the two runs.)
    version = board["metadata"]["resourceVersion"]
    second = run_agent(cluster, gpu_node, "--threshold-mib", "4096")
    assert second.returncode == 0, second.stderr
    assert "board unchanged" in second.stdout
    assert cluster.get_json("nodeboard", gpu_node)["metadata"]["resourceVersion"] == version
    lease2 = cluster.get_json("lease", "-n", LEASE_NAMESPACE, lease_name(gpu_node))
    assert parse_rfc3339(lease2["spec"]["renewTime"]) > renewed


def test_a_recorded_eight_gpu_node_with_a_placed_engine_lands_on_the_api_server(
    cluster: Cluster, crds: None, gpu_node: str, namespace: str
) -> None:
    doc: dict[str, Any] = json.loads((FIXTURES / "a100x8.json").read_text())
    # An engine pod the operator placed on this node: the operator tells the agent of it in the
    # board's spec (the agent lists no pods).
    engine_pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llama-70b-0",
            "namespace": namespace,
            "labels": {"continuum.dev/engine": "llama-70b"},
        },
        "spec": {
            "nodeName": gpu_node,
            "containers": [{"name": "engine", "image": "example.invalid/engine:0"}],
        },
    }
    cluster.apply(engine_pod)
    pod_uid = cluster.get_json("pod", "-n", namespace, "llama-70b-0")["metadata"]["uid"]
    api = AgentApi(connect(str(cluster.kubeconfig), in_cluster=False), gpu_node, identity="e2e")
    if not cluster.kubectl("get", "nodeboard", gpu_node, "--ignore-not-found", "-o", "name").stdout:
        api.write_board(NodeBoardStatus(), api.node_facts())  # the agent makes its board
    cache = Cache()
    cache.observe_board(cluster.get_json("nodeboard", gpu_node), deleted=False)

    def uids_placed() -> set[str]:
        return {p["uid"] for p in cache.board_placed.get(gpu_node) or []}

    async def publish() -> None:
        # The placed pods as the leader runs them: listed, then watched, the board written as
        # they change. A second engine pod, made after the list, reaches the board by the watch.
        api = await AsyncKubeApi.connect(str(cluster.kubeconfig))
        stop = asyncio.Event()
        placed = PlacedPods(api, cache, KernelSettings(debounce_seconds=0.05))
        task = asyncio.create_task(placed.run(stop))
        try:
            await until(lambda: pod_uid in uids_placed(), timeout=30)
            later = {**engine_pod, "metadata": {**engine_pod["metadata"], "name": "llama-70b-1"}}
            await asyncio.to_thread(cluster.apply, later)
            await until(lambda: len(uids_placed()) == 2, timeout=30)
            await asyncio.to_thread(cluster.kubectl, "delete", "pod", "-n", namespace,
                                    "llama-70b-1", "--grace-period=0", "--force")  # fmt: skip
            await until(lambda: uids_placed() == {pod_uid}, timeout=30)
        finally:
            stop.set()
            await task
            await api.close()

    asyncio.run(publish())
    mine = [p for p in api.placed_pods() or [] if p["uid"] == pod_uid]
    assert mine == [{"uid": pod_uid, "kind": "Engine", "namespace": namespace, "name": "llama-70b"}]

    # The recorded machine's GPU process lives in that pod's cgroup.
    attribution = doc["attribution"]
    attribution["processes"]["7000"]["cgroup"] = f"0::/kubepods.slice/kubepods-pod{pod_uid}.slice"
    attribution["pods"] = [{"uid": pod_uid, "kind": "Engine", "namespace": namespace,
                            "name": "llama-70b", "working_set": 7 * 2**30}]  # fmt: skip

    def capture(*_: Any, **__: Any) -> tuple[dict[str, Any], dict[str, float]]:
        return {**doc, "nvml": nvml.read_raw(FakeNvml(doc["nvml"]))}, {}

    cycle = Agent(AgentSettings(node_name=gpu_node), api, capture=capture).cycle()
    assert cycle.wrote and cycle.renewed

    stored = NodeBoard.model_validate(cluster.get_json("nodeboard", gpu_node)).status
    assert stored == cycle.status
    assert stored.memory_mode == "discrete"
    assert [p.device for p in stored.pools if p.kind == "device"] == list(range(8))
    assert {(c.namespace, c.name) for c in stored.consumers} == {(namespace, "llama-70b")}
    assert [m.mechanism for m in stored.cap_mechanisms] == ["mps"]


def test_the_running_agent_keeps_renewing_the_lease_and_stops_on_sigterm(
    cluster: Cluster, crds: None, gpu_node: str
) -> None:
    agent = subprocess.Popen(
        [sys.executable, "-m", "continuum_operator.cli", "agent", "--node-name", gpu_node,
         "--kubeconfig", str(cluster.kubeconfig), "--interval", "1", "--lease-seconds", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cluster.env,
    )  # fmt: skip
    try:
        seen: set[str] = set()
        deadline = time.monotonic() + 30
        while len(seen) < 3 and time.monotonic() < deadline:
            found = cluster.kubectl(
                "get", "lease", "-n", LEASE_NAMESPACE, lease_name(gpu_node),
                "-o", "jsonpath={.spec.renewTime}", check=False,
            ).stdout  # fmt: skip
            if found:
                seen.add(found)
            time.sleep(0.5)
        assert len(seen) >= 3, f"the Lease was renewed {len(seen)} times in 30 s"
        lease = cluster.get_json("lease", "-n", LEASE_NAMESPACE, lease_name(gpu_node))
        assert lease["spec"]["leaseDurationSeconds"] == 5
        assert cluster.get_json("nodeboard", gpu_node)["status"]["pools"]
    finally:
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=30)
    assert agent.returncode == 0, out


def test_a_lease_namespace_that_does_not_exist_is_a_clear_error(
    cluster: Cluster, crds: None, gpu_node: str
) -> None:
    proc = run_agent(cluster, gpu_node, "--lease-namespace", "no-such-namespace")
    assert proc.returncode == 1
    assert "does namespace no-such-namespace exist?" in proc.stderr
