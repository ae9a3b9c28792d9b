"""The product as a user installs it, run as pods on a real node: `helm install` of the chart with
the images tools/images built, on the kubelet that `tools/cluster node-up` starts beside the KWOK
nodes (containerd, a CNI bridge, kube-proxy, CoreDNS). Checked from outside with kubectl, as a
user would: the operator's pod leads; the agent's pod writes the real node's NodeBoard from psutil
and renews its Lease; an Engine whose model is a file on the node runs its facts Job and its
engine as pods, becomes Ready by its probe and reports receipts through its own ServiceAccount;
a Mind's pod takes a turn at the address in her status; an EmbedLane's pod embeds; a child of a
Mind is mutated by the webhook; `helm uninstall` leaves no Mind stuck and nothing behind.

The tests of this module share one install and run in order (each builds on the one before).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from continuum_operator import yaml_text
from continuum_operator.core.receipts import LOG_RESOLUTION_BYTES
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ANNOTATION
from continuum_operator.testing.mind_pod import mind_pod, service_account
from tests.support.builders import ROOT
from tests.support.cluster import CLUSTER_SCRIPT, Cluster
from tests.support.helm import CHART, find_helm, helm

pytestmark = pytest.mark.e2e

RUN = uuid.uuid4().hex[:6]
RELEASE = f"node{RUN}"
FULLNAME = f"{RELEASE}-continuum"
SELECTOR = ("continuum.dev/e2e-node", RUN)
REAL_NODE_LABEL = {"continuum.dev/real-node": "true"}
# The model on the node's disk, where the admin allows Engines to read
# (engineSources.allowedHostPathPrefixes).
MODEL_DIR = Path("/var/lib/continuum-e2e") / RUN
ENGINE_PODS = "app.kubernetes.io/instance=tiny"
MAX_RESTARTS = 2


def run_script(script: Path, *args: str, env: dict[str, str], timeout: float = 900) -> str:
    proc = subprocess.run(
        [str(script), *args], capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    assert proc.returncode == 0, f"{script.name} {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def image_refs() -> dict[str, str]:
    """NAME=REF lines of tools/images for the working tree as it is (built by `make e2e`)."""
    out = run_script(ROOT / "tools" / "images", "refs", env=dict(os.environ))
    return dict(line.split("=", 1) for line in out.split())


def wait_until(what: str, probe: Any, timeout: float, cluster: Cluster | None = None) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except subprocess.CalledProcessError as e:  # an object not there yet
            last = e
        else:
            if last:
                return last
        time.sleep(1)  # a kubectl a second: ~8% of a core of this 2-core node's
    extra = ""
    if cluster is not None:
        extra = cluster.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last: {last}\n{extra}")


@dataclass
class Install:
    cluster: Cluster
    namespace: str  # the release's
    apps: str  # where the Engine, Minds and lanes live
    node: str
    helm: Path

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, check=check)

    def get(self, *args: str) -> Any:
        return self.cluster.get_json(*args)

    def pods(self, ns: str, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get("pods", "-n", ns, "-l", selector)["items"]
        return items

    def logs(self, ns: str, selector: str) -> str:
        return self.kubectl(
            "logs", "-n", ns, "-l", selector, "--tail=60", "--all-containers", check=False
        ).stdout


@pytest.fixture(scope="module")
def real_node(cluster: Cluster) -> Iterator[str]:
    env = {**cluster.env, "CONTINUUM_CLUSTER_DIR": str(cluster.state_dir)}
    run_script(CLUSTER_SCRIPT, "node-up", env=env, timeout=600)
    node = "continuum-node"
    try:
        yield node
    finally:
        run_script(CLUSTER_SCRIPT, "node-down", env=env, timeout=300)


def tiny_model() -> tuple[Path, str]:
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    MODEL_DIR.chmod(0o755)
    path = MODEL_DIR / "tiny.gguf"
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "continuum"), "model", "tiny", str(path)],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    path.chmod(0o644)
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def values(refs: dict[str, str]) -> dict[str, Any]:
    def image(name: str) -> dict[str, str]:
        repository, _, tag = refs[name].rpartition(":")
        # Nothing is pulled here (no registry): the kubelet finds each image in containerd.
        return {"repository": repository, "tag": tag} | (
            {"pullPolicy": "Never"} if name != "engine" else {}
        )

    return {
        "images": {name: image(name) for name in ("operator", "agent", "engine")},
        "operator": {
            "replicas": 1,
            "nodeSelector": REAL_NODE_LABEL,
            "engineSelector": {SELECTOR[0]: SELECTOR[1]},
            # The node has 2 CPUs: an engine of the default 2 would take them all, and its
            # PriorityClass (above every ordinary pod) preempts whatever stands in the way. On a
            # real cluster the operator and agent run critical, as here. Two restarts of a
            # failing llama-server, not the default 5: the runtime's backoff before the third
            # and later ones (5, 10 and 30 s) is a unit test's (test_runtime_truth); here the
            # flag reaches the engine's pod and the pod stops saying why.
            "extraArgs": ["--engine-cpu-min=1", f"--engine-max-restarts={MAX_RESTARTS}"],
            # A lane's pod of half a CPU beside them (--lane-cpu; 2 by default).
            "laneCpu": "500m",
            "graceSeconds": 10,
            "priorityClassName": "system-cluster-critical",
        },
        "agent": {"nodeSelector": REAL_NODE_LABEL, "priorityClassName": "system-node-critical"},
        "webhook": {"enabled": True},
        "engineSources": {"allowedHostPathPrefixes": [str(MODEL_DIR.parent)]},
    }


@pytest.fixture(scope="module")
def install(
    cluster: Cluster, real_node: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Install]:
    binary = find_helm()
    ns = f"continuum-{RUN}"
    apps = f"apps-{RUN}"
    values_file = tmp_path_factory.mktemp("node") / "values.yaml"
    values_file.write_text(yaml_text.dump(values(image_refs())))
    helm(
        binary, "install", RELEASE, str(CHART), "--namespace", ns, "--create-namespace",
        "-f", str(values_file), "--take-ownership", "--force-conflicts",
        env=cluster.env, timeout=600,
    )  # fmt: skip
    cluster.kubectl("create", "namespace", apps)
    cluster.kubectl("wait", "--for=create", "serviceaccount/default", "-n", apps, "--timeout=60s")
    try:
        yield Install(cluster, ns, apps, real_node, binary)
    finally:
        helm(binary, "uninstall", RELEASE, "-n", ns, "--wait", env=cluster.env, check=False)
        for name in (apps, ns):
            cluster.kubectl(
                "delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False
            )
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))


def engine_body(install: Install, path: Path, sha256: str) -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Engine",
        "metadata": {"name": "tiny", "namespace": install.apps, "labels": dict([SELECTOR])},
        "spec": {
            "model": {"source": {"kind": "hostPath", "path": str(path)}, "sha256": sha256},
            "contextTokensPerMind": 256,
            "minds": {"min": 1, "max": 1},
            "offload": 0,
            "reserveBytes": 0,
            "placement": {"nodeSelector": REAL_NODE_LABEL},
            "allowedNamespaces": [install.apps],
        },
    }


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in body.get("status", {}).get("conditions", []):
        if c.get("type") == type_:
            return dict(c)
    return {}


# --------------------------------------------------------------------------------------------


def test_the_operator_pod_leads_and_the_agent_pod_writes_the_real_nodes_board(
    install: Install,
) -> None:
    ns = install.namespace
    operator = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=operator"
    agent = f"app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component=agent"

    def ready(selector: str) -> list[dict[str, Any]]:
        pods = install.pods(ns, selector)
        return [
            p for p in pods
            if p["spec"].get("nodeName") == install.node
            and any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions", []))
        ]  # fmt: skip

    wait_until(
        "the operator's pod Ready on the real node", lambda: ready(operator), 240, install.cluster
    )
    pod = ready(operator)[0]["metadata"]["name"]
    wait_until(
        "the operator's pod to lead",
        lambda: "leading as" in install.kubectl("logs", "-n", ns, pod).stdout,
        120,
    )
    wait_until("the agent's pod Ready on the real node", lambda: ready(agent), 240, install.cluster)

    def board() -> dict[str, Any]:
        body = install.get("nodeboard", install.node)
        return body if body.get("status", {}).get("pools") else {}

    status = wait_until("the real node's NodeBoard", board, 120, install.cluster)["status"]
    # No GPU here: the agent's psutil probe reports the host pool, governed.
    kinds = {p["kind"] for p in status["pools"]}
    assert "host" in kinds, status
    host = next(p for p in status["pools"] if p["kind"] == "host")
    assert host["capacityBytes"] > 2**30 and 0 < host["usedBytes"] < host["capacityBytes"]
    # The chart mounts the kubelet's root for the agent: the node's disk is a pool of its own,
    # where Engines park contexts on disk (spec.park.tier disk).
    disk = next(p for p in status["pools"] if p["kind"] == "disk")
    assert disk["capacityBytes"] > 2**30 and 0 <= disk["usedBytes"] <= disk["capacityBytes"]


def test_an_engine_from_a_file_on_the_node_runs_as_pods_and_reports_receipts(
    install: Install,
) -> None:
    path, sha256 = tiny_model()
    install.cluster.apply(engine_body(install, path, sha256))

    def facts() -> Any:
        return install.get("engine", "tiny", "-n", install.apps).get("status", {}).get("modelFacts")

    read = wait_until("the facts Job's pod to read the model", facts, 240, install.cluster)
    assert read["facts"]["layers"] == 4, read

    def ready() -> dict[str, Any]:
        body = install.get("engine", "tiny", "-n", install.apps)
        return body if condition(body, "Ready").get("status") == "True" else {}

    body = wait_until("the Engine Ready (its pod's probe)", ready, 300, install.cluster)
    pods = install.pods(install.apps, "app.kubernetes.io/instance=tiny")
    assert pods and all(p["spec"]["nodeName"] == install.node for p in pods), pods
    assert body["status"]["placement"]["node"] == install.node

    def receipts() -> Any:
        runtime = install.get("engine", "tiny", "-n", install.apps)["status"].get("runtime") or {}
        return runtime.get("receipts")

    found = wait_until("receipts in status.runtime, written by the engine's pod", receipts, 180)
    assert all(r["modelSha256"] == sha256 for r in found), found

    # The operator pod tells the agent pod which pods are its engine's (the board's spec), and
    # the agent, which may list no pods, charges the engine pod's memory to the Engine.
    uids = {p["metadata"]["uid"] for p in pods}

    def attributed() -> Any:
        board = install.get("nodeboard", install.node)
        placed = {
            p["uid"]
            for p in (board.get("spec") or {}).get("placed") or []
            if (p["kind"], p["namespace"], p["name"]) == ("Engine", install.apps, "tiny")
        }
        consumers = [
            c
            for c in (board.get("status") or {}).get("consumers") or []
            if (c["kind"], c["namespace"], c["name"]) == ("Engine", install.apps, "tiny")
        ]
        return consumers if uids <= placed and consumers else None  # fmt: skip

    used = wait_until("the agent charging the engine's memory", attributed, 120, install.cluster)
    assert all(c["usedBytes"] > 0 for c in used), used

    # llama.cpp's own account of its threads: the pod's CPUs (1 here, --engine-cpu-min=1).
    cpu = pods[0]["spec"]["containers"][0]["resources"]["limits"]["cpu"]
    log = install.kubectl(
        "logs", "-n", install.apps, pods[0]["metadata"]["name"], "--all-containers"
    ).stdout
    threads = re.search(r"n_threads = (\d+) \(n_threads_batch = (\d+)\)", log)
    assert threads and threads.groups() == (str(cpu), str(cpu)), (cpu, log[-3000:])

    # The receipt replaces the estimate in the Engine's plan (the plan says which it used).
    def from_receipt() -> Any:
        plan = install.get("engine", "tiny", "-n", install.apps)["status"].get("plan") or {}
        return plan if plan.get("source") == "receipt" else None

    plan = wait_until("a plan from the engine's receipt", from_receipt, 180, install.cluster)
    assert plan["receipt"]["modelSha256"] == sha256, plan
    # Its bytes are what llama.cpp allocated (all on the host here: no GPU), each buffer
    # rounded up by the log's resolution; the Engine's lease is that plan's.
    buffers = plan["receipt"]["buffers"]

    def kept(r: dict[str, Any]) -> list[tuple[str, str, int]]:
        return sorted((b["device"], b["kind"], b["bytes"]) for b in r.get("buffers") or [])

    assert any(kept(r) == kept(plan["receipt"]) for r in found), (plan["receipt"], found)

    def host(*kinds: str) -> int:
        return sum(b["bytes"] + LOG_RESOLUTION_BYTES for b in buffers if b["kind"] in kinds)

    planned = plan["bytes"]["host"]
    assert (planned["weights"], planned["kv"], planned["compute"]) == (
        host("model"), host("kv"), host("compute", "output")
    ), (planned, buffers)  # fmt: skip
    assert plan["bytes"]["device"]["weights"] == 0 and plan["bytes"]["device"]["kv"] == 0

    def leased() -> Any:
        placement = install.get("engine", "tiny", "-n", install.apps)["status"]["placement"]
        pools = {p["pool"]: p["bytes"] for p in placement.get("pools") or []}
        return pools if pools == {c["pool"]: c["bytes"] for c in plan["charges"]} else None

    wait_until("the Engine's lease charged as its receipt's plan", leased, 60, install.cluster)
    launches = {
        p["metadata"].get("annotations", {}).get("continuum.dev/launch")
        for p in install.pods(install.apps, ENGINE_PODS)
    }
    print(f"planned from the receipt: {plan.get('charges')} (launches seen {launches})")


AGENT_PODS = "app.kubernetes.io/component=agent"
AGENT_UID = 65533  # images/agent/Dockerfile's user
#: What the agent's probe does with one document of NVML answers: run in the agent's container,
#: as its user, with the settings its DaemonSet's arguments give; NVML is the fake one answering
#: from the document (this node has no GPU), whose process list is the engine's PID.
AGENT_READ = """
import argparse, json, sys
from continuum_operator.agent import probe
from continuum_operator.cli import agent as cli
from continuum_operator.testing.fake_nvml import FakeNvml
nvml, placed, agent_args = (json.loads(a) for a in sys.argv[1:4])
parser = argparse.ArgumentParser()
cli.add_arguments(parser)
settings = cli._settings(parser.parse_args(agent_args)).probe
doc, _ = probe.capture(settings, nv=FakeNvml(nvml), placed_pods=placed)
owners = probe.readings(doc).gpu_owners
print(json.dumps({
    "cgroup": {pid: e["cgroup"] for pid, e in doc["attribution"]["processes"].items()},
    "owners": {str(pid): [o.kind, o.namespace, o.name] for pid, o in owners.items()},
}))
"""


def host_pids_of_pod(uid: str) -> list[int]:
    """A pod's processes, read from this machine's /proc in its root cgroup namespace (absolute
    paths, found by the pod UID the kubelet names its cgroups after): not the agent's way."""
    marks = (f"pod{uid}", f"pod{uid.replace('-', '_')}")
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            text = (proc / "cgroup").read_text() if proc.name.isdigit() else ""
        except OSError:
            continue
        if any(m in text for m in marks):
            pids.append(int(proc.name))
    return sorted(pids)


