"""The operator at scale on a real API server: fake nodes of mixed kinds, engines, minds in bursts.

    python bench/scale.py [--nodes 100] [--engines 200] [--minds 1000] [--burst 250]
                          [--rest 60] [--churn 60] [--churn-rate 5] [--profile FILE]

Starts a local control plane (`tools/cluster up`, unless --kubeconfig names one) and makes
`--nodes` KWOK nodes of four kinds (one 80 GiB GPU, two 24 GiB GPUs, unified memory, CPU only),
each with a NodeBoard and an agent Lease that this bench renews every `--renew` seconds, as the
node agents would. Starts `continuum operator` (leader election on, metrics served), applies the
Engines (small and larger models, one in five pinned to a node kind; facts inline, so no Job and
no llama.cpp: the engine pods are KWOK pods), waits until every engine is planned and serving,
then creates the Minds in bursts of `--burst` and waits until every mind that has a slot is
granted. Then it measures the operator at rest for `--rest` seconds (only the Lease renewals go
on) and under churn for `--churn` seconds (`--churn-rate` minds deleted and as many created per
second).

Prints: time from the engines' apply to all planned and to all serving, from the first mind's
create to all granted; apply-to-grant p50 / p99; the operator's CPU (seconds, and share of one
core) and peak memory (VmHWM); the API requests it made per minute (its adapter's counter,
`continuum_operator_api_requests_total`, by verb and resource) in each phase. kopf's watches are
not counted there: one list and one long watch per watched resource, re-opened by kopf every
few minutes. Figures, not a pass/fail gate; docs/performance.md has the figures and commands.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `continuum_operator`

import psutil
from bench.kube_bench import (
    GROUP,
    ROOT,
    VERSION,
    GiB,
    cluster_down,
    cluster_up,
    control_plane,
    kubectl,
    micro,
    mind_body,
    percentile,
)
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from continuum_operator.core.heartbeat import (
    LEASE_NAMESPACE,
    agent_lease_metadata,
    lease_name,
)

MiB = 2**20

# kind: (board status, node capacity besides cpu/memory/pods). Each engine pod on a GPU node asks
# for one `nvidia.com/gpu`; best fit packs many engines on a node, so the fake nodes offer many
# (as a shared device plugin would): this measures the operator, not the scheduler's GPU count.
KINDS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "gpu80": (
        {"memoryMode": "discrete", "memoryModeReason": "bench",
         "pools": [{"kind": "host", "capacityBytes": 512 * GiB, "usedBytes": 16 * GiB},
                   {"kind": "device", "device": 0, "capacityBytes": 80 * GiB,
                    "usedBytes": GiB}],
         "gpus": [{"index": 0, "name": "bench 80G"}]},
        {"nvidia.com/gpu": "1000"},
    ),
    "gpu24x2": (
        {"memoryMode": "discrete", "memoryModeReason": "bench",
         "pools": [{"kind": "host", "capacityBytes": 128 * GiB, "usedBytes": 8 * GiB},
                   {"kind": "device", "device": 0, "capacityBytes": 24 * GiB,
                    "usedBytes": GiB},
                   {"kind": "device", "device": 1, "capacityBytes": 24 * GiB,
                    "usedBytes": GiB}],
         "gpus": [{"index": 0, "name": "bench 24G"}, {"index": 1, "name": "bench 24G"}]},
        {"nvidia.com/gpu": "1000"},
    ),
    "unified": (
        {"memoryMode": "unified", "memoryModeReason": "bench",
         "pools": [{"kind": "unified", "capacityBytes": 128 * GiB, "usedBytes": 12 * GiB}],
         "gpus": [{"index": 0, "name": "bench iGPU"}]},
        {},
    ),
    "cpu": (
        {"memoryMode": "discrete", "memoryModeReason": "bench: no GPU",
         "pools": [{"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 8 * GiB}]},
        {},
    ),
}  # fmt: skip

# model facts: (layers, layer MiB)
MODELS = [(4, 64), (8, 128), (16, 96)]


class Watched:
    """One resource's objects as a watch sees them, with the wall time each first met `test`."""

    def __init__(
        self,
        api_client: client.ApiClient,
        namespace: str,
        plural: str,
        tests: dict[str, Callable[[dict[str, Any]], bool]],
    ) -> None:
        self.objects: Any = client.CustomObjectsApi(api_client)
        self.namespace, self.plural, self.tests = namespace, plural, tests
        self.first: dict[str, dict[str, float]] = {t: {} for t in tests}
        # Each Mind, when her entry in an Engine's ledger first said Granted (GrantLedgers only):
        # the gateway serves her turns from then, before her own status says so.
        self.ledger_granted: dict[str, float] = {}
        self.latest: dict[str, dict[str, Any]] = {}
        self.stop = threading.Event()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.ready.wait(60)

    def _see(self, obj: dict[str, Any], deleted: bool) -> None:
        name = obj["metadata"]["name"]
        if deleted:
            self.latest.pop(name, None)
            return
        self.latest[name] = obj
        now = time.time()
        for t, test in self.tests.items():
            if name not in self.first[t] and test(obj):
                self.first[t][name] = now
        for entry in _status(obj).get("grants") or []:
            if entry.get("state") == "Granted":
                mind = str(entry.get("mind", "")).rpartition("/")[2]
                self.ledger_granted.setdefault(mind, now)

    def _run(self) -> None:
        rv = ""
        while not self.stop.is_set():
            try:
                if not rv:
                    listed = self.objects.list_namespaced_custom_object(
                        GROUP, VERSION, self.namespace, self.plural
                    )
                    for obj in listed["items"]:
                        self._see(obj, False)
                    rv = listed["metadata"]["resourceVersion"]
                    self.ready.set()
                w = watch.Watch()
                for ev in w.stream(self.objects.list_namespaced_custom_object, GROUP, VERSION,
                                   self.namespace, self.plural, resource_version=rv,
                                   timeout_seconds=30):  # fmt: skip
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        rv = ""  # 410 Gone: list again
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    self._see(obj, ev["type"] == "DELETED")
                    if self.stop.is_set():
                        w.stop()
                        break
            except ApiException as err:
                if err.status == 410:
                    rv = ""
                else:
                    time.sleep(1)
            except Exception:  # a dropped connection: watch again from the last version
                time.sleep(1)