def gpu_process_document(pid: int) -> dict[str, Any]:
    """A recorded H200's NVML answers, with `pid` the one compute process on its GPU."""
    fixture = ROOT / "tests" / "fixtures" / "probes" / "h200-captured.json"
    nvml: dict[str, Any] = json.loads(fixture.read_text())["nvml"]
    nvml["devices"][0]["nvmlDeviceGetComputeRunningProcesses"] = [
        {"pid": pid, "usedGpuMemory": 3 * 2**30, "gpuInstanceId": 0xFFFFFFFF,
         "computeInstanceId": 0xFFFFFFFF}
    ]  # fmt: skip
    return nvml


def join_cgroups_of(pid: int) -> str:
    """Shell lines that move the shell into every cgroup `pid` is in (v1 hierarchies and the
    unified one), so that a cgroup namespace it then makes is rooted where `pid`'s would be."""
    lines = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        name = controllers.split(",")[0].removeprefix("name=")
        if controllers == "":
            base = Path("/sys/fs/cgroup/unified")
            base = base if base.is_dir() else Path("/sys/fs/cgroup")
        else:
            base = Path("/sys/fs/cgroup") / name
        procs = base / path.lstrip("/") / "cgroup.procs"
        if procs.exists():
            lines.append(f"echo $$ > {procs}")
    return "; ".join(lines)


def test_the_agent_attributes_a_gpu_process_of_the_engines_pod_from_its_cgroup_namespace(
    install: Install,
) -> None:
    """The agent reads a GPU process of the engine's pod as the Engine's, twice: as the chart
    deploys it (in its container, its user and arguments) as this node shows it (cgroup v1
    controllers: containerd gives a container no cgroup namespace, paths are absolute); and, as
    containerd's CRI gives every non-privileged container on cgroup v2, from a cgroup namespace
    rooted at the agent container's own cgroups, as its user (the kernel then writes the
    engine's path relative to the agent's: `/../../../pod<uid>/...`)."""
    engine = next(
        p for p in install.pods(install.apps, ENGINE_PODS) if p["status"].get("phase") == "Running"
    )
    agent = next(
        p for p in install.pods(install.namespace, AGENT_PODS)
        if p["spec"].get("nodeName") == install.node
    )  # fmt: skip
    engine_pids = host_pids_of_pod(engine["metadata"]["uid"])
    llama = [
        p for p in engine_pids if Path(f"/proc/{p}/comm").read_text().strip() == "llama-server"
    ]
    assert llama, (engine_pids, [Path(f"/proc/{p}/comm").read_text() for p in engine_pids])
    agent_pid = next(
        p for p in host_pids_of_pod(agent["metadata"]["uid"])
        if f"\t{AGENT_UID}\t" in Path(f"/proc/{p}/status").read_text().split("Uid:")[1]
        .splitlines()[0]
    )  # fmt: skip
    placed = [{"uid": engine["metadata"]["uid"], "kind": "Engine", "namespace": install.apps,
               "name": "tiny"}]  # fmt: skip
    read_args = [
        json.dumps(gpu_process_document(llama[0])),
        json.dumps(placed),
        json.dumps(agent["spec"]["containers"][0]["args"][1:]),  # after `agent`
    ]
    python = "/opt/continuum/bin/python"
    as_deployed = install.kubectl(
        "exec", "-n", install.namespace, agent["metadata"]["name"], "--",
        python, "-c", AGENT_READ, *read_args,
    )  # fmt: skip
    seen = json.loads(as_deployed.stdout)
    assert seen["owners"] == {str(llama[0]): ["Engine", install.apps, "tiny"]}, seen

    # From the agent container's own cgroups, in a cgroup namespace rooted there, as its user:
    # the probe's code from this checkout (the container's files are the same package), the
    # agent's arguments with the host's cgroup tree where the container mounts it.
    script = (
        f"{join_cgroups_of(agent_pid)}; exec unshare --cgroup setpriv --reuid {AGENT_UID} "
        f'--regid {AGENT_UID} --clear-groups {sys.executable} -c "$0" "$@"'
    )
    host_args = [*json.loads(read_args[2]), "--cgroup-root=/sys/fs/cgroup"]
    read_args[2] = json.dumps(host_args)
    namespaced = subprocess.run(
        ["sh", "-c", script, AGENT_READ, *read_args],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "operator")},
    )  # fmt: skip
    assert namespaced.returncode == 0, namespaced.stderr[-3000:]
    seen = json.loads(namespaced.stdout)
    memory_line = next(
        line for line in seen["cgroup"][str(llama[0])].splitlines() if ":memory:" in line
    )
    assert memory_line.split(":", 2)[2].startswith("/../"), seen  # relative: a namespace
    assert seen["owners"] == {str(llama[0]): ["Engine", install.apps, "tiny"]}, seen
    print(f"the agent read the engine's llama-server (pid {llama[0]}) as {memory_line!r}")