class Operator:
    """The operator process: its CPU, peak memory and API request counter, phase by phase; and
    the CPU of the control plane's processes beside it (`neighbours`), when the bench runs them."""

    def __init__(
        self,
        proc: subprocess.Popen[bytes],
        metrics_port: int,
        neighbours: dict[str, psutil.Process] | None = None,
    ) -> None:
        self.proc = proc
        self.ps = psutil.Process(proc.pid)
        self.port = metrics_port
        self.neighbours = neighbours or {}
        self.marks: list[tuple[str, float, float, dict[tuple[str, ...], float]]] = []
        self.neighbour_marks: dict[str, dict[str, float]] = {}

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return float(t.user + t.system)

    def rss_peak_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def rss_mib(self) -> float:
        return float(self.ps.memory_info().rss) / MiB

    def requests(self) -> dict[tuple[str, ...], float]:
        """Requests made by (verb, resource), and the seconds they took to be answered, summed,
        by (verb, resource, "seconds") (`continuum_operator_api_request_duration_seconds`)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
                text = r.read().decode()
        except OSError:
            return {}
        counts: dict[tuple[str, ...], float] = {}
        series = {
            "continuum_operator_api_requests_total{": (),
            "continuum_operator_api_request_duration_seconds_sum{": ("seconds",),
        }
        for line in text.splitlines():
            kind = next((k for p, k in series.items() if line.startswith(p)), None)
            if kind is None:
                continue
            labels, _, value = line.rpartition(" ")
            parts = dict(
                kv.split("=", 1) for kv in labels[labels.index("{") + 1 : -1].split(",") if kv
            )
            key = (parts["verb"].strip('"'), parts["resource"].strip('"'), *kind)
            counts[key] = float(value)
        return counts

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time(), self.cpu(), self.requests()))
        self.neighbour_marks[name] = {}
        for who, ps in self.neighbours.items():
            with contextlib.suppress(psutil.Error):
                t = ps.cpu_times()
                self.neighbour_marks[name][who] = float(t.user + t.system)

    def neighbour_cpu(self, start: str, end: str) -> dict[str, float]:
        """CPU seconds of each control-plane process between two marks."""
        a, b = self.neighbour_marks[start], self.neighbour_marks[end]
        return {who: b[who] - a[who] for who in b if who in a}

    def phase(self, start: str, end: str) -> tuple[float, float, dict[tuple[str, ...], float]]:
        """Wall seconds, CPU seconds, and requests by (verb, resource) (and the seconds they
        took by (verb, resource, "seconds")) between two marks."""
        a = next(m for m in self.marks if m[0] == start)
        b = next(m for m in self.marks if m[0] == end)
        reqs = {k: v - a[3].get(k, 0.0) for k, v in b[3].items() if v - a[3].get(k, 0.0) > 0}
        return b[1] - a[1], b[2] - a[2], reqs


def _profile_apiserver(kc: str, path: str, args: argparse.Namespace, out: Path) -> None:
    """A CPU profile of the API server over the first seconds of the minds' arrival (at most
    30), written to `out` in the background; `go tool pprof -top OUT` reads it."""
    seconds = max(1, min(30, round(args.minds / args.rate) if args.rate else 30))

    def fetch() -> None:
        with out.open("wb") as fh:
            done = subprocess.run(
                ["kubectl", "--kubeconfig", kc, "get", "--raw",
                 f"/debug/pprof/profile?seconds={seconds}"],
                stdout=fh, stderr=subprocess.PIPE, env={**os.environ, "PATH": path}, check=False,
            )  # fmt: skip
        if done.returncode:
            print(f"the API server's profile failed: {done.stderr.decode().strip()}", flush=True)
        else:
            print(f"the API server's CPU profile ({seconds} s) is in {out}", flush=True)

    threading.Thread(target=fetch, daemon=True).start()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--engines", type=int, default=200)
    parser.add_argument("--minds", type=int, default=1000)
    parser.add_argument("--burst", type=int, default=250, help="minds created per burst")
    parser.add_argument("--burst-gap", type=float, default=2.0, help="seconds between bursts")
    parser.add_argument(
        "--rate",
        type=float,
        default=0.0,
        help="minds created at this many a second, each at its own time (instead of bursts)",
    )
    parser.add_argument("--slots", type=int, default=8, help="minds.max of each engine")
    parser.add_argument("--clients", type=int, default=8, help="threads creating minds")
    parser.add_argument("--renew", type=float, default=20.0, help="seconds between renewals")
    parser.add_argument("--rest", type=float, default=60.0, help="seconds measured at rest")
    parser.add_argument("--churn", type=float, default=60.0, help="seconds measured in churn")
    parser.add_argument("--churn-rate", type=float, default=5.0, help="minds replaced per second")
    parser.add_argument("--resync", type=float, default=5.0, help="the operator's --resync")
    parser.add_argument(
        "--write-workers", type=int, default=0, help="the operator's --write-workers (0: its own)"
    )
    parser.add_argument("--kubeconfig", default=None, help="an existing cluster (with KWOK)")
    parser.add_argument(
        "--grant-finalizer-policy",
        action="store_true",
        help="apply the chart's MutatingAdmissionPolicy that puts the grant finalizer on each "
        "Mind at her creation (as `helm install` does on Kubernetes 1.36+): the operator then "
        "writes no finalizer at a grant",
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per phase")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="sample the operator's threads (bench/sampler.py) and write the hot spots here",
    )
    parser.add_argument(
        "--apiserver-profile",
        metavar="FILE",
        help="the bench's own control plane started with profiling on: a CPU profile of the API "
        "server over the minds' arrival (up to 30 s) written here (`go tool pprof -top FILE`)",
    )
    parser.add_argument(
        "--memray",
        default=None,
        metavar="FILE",
        help="record the operator's allocations with memray (`pip install memray`) into FILE; "
        "`bench/memray_peak.py FILE` then says who held the memory at its high-water mark",
    )
    parser.add_argument(
        "--decide-only",
        action="store_true",
        help="no cluster: the operator's plan and grants loops in-process, against an API "
        "server in memory (bench/decide.py): the CPU of each pass as they run now (only what "
        "changed decided) and of a full pass (every engine, as every pass ran before)",
    )
    args = parser.parse_args(argv)
    if args.decide_only:
        return decide_only(args)
    # A stopped bench (SIGTERM) still stops its operator and its control plane.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    work = Path(tempfile.mkdtemp(prefix="bench-scale-"))
    state = work / "cluster"
    path = os.environ.get("PATH", "")
    started = time.monotonic()
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
    else:
        print(f"starting a control plane in {state} ...", flush=True)
        # A Service an engine: more than the default 254 ClusterIPs.
        kubeconfig, exports = cluster_up(
            state,
            CONTINUUM_SERVICE_CIDR="10.0.0.0/16",
            CONTINUUM_APISERVER_PROFILING="true" if args.apiserver_profile else "false",
        )
        path = exports.get("PATH", path)
    op: Operator | None = None
    stop = threading.Event()
    try:
        op = run(args, kubeconfig, path, work, stop)
    finally:
        stop.set()
        if op is not None and op.proc.poll() is None:
            op.proc.send_signal(signal.SIGTERM)
            try:
                op.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                op.proc.kill()
        if not args.kubeconfig:
            cluster_down(state)
    print(f"bench wall time: {(time.monotonic() - started) / 60:.1f} min; work directory: {work}")
    return 0


def decide_only(args: argparse.Namespace) -> int:
    """The operator's plan and grants loops in-process (bench/decide.py): the CPU of each pass
    as they run now (only what changed decided) and of a full pass (as every pass ran before)."""
    from bench.decide import run as decide

    decide(args.nodes, args.engines, args.minds, args.slots)
    return 0


def _nodes(tag: str, count: int) -> list[tuple[str, str]]:
    kinds = list(KINDS)
    return [(f"{tag}-n{i:04d}", kinds[i % len(kinds)]) for i in range(count)]


def _engine(tag: str, ns: str, i: int, slots: int) -> dict[str, Any]:
    layers, layer_mib = MODELS[i % len(MODELS)]
    selector = {"bench": tag}
    if i % 5 == 4:
        selector["bench-kind"] = "gpu80"
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Engine",
        "metadata": {"name": f"e{i:04d}", "namespace": ns, "labels": {"bench": tag}},
        "spec": {"model": {"facts": {"layers": layers, "layerBytes": layer_mib * MiB,
                                     "inputBytes": 16 * MiB, "outputBytes": 16 * MiB,
                                     "kvBytesPerTokenPerLayer": 1024,
                                     "computeBytes": 64 * MiB}},
                 "contextTokensPerMind": 4096, "minds": {"min": 1, "max": slots},
                 "placement": {"nodeSelector": selector}},
    }  # fmt: skip


def paced(pool: ThreadPoolExecutor, create: Callable[[int], None], count: int, rate: float) -> None:
    """Create `count` minds at `rate` a second, each sent at its own time (i / rate after the
    first) whatever the answers' pace, as independent clients would; then wait for them all."""
    start = time.monotonic()
    sent = []
    for i in range(count):
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
        sent.append(pool.submit(create, i))
    for future in sent:
        future.result()