def mind_class(name: str, priority: int) -> dict[str, Any]:
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "MindClass",
            "metadata": {"name": name},
            "spec": {"priority": priority, "protectionWindowSeconds": 0}}  # fmt: skip


def mind(install: Install, name: str, class_name: str) -> dict[str, Any]:
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "Mind",
            "metadata": {"name": name, "namespace": install.apps},
            "spec": {"engine": "tiny", "className": class_name, "contextTokens": 256}}  # fmt: skip


def grant_of(install: Install, name: str) -> dict[str, Any]:
    status = install.get("mind", name, "-n", install.apps).get("status", {})
    return {**(status.get("grant") or {}), "endpoint": status.get("endpoint")}


def serving(install: Install) -> Any:
    """The Engine Ready and its Service with a ready endpoint (a relaunch replaces the pod)."""
    body = install.get("engine", "tiny", "-n", install.apps)
    if condition(body, "Ready").get("status") != "True":
        return None
    slices = install.get(
        "endpointslices", "-n", install.apps, "-l", "kubernetes.io/service-name=tiny"
    )["items"]
    return [
        e for s in slices for e in s.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready")
    ]  # fmt: skip


def service_answers(install: Install) -> bool:
    """The engine's Service address answers from the node (through kube-proxy's rules, as a
    pod's connection goes): kube-proxy has programmed its endpoints."""
    ip = install.get("service", "tiny", "-n", install.apps)["spec"]["clusterIP"]
    try:
        with urllib.request.urlopen(f"http://{ip}:8080/healthz", timeout=3) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def nat_rules(install: Install) -> str:
    out = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True)
    return "\n".join(line for line in out.stdout.splitlines() if "tiny" in line)