def _status(obj: dict[str, Any]) -> dict[str, Any]:
    return obj.get("status") or {}


def _serving(obj: dict[str, Any]) -> bool:
    return (_status(obj).get("grantCapacity") or {}).get("phase") == "Serving"


def _granted(obj: dict[str, Any]) -> bool:
    return (_status(obj).get("grant") or {}).get("state") == "Granted"


def _held(obj: dict[str, Any]) -> bool:
    """Granted, and the finalizer that holds her slot through a deletion is on."""
    return _granted(obj) and "continuum.dev/grant" in (obj["metadata"].get("finalizers") or [])


def _in_chunks(items: list[dict[str, Any]], size: int = 250) -> list[list[dict[str, Any]]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _apply_grant_finalizer_policy(kc: str, path: str) -> None:
    """The chart's policy as `helm template` renders it for an API server that serves it, and
    a dry-run Mind created until it carries the finalizer (the policy is then in force)."""
    from tests.support.helm import find_helm

    rendered = subprocess.run(
        [str(find_helm()), "template", "bench", str(ROOT / "charts/continuum"),
         "--show-only", "templates/mind-grant-finalizer-policy.yaml",
         "--api-versions", "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    kubectl(kc, path, "apply", "-f", "-", stdin=rendered)
    body = mind_body("probe", "e0000", "none")
    body["metadata"]["namespace"] = "default"
    probe = json.dumps(body)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            out = kubectl(kc, path, "create", "--dry-run=server", "-o", "json", "-f", "-",
                          stdin=probe)  # fmt: skip
        except subprocess.CalledProcessError:
            out = "{}"  # the policy (or the Mind CRD) not served yet: try again
        if "continuum.dev/grant" in (json.loads(out).get("metadata") or {}).get("finalizers", []):
            print("the grant finalizer policy is in force", flush=True)
            return
        time.sleep(1)
    raise SystemExit("the grant finalizer policy did not take effect within 60 s")


def run(
    args: argparse.Namespace, kubeconfig: str, path: str, work: Path, stop: threading.Event
) -> Operator:
    tag = f"s{uuid.uuid4().hex[:6]}"
    ns = f"bench-{tag}"
    kc = kubeconfig
    kubectl(kc, path, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    kubectl(kc, path, "wait", "--for=condition=established", "--timeout=60s", "-f",
            str(ROOT / "crds"))  # fmt: skip
    kubectl(kc, path, "create", "namespace", ns)
    if args.grant_finalizer_policy:
        _apply_grant_finalizer_policy(kc, path)
    api_client = config.new_client_from_config(config_file=kc)
    objects: Any = client.CustomObjectsApi(api_client)
    leases_api: Any = client.CoordinationV1Api(api_client)

    # Nodes, boards and agent Leases.
    t = time.monotonic()
    nodes = _nodes(tag, args.nodes)
    docs: list[dict[str, Any]] = []
    for name, kind in nodes:
        cap = {"cpu": "1000", "memory": "2Ti", "pods": "1000", **KINDS[kind][1]}
        docs.append({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"type": "kwok", "bench": tag, "bench-kind": kind,
                                    "kubernetes.io/hostname": name}},
            "spec": {}, "status": {"capacity": cap, "allocatable": cap},
        })  # fmt: skip
    ttl = int(max(120, 6 * args.renew))
    for name, _ in nodes:
        docs.append({"apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeBoard",
                     "metadata": {"name": name}})  # fmt: skip
        docs.append({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": agent_lease_metadata(name),
            "spec": {"holderIdentity": "bench", "leaseDurationSeconds": ttl,
                     "renewTime": micro()},
        })  # fmt: skip
    for chunk in _in_chunks(docs):
        kubectl(kc, path, "apply", "-f", "-",
                stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": chunk}))  # fmt: skip

    def board(node: tuple[str, str]) -> None:
        objects.patch_cluster_custom_object_status(
            GROUP, VERSION, "nodeboards", node[0], {"status": KINDS[node[1]][0]}
        )

    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(board, nodes))
    print(f"{args.nodes} nodes with boards and Leases in {time.monotonic() - t:.1f} s", flush=True)

    def renewer() -> None:
        # The agents' heartbeat: every node's Lease, spread over the interval.
        with ThreadPoolExecutor(4) as pool:
            while not stop.wait(args.renew):
                list(pool.map(lambda n: leases_api.patch_namespaced_lease(
                    lease_name(n[0]), LEASE_NAMESPACE, {"spec": {"renewTime": micro()}}),
                    nodes))  # fmt: skip

    threading.Thread(target=renewer, daemon=True).start()
    classes = [("low", 0), ("mid", 5), ("high", 10)]
    kubectl(kc, path, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
            "items": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "MindClass",
                       "metadata": {"name": f"{tag}-{c}"},
                       "spec": {"priority": p, "protectionWindowSeconds": 300}}
                      for c, p in classes]}))  # fmt: skip

    # The operator.
    port = _free_port()
    runner = [sys.executable]
    if args.profile:
        runner += [str(ROOT / "bench/sampler.py"), str(Path(args.profile).resolve())]
    elif args.memray:
        runner += ["-m", "memray", "run", "--force", "-o", str(Path(args.memray).resolve())]
    with (work / "operator.log").open("ab") as out:
        proc = subprocess.Popen(
            [*runner, "-m", "continuum_operator.cli", "operator", "--kubeconfig", kc,
             "--resync", str(args.resync), "--engine-image", "continuum-engine:bench",
             "--engine-selector", f"bench={tag}", "--metrics-port", str(port),
             "--transition-log", str(work / "transitions.jsonl"),
             *(["--write-workers", str(args.write_workers)] if args.write_workers else [])],
            stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PATH": path},
        )  # fmt: skip
    # The control plane's CPU beside the operator's, when it is the bench's own (the API server
    # shares this machine's CPUs with the operator and the bench).
    op = Operator(proc, port, None if args.kubeconfig else control_plane(work / "cluster"))
    deadline = time.monotonic() + 60
    while not op.requests() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
    op.mark("start")

    engines = Watched(api_client, ns, "engines",
                      {"planned": lambda o: bool(_status(o).get("plan"))})  # fmt: skip
    ledgers = Watched(api_client, ns, "grantledgers", {"serving": _serving})
    minds = Watched(api_client, ns, "minds", {"granted": _granted, "held": _held})

    core: Any = client.CoreV1Api(api_client)
    worst_not_ready = [0]

    def nodes_not_ready() -> int:
        # The test cluster's own health: a fake node KWOK fails to heartbeat goes NotReady, and
        # the node controller marks its pods not ready (the engine's, whose minds then queue).
        listed = core.list_node(label_selector=f"bench={tag}").items
        bad = sum(
            1 for n in listed
            if not any(c.type == "Ready" and c.status == "True"
                       for c in (n.status.conditions or []))
        )  # fmt: skip
        worst_not_ready[0] = max(worst_not_ready[0], bad)
        return bad

    def progress(what: str, done: Callable[[], bool], line: Callable[[], str]) -> None:
        t0 = last = time.monotonic()
        while not done():
            now = time.monotonic()
            if proc.poll() is not None:
                raise SystemExit(f"the operator exited ({proc.returncode}); see {work}")
            if now - t0 > args.timeout:
                raise SystemExit(f"{what}: timed out after {args.timeout:.0f} s: {line()}; "
                                 f"nodes not ready {nodes_not_ready()}")  # fmt: skip
            if now - last >= 15:
                print(f"  [{now - t0:5.0f} s] {line()}; operator {op.rss_mib():.0f} MiB; "
                      f"nodes not ready {nodes_not_ready()}", flush=True)  # fmt: skip
                last = now
            time.sleep(0.5)

    # Engines: applied, then all planned, all serving.
    bodies = [_engine(tag, ns, i, args.slots) for i in range(args.engines)]
    op.mark("engines")
    t_engines = time.time()
    for chunk in _in_chunks(bodies):
        kubectl(kc, path, "apply", "-f", "-",
                stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": chunk}))  # fmt: skip
    applied_s = time.time() - t_engines
    print(f"{args.engines} engines applied in {applied_s:.1f} s (kubectl, 250 a request); "
          f"planned {len(engines.first['planned'])} by then; waiting for plans",
          flush=True)  # fmt: skip

    def engines_line() -> str:
        return (f"planned {len(engines.first['planned'])}/{args.engines}, "
                f"serving {len(ledgers.first['serving'])}/{args.engines}")  # fmt: skip

    progress("plans", lambda: len(engines.first["planned"]) >= args.engines, engines_line)
    planned_s = max(engines.first["planned"].values()) - t_engines
    op.mark("planned")
    progress("serving", lambda: len(ledgers.first["serving"]) >= args.engines, engines_line)
    serving_s = max(ledgers.first["serving"].values()) - t_engines
    op.mark("serving")
    slots = sum(
        int((_status(e).get("grantCapacity") or {}).get("slots") or 0)
        for e in list(ledgers.latest.values())
    )
    print(f"all planned in {planned_s:.1f} s, all serving in {serving_s:.1f} s "
          f"({slots} slots)", flush=True)  # fmt: skip

    # Minds, in bursts.
    applied: dict[str, float] = {}
    rng = random.Random(7)

    def create(i: int) -> None:
        name = f"m{i:05d}"
        body = mind_body(name, f"e{i % args.engines:04d}", f"{tag}-{classes[i % 3][0]}")
        applied[name] = time.time()
        objects.create_namespaced_custom_object(GROUP, VERSION, ns, "minds", body)

    op.mark("minds")
    if args.apiserver_profile:
        _profile_apiserver(kc, path, args, Path(args.apiserver_profile))
    first_create = time.time()
    with ThreadPoolExecutor(args.clients) as pool:
        if args.rate:
            paced(pool, create, args.minds, args.rate)
            print(f"  {args.minds} minds created in {time.time() - first_create:.1f} s "
                  f"(paced at {args.rate:g}/s); granted {len(minds.first['granted'])}")  # fmt: skip
        for b in range(0, 0 if args.rate else args.minds, args.burst):
            list(pool.map(create, range(b, min(args.minds, b + args.burst))))
            print(f"  burst: {min(args.minds, b + args.burst)}/{args.minds} minds created; "
                  f"granted {len(minds.first['granted'])}", flush=True)  # fmt: skip
            if b + args.burst < args.minds:
                time.sleep(args.burst_gap)
    last_create = time.time()
    expect = min(args.minds, slots)
    progress(
        "grants",
        lambda: len(minds.first["granted"]) >= expect,
        lambda: f"granted {len(minds.first['granted'])}/{expect}",
    )
    granted = dict(minds.first["granted"])
    op.mark("granted")
    # The finalizers follow the grants (written after the projections): at rest after them.
    progress(
        "finalizers",
        lambda: len(minds.first["held"]) >= expect,
        lambda: f"finalizer on {len(minds.first['held'])}/{expect}",
    )
    op.mark("held")
    held_s = max(minds.first["held"].values()) - first_create
    lat = [granted[n] - applied[n] for n in granted if n in applied]
    in_ledger = dict(ledgers.ledger_granted)
    ledger_lat = [in_ledger[n] - applied[n] for n in in_ledger if n in applied]
    granted_s = max(granted.values()) - first_create
    # Each mind's times (created, in her Engine's ledger, her own status Granted), for splitting
    # the latency against the transition log's step times (`t`) in the same directory.
    (work / "minds.json").write_text(json.dumps(
        {n: [applied[n], in_ledger.get(n), granted.get(n)] for n in applied}))  # fmt: skip

    # At rest: only the Leases are renewed.
    print(f"all {expect} granted in {granted_s:.1f} s; at rest for {args.rest:.0f} s", flush=True)
    time.sleep(args.rest)
    op.mark("rested")

    # Churn: minds deleted and created, `churn_rate` a second.
    print(f"churn: {args.churn_rate:g} minds replaced a second for {args.churn:.0f} s", flush=True)
    live = sorted(applied)
    next_i = args.minds
    t_end = time.monotonic() + args.churn
    with ThreadPoolExecutor(args.clients) as pool:
        while time.monotonic() < t_end:
            tick = time.monotonic()
            n = max(1, round(args.churn_rate))
            gone = [live.pop(rng.randrange(len(live))) for _ in range(min(n, len(live)))]
            list(pool.map(lambda m: objects.delete_namespaced_custom_object(
                GROUP, VERSION, ns, "minds", m), gone))  # fmt: skip
            list(pool.map(create, range(next_i, next_i + n)))
            live.extend(f"m{i:05d}" for i in range(next_i, next_i + n))
            next_i += n
            time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    op.mark("churned")
    peak = op.rss_peak_mib()
    engines.stop.set()
    ledgers.stop.set()
    minds.stop.set()

    # Figures.
    def per_min(phase: tuple[float, float, dict[tuple[str, ...], float]]) -> float:
        return sum(n for k, n in phase[2].items() if len(k) == 2) / phase[0] * 60

    def cpu_share(phase: tuple[float, float, dict[tuple[str, ...], float]]) -> str:
        return f"{phase[1]:.1f} s ({100 * phase[1] / phase[0]:.0f}% of a core)"

    up = op.phase("engines", "serving")
    apply_minds = op.phase("minds", "held")
    rest = op.phase("held", "rested")
    churn = op.phase("rested", "churned")
    whole = op.phase("start", "churned")
    print()
    arrivals = f"at {args.rate:g}/s" if args.rate else f"bursts of {args.burst}"
    print(f"size: {args.nodes} nodes, {args.engines} engines, {args.minds} minds "
          f"({arrivals}), {slots} slots")  # fmt: skip
    print(f"engines applied -> all planned: {planned_s:.1f} s; -> all serving: {serving_s:.1f} s "
          f"(the apply itself: {applied_s:.1f} s)")  # fmt: skip
    print(f"first mind created -> all {expect} granted: {granted_s:.1f} s; "
          f"-> finalizers on all: {held_s:.1f} s; last created -> all granted: "
          f"{max(granted.values()) - last_create:.1f} s")  # fmt: skip
    print(f"apply-to-granted: p50 {percentile(lat, 0.5):.2f} s, p99 {percentile(lat, 0.99):.2f} s, "
          f"max {max(lat):.2f} s")  # fmt: skip
    if ledger_lat:
        print(f"apply-to-granted in the ledger (the gateway serves her from then): "
              f"p50 {percentile(ledger_lat, 0.5):.2f} s, p99 {percentile(ledger_lat, 0.99):.2f} s, "
              f"max {max(ledger_lat):.2f} s ({len(ledger_lat)} minds)")  # fmt: skip
    print(
        f"operator CPU: engines up {cpu_share(up)}; minds applied {cpu_share(apply_minds)}; "
        f"at rest {cpu_share(rest)}; churn {cpu_share(churn)}; whole run {whole[1]:.0f} s"
    )
    plane = op.neighbour_cpu("minds", "held")
    if plane:
        print("control plane CPU, minds applied: " + ", ".join(
            f"{who} {cpu:.1f} s ({100 * cpu / apply_minds[0]:.0f}% of a core)"
            for who, cpu in plane.items()))  # fmt: skip
    print(f"operator peak memory (VmHWM): {peak:.0f} MiB")
    print(f"fake nodes not ready (the test cluster's health), most seen at once: "
          f"{max(worst_not_ready[0], nodes_not_ready())}")  # fmt: skip
    print(f"API requests/min: engines up {per_min(up):.0f}, minds applied "
          f"{per_min(apply_minds):.0f}, at rest {per_min(rest):.0f}, "
          f"churn {per_min(churn):.0f}")  # fmt: skip
    for label, phase in (("at rest", rest), ("churn", churn), ("minds applied", apply_minds)):
        made = {k: n for k, n in phase[2].items() if len(k) == 2}
        top = sorted(made.items(), key=lambda kv: -kv[1])[:6]
        # The mean time each took to be answered: the API server's latency as the operator
        # saw it, queueing on its side included.
        print(f"  {label}: " + ", ".join(
            f"{v} {r} {n / phase[0] * 60:.0f}/min "
            f"({1000 * phase[2].get((v, r, 'seconds'), 0.0) / n:.0f} ms)"
            for (v, r), n in top))  # fmt: skip
    api_client.close()
    return op


if __name__ == "__main__":
    raise SystemExit(main())