def take_turn(install: Install, name: str, pod: str, prompt: str) -> dict[str, Any]:
    """Her pod, under her ServiceAccount, takes one turn at the address in her status."""
    wait_until("the engine serving at its Service", lambda: serving(install), 180, install.cluster)
    deadline = time.monotonic() + 120
    while not service_answers(install):
        if time.monotonic() > deadline:
            pytest.fail(f"the Service tiny never answered from the node:\n{nat_rules(install)}")
        time.sleep(0.5)
    endpoint = grant_of(install, name)["endpoint"]
    assert endpoint, f"{name} has no endpoint in her status"
    install.cluster.apply(service_account(install.apps, name))
    install.cluster.apply(
        mind_pod(
            name=pod, namespace=install.apps, service_account_name=name,
            engine_namespace=install.apps, engine_name="tiny", endpoint=endpoint,
            image=image_refs()["engine"], prompt=prompt, max_tokens=16,
            node_selector=REAL_NODE_LABEL,
        )
    )  # fmt: skip

    def ended() -> str:
        phase = install.get("pod", pod, "-n", install.apps)["status"].get("phase")
        return phase if phase in {"Succeeded", "Failed"} else ""

    wait_until(f"{pod} to end", ended, 180, install.cluster)
    lines = install.kubectl("logs", "-n", install.apps, pod).stdout.strip().splitlines()
    assert lines, f"{pod} printed nothing"
    answer: dict[str, Any] = json.loads(lines[-1])
    print(f"{name}: grant {grant_of(install, name)} -> {answer}")
    return answer


def test_a_minds_pod_takes_a_turn_and_a_higher_class_reclaims_her_slot(install: Install) -> None:
    low, high = f"batch-{RUN}", f"interactive-{RUN}"
    install.cluster.apply(mind_class(low, 0))
    install.cluster.apply(mind_class(high, 10))
    install.cluster.apply(mind(install, "ada", low))
    granted = wait_until(
        "ada's grant",
        lambda: grant_of(install, "ada").get("state") == "Granted",
        120,
        install.cluster,
    )
    assert granted
    answer = take_turn(install, "ada", "ada-turn-1", "Hello")
    assert answer["status"] == 200 and answer["events"] > 0, answer
    assert answer["error"] is None, answer

    # One slot: bea's class outranks ada's, so ada's grant is reclaimed within the grace (10 s
    # here); the gateway, not ada, reports her slot released.
    start = time.monotonic()
    install.cluster.apply(mind(install, "bea", high))
    wait_until(
        "bea granted after ada's reclaim",
        lambda: grant_of(install, "bea").get("state") == "Granted",
        60, install.cluster,
    )  # fmt: skip
    reclaimed_in = time.monotonic() - start
    assert grant_of(install, "ada").get("state") != "Granted"
    print(f"ada reclaimed and bea granted in {reclaimed_in:.1f} s")
    assert reclaimed_in < 10 + 30, reclaimed_in

    refused = take_turn(install, "ada", "ada-turn-2", "Hello again")
    assert refused["status"] in {409, 429}, refused
    assert "error" in json.loads(refused["error"]), refused  # OpenAI's error shape
    served = take_turn(install, "bea", "bea-turn-1", "Hello")
    assert served["status"] == 200 and served["error"] is None, served


def test_an_embedlanes_pod_embeds(install: Install) -> None:
    install.cluster.apply(
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
         "metadata": {"name": "notes", "namespace": install.apps},
         "spec": {"engine": "tiny", "maxContextTokens": 256}}
    )  # fmt: skip
    selector = "continuum.dev/embedlane=notes"

    def runtime() -> Any:
        lane = install.get("embedlane", "notes", "-n", install.apps)
        return (lane.get("status", {}).get("runtime") or {}).get("receipts")

    def calibrated() -> list[dict[str, Any]]:
        """The lane's one pod, Ready (calibrated), of its Deployment's launch, and receipts."""
        deployment = install.get("deployment", "embedlane-notes", "-n", install.apps)
        launch = deployment["spec"]["template"]["metadata"]["annotations"][LAUNCH_ANNOTATION]
        pods = install.pods(install.apps, selector)
        ready = [
            p for p in pods
            if p["metadata"].get("annotations", {}).get(LAUNCH_ANNOTATION) == launch
            and not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True"
                    for c in p["status"].get("conditions", []))
        ]  # fmt: skip
        return ready if len(pods) == 1 and runtime() else []

    # The lane's pod reports through its own ServiceAccount (may patch its lane's status only).
    pod = wait_until("the lane's pod Ready with receipts", calibrated, 300, install.cluster)[0]
    assert pod["spec"]["nodeName"] == install.node
    # Its calibration (a receipt under the estimate) shrank the lease, not the pod: the first
    # pod is the one serving, never relaunched (it was, 2 s after start, before the fix).
    deployment = install.get("deployment", "embedlane-notes", "-n", install.apps)
    assert deployment["metadata"]["generation"] == 1, deployment["metadata"]
    # The lane serves its namespace's service accounts by a token with its audience (its own
    # account here), refuses no token, and keeps /metrics on its admin port (docs/embedlanes.md).
    token = install.kubectl(
        "create", "token", "embedlane-notes", "-n", install.apps,
        f"--audience=continuum.dev/embedlane/{install.apps}/notes",
    ).stdout.strip()  # fmt: skip
    client = (
        "import json, sys, urllib.error, urllib.request\n"
        "def code(url, **kw):\n"
        "    try:\n"
        "        req = urllib.request.Request(url, **kw)\n"
        "        return urllib.request.urlopen(req, timeout=30).status\n"
        "    except urllib.error.HTTPError as err:\n"
        "        return err.code\n"
        "body = json.dumps({'input': ['hello', 'a second text']}).encode()\n"
        "plain = {'Content-Type': 'application/json'}\n"
        "req = urllib.request.Request('http://127.0.0.1:8080/v1/embeddings', method='POST',\n"
        "    data=body, headers={**plain, 'Authorization': 'Bearer ' + sys.argv[1]})\n"
        "print(json.dumps({\n"
        "    'answer': json.loads(urllib.request.urlopen(req, timeout=120).read()),\n"
        "    'no_token': code('http://127.0.0.1:8080/v1/embeddings', method='POST', data=body,\n"
        "                     headers=plain),\n"
        "    'metrics_http': code('http://127.0.0.1:8080/metrics'),\n"
        "    'metrics_admin': code('http://127.0.0.1:9090/metrics')}))\n"
    )
    out = install.kubectl(
        "exec", "-n", install.apps, pod["metadata"]["name"], "--",
        "/opt/continuum/bin/python", "-c", client, token,
    ).stdout  # fmt: skip
    seen = json.loads(out)
    assert (seen["no_token"], seen["metrics_http"], seen["metrics_admin"]) == (401, 404, 200), seen
    answer = seen["answer"]
    vectors = [item["embedding"] for item in answer["data"]]
    assert len(vectors) == 2 and len(vectors[0]) == len(vectors[1]) > 0, answer
    assert vectors[0] != vectors[1]


HOG = "import time\nwhile True:\n    sum(i * i for i in range(100000))\n"


def decode_rate(install: Install, engine_pod: str, n_predict: int = 48) -> float:
    """Tokens per second of llama-server inside the engine's pod, by its own timings."""
    client = (
        "import json, sys, urllib.request\n"
        "req = urllib.request.Request(sys.argv[1] + '/completion', method='POST',\n"
        f"    data=json.dumps({{'prompt': 'Once', 'n_predict': {n_predict}, 'id_slot': 0,\n"
        "                     'cache_prompt': False}).encode(),\n"
        "    headers={'Content-Type': 'application/json'})\n"
        "print(urllib.request.urlopen(req, timeout=300).read().decode())\n"
    )
    out = install.kubectl(
        "exec", "-n", install.apps, engine_pod, "--", "/opt/continuum/bin/python", "-c", client,
        llama_address(install, engine_pod),
    ).stdout  # fmt: skip
    rate: float = json.loads(out)["timings"]["predicted_per_second"]
    return rate


def llama_address(install: Install, engine_pod: str) -> str:
    """llama-server's loopback address in the engine's pod (its --port, from its command line)."""
    finder = (
        "import os\n"
        "for pid in os.listdir('/proc'):\n"
        "    if not pid.isdigit(): continue\n"
        "    try: args = open(f'/proc/{pid}/cmdline').read().split('\\0')\n"
        "    except OSError: continue\n"
        "    if any(a.endswith('llama-server') for a in args) and '--port' in args:\n"
        "        print(args[args.index('--port') + 1]); break\n"
    )
    port = install.kubectl(
        "exec", "-n", install.apps, engine_pod, "--", "/opt/continuum/bin/python", "-c", finder
    ).stdout.strip()
    assert port.isdigit(), f"no llama-server --port in {engine_pod}: {port!r}"
    return f"http://127.0.0.1:{port}"


def bea_child(
    install: Install, name: str, script: str, resources: dict[str, Any]
) -> dict[str, Any]:
    """A child pod of Mind bea (by her label) on the real node, running `script` in Python."""
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": install.apps,
                     "labels": {"continuum.dev/mind": "bea"}},
        "spec": {
            "nodeSelector": REAL_NODE_LABEL,
            "restartPolicy": "Never",
            "securityContext": {"runAsNonRoot": True, "runAsUser": 65534},
            "containers": [{
                "name": "hog", "image": image_refs()["engine"],
                "command": ["/opt/continuum/bin/python", "-c", script],
                "resources": resources,
            }],
        },
    }  # fmt: skip


def test_a_minds_child_pod_is_mutated_and_runs_below_the_engine(install: Install) -> None:
    engine_pod = install.pods(install.apps, ENGINE_PODS)[0]["metadata"]["name"]
    rest = decode_rate(install, engine_pod)
    # A child of bea that asks for a CPU and a cap of one: the webhook gives it the least
    # CPU weight and the lowest class, and removes the cap (children use idle cores).
    install.cluster.apply(
        bea_child(install, "bea-build", HOG,
                  {"requests": {"cpu": "1", "memory": "64Mi"},
                   "limits": {"cpu": "1", "memory": "256Mi"}})
    )  # fmt: skip
    pod = install.get("pod", "bea-build", "-n", install.apps)
    assert pod["spec"]["priorityClassName"] == "continuum-mind-children", pod["spec"]
    assert pod["spec"]["priority"] == -1000
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == "1m" and "cpu" not in resources.get("limits", {})
    assert pod["metadata"]["annotations"]["continuum.dev/process-class"] == "background"
    wait_until(
        "the child running on the real node",
        lambda: install.get("pod", "bea-build", "-n", install.apps)["status"].get("phase")
        == "Running",
        120, install.cluster,
    )  # fmt: skip
    time.sleep(3)
    busy = decode_rate(install, engine_pod)
    print(f"engine decode: {rest:.1f} tok/s at rest, {busy:.1f} tok/s beside the mutated child "
          f"({busy / rest:.0%} of rest)")  # fmt: skip
    # The engine keeps serving beside the child (the rate itself is a figure, not a gate).
    assert busy > 0
    served = take_turn(install, "bea", "bea-turn-2", "Still there?")
    assert served["status"] == 200 and served["error"] is None, served
    install.kubectl("delete", "pod", "bea-build", "-n", install.apps, "--wait=false")


# Grows by 256 MiB a step, every page touched, until it is killed or evicted (or has taken
# 64 GiB, more than this machine has): the child that takes the node's memory.
MEMORY_HOG = """
import sys, time
held = []
for step in range(256):
    held.append(bytearray(256 << 20))
    print(f"holding {len(held) * 256} MiB", flush=True)
    time.sleep(0.05)
sys.exit(3)
"""


def test_a_child_that_takes_the_nodes_memory_is_the_one_killed(install: Install) -> None:
    engine_before = install.pods(install.apps, ENGINE_PODS)[0]
    restarts = sum(c["restartCount"] for c in engine_before["status"]["containerStatuses"])
    install.cluster.apply(
        bea_child(install, "bea-hog", MEMORY_HOG, {"requests": {"memory": "64Mi"}})
    )

    def ended() -> dict[str, Any]:
        pod = install.get("pod", "bea-hog", "-n", install.apps)
        return pod if pod["status"].get("phase") in {"Failed", "Succeeded"} else {}

    pod = wait_until("the memory-hungry child to be stopped", ended, 300, install.cluster)
    state = (pod["status"].get("containerStatuses") or [{}])[0].get("state", {})
    how = pod["status"].get("reason") or state.get("terminated", {}).get("reason")
    held = install.kubectl("logs", "-n", install.apps, "bea-hog", check=False).stdout.split()
    print(f"the child was stopped ({how}) after {' '.join(held[-2:])}")
    assert how in {"OOMKilled", "Evicted", "Error"}, pod["status"]
    assert state.get("terminated", {}).get("exitCode") != 3, "the child was never stopped"

    engine_after = install.pods(install.apps, ENGINE_PODS)
    assert [p["metadata"]["uid"] for p in engine_after] == [engine_before["metadata"]["uid"]]
    after = sum(c["restartCount"] for c in engine_after[0]["status"]["containerStatuses"])
    assert after == restarts, engine_after[0]["status"]
    served = take_turn(install, "bea", "bea-turn-3", "After the storm")
    assert served["status"] == 200 and served["error"] is None, served
    install.kubectl("delete", "pod", "bea-hog", "-n", install.apps, "--wait=false")


def test_a_replaced_model_file_is_refused(install: Install) -> None:
    path = MODEL_DIR / "tiny.gguf"
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "continuum"), "model", "tiny", str(path),
         "--seed", "7", "--force"],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    path.chmod(0o644)
    install.kubectl(
        "delete", "pod", "-n", install.apps, "-l", "app.kubernetes.io/instance=tiny", "--wait=false"
    )

    def refused() -> dict[str, Any]:
        c = condition(install.get("engine", "tiny", "-n", install.apps), "Ready")
        return c if c.get("reason") == "ModelDigestMismatch" else {}

    c = wait_until("the Engine refusing the replaced file", refused, 240, install.cluster)
    assert c["status"] == "False"
    actual = hashlib.sha256(path.read_bytes()).hexdigest()
    assert actual in c["message"], c


def unloadable_model(path: Path) -> str:
    """A tiny model llama.cpp refuses to load (its tokenizer is one llama.cpp does not know),
    while its header reads as facts: the engine's pod starts and llama-server keeps exiting."""
    subprocess.run(
        [str(ROOT / ".venv" / "bin" / "continuum"), "model", "tiny", str(path), "--force"],
        check=True, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    data = path.read_bytes()
    key = b"tokenizer.ggml.model"
    at = data.index(key) + len(key) + 4 + 8  # the value's type (u32) and length (u64)
    assert data[at : at + 5] == b"llama", data[at - 12 : at + 5]
    path.write_bytes(data[:at] + b"lxama" + data[at + 5 :])
    path.chmod(0o644)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_engine_whose_llama_server_keeps_failing_is_stopped_saying_why(
    install: Install,
) -> None:
    """The runtime restarts llama-server after a backoff, at most --engine-max-restarts times
    (MAX_RESTARTS, given to the operator) in its window, then stops it: the Engine not Ready,
    EngineStopped, llama.cpp's last error line in the message, and the restarts counted in
    status.runtime."""
    path = MODEL_DIR / "unloadable.gguf"
    sha256 = unloadable_model(path)
    install.cluster.apply(engine_body(install, path, sha256))

    def stopped() -> dict[str, Any]:
        c = condition(install.get("engine", "tiny", "-n", install.apps), "Ready")
        return c if c.get("reason") == "EngineStopped" else {}

    c = wait_until("the Engine stopped after its restarts", stopped, 420, install.cluster)
    assert c["status"] == "False", c
    assert f"stopped after {MAX_RESTARTS} restarts" in c["message"], c
    assert "lxama" in c["message"], c
    runtime = install.get("engine", "tiny", "-n", install.apps)["status"]["runtime"]
    assert runtime["phase"] == "Stopped" and runtime["restarts"] == MAX_RESTARTS, runtime
    print(f"stopped: {c['message']}")


def test_helm_uninstall_leaves_no_mind_stuck_and_nothing_behind(install: Install) -> None:
    helm(install.helm, "uninstall", RELEASE, "-n", install.namespace, "--wait",
         env=install.cluster.env, timeout=300)  # fmt: skip
    # Its pods' grace (30 s) and the Minds' release come first: kubectl waits, within its own
    # limit, inside the subprocess's.
    install.cluster.kubectl("delete", "namespace", install.apps, "--timeout=240s", timeout=300)
    left = install.kubectl(
        "get", "minds,engines,deployments,pods", "-n", install.apps, "--ignore-not-found",
        "-o", "name", check=False,
    ).stdout.strip()  # fmt: skip
    assert not left, left
    release_objects = install.kubectl(
        "get", "all", "-n", install.namespace, "-o", "name", check=False
    ).stdout.strip()
    assert not release_objects, release_objects
