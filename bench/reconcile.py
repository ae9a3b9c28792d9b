"""Grants at scale on a real API server: 1,000 minds across 50 engines on KWOK nodes.

    python bench/reconcile.py [--engines 50] [--minds 1000] [--slots 20] [--kubeconfig FILE]

Starts a local control plane (`tools/cluster up`, unless --kubeconfig names one), makes one KWOK
node per engine with a fresh NodeBoard and agent Lease, applies the Engines and starts
`continuum operator` (leader election on, a transition log), waits until every engine serves,
then creates the minds as fast as a pool of clients can and watches them. Prints, for the minds
granted: apply-to-granted latency (the create request sent, to the watch event whose
`status.grant.state` is Granted) p50 / p90 / p99 / max, grants per second (granted minds over
the time from the first create to the last grant), the operator's ledger writes and 409s, and
`continuum check-log` over the run's log. Figures, not a pass/fail gate.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `continuum_operator`

from bench.kube_bench import (
    GROUP,
    ROOT,
    VERSION,
    GiB,
    cluster_down,
    cluster_up,
    kubectl,
    micro,
    mind_body,
    percentile,
)
from kubernetes import client, config, watch

from continuum_operator.core.heartbeat import (
    agent_lease_metadata,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", type=int, default=50)
    parser.add_argument("--minds", type=int, default=1000)
    parser.add_argument("--slots", type=int, default=20, help="minds.max of each engine")
    parser.add_argument("--clients", type=int, default=8, help="threads creating minds")
    parser.add_argument("--kubeconfig", default=None, help="an existing cluster (with KWOK)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument(
        "--backlog",
        action="store_true",
        help="create the minds while the operator is stopped, then start it: grants/s from "
        "its start (a leader taking over a backlog), not bounded by the creates",
    )
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-reconcile-"))
    state = work / "cluster"
    path = os.environ.get("PATH", "")
    if args.kubeconfig:
        kubeconfig = args.kubeconfig
    else:
        print(f"starting a control plane in {state} ...", flush=True)
        kubeconfig, exports = cluster_up(state)
        path = exports.get("PATH", path)
    operator: subprocess.Popen[bytes] | None = None
    try:
        operator = run(args, kubeconfig, path, work)
    finally:
        if operator is not None and operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(timeout=30)
            except subprocess.TimeoutExpired:
                operator.kill()
        if not args.kubeconfig:
            cluster_down(state)
    return 0


def run(
    args: argparse.Namespace, kubeconfig: str, path: str, work: Path
) -> subprocess.Popen[bytes]:
    tag = f"b{uuid.uuid4().hex[:6]}"
    ns = f"bench-{tag}"
    kc = kubeconfig
    kubectl(kc, path, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    kubectl(kc, path, "wait", "--for=condition=established", "--timeout=60s", "-f",
            str(ROOT / "crds"))  # fmt: skip
    kubectl(kc, path, "create", "namespace", ns)
    nodes: list[dict[str, Any]] = []
    boards: list[dict[str, Any]] = []
    leases: list[dict[str, Any]] = []
    for i in range(args.engines):
        name = f"{tag}-n{i:03d}"
        cap = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "1"}
        nodes.append({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                         "labels": {"type": "kwok", "bench": tag, "bench-engine": f"e{i:03d}",
                                    "kubernetes.io/hostname": name}},
            "spec": {}, "status": {"capacity": cap, "allocatable": cap},
        })  # fmt: skip
        boards.append({"apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeBoard",
                       "metadata": {"name": name}})  # fmt: skip
        leases.append({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": agent_lease_metadata(name),
            "spec": {"holderIdentity": "bench", "leaseDurationSeconds": 3600,
                     "renewTime": micro()},
        })  # fmt: skip
    for docs in (nodes, boards, leases):
        kubectl(kc, path, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1",
                "kind": "List", "items": docs}))  # fmt: skip
    board = {
        "memoryMode": "discrete", "memoryModeReason": "bench",
        "pools": [{"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 8 * GiB},
                  {"kind": "device", "device": 0, "capacityBytes": 80 * GiB, "usedBytes": GiB}],
        "gpus": [{"index": 0, "name": "bench GPU"}],
    }  # fmt: skip
    api_client = config.new_client_from_config(config_file=kc)
    objects: Any = client.CustomObjectsApi(api_client)
    for n in nodes:
        objects.patch_cluster_custom_object_status(
            GROUP, VERSION, "nodeboards", n["metadata"]["name"], {"status": board}
        )
    classes = [("low", 0), ("mid", 5), ("high", 10)]
    kubectl(kc, path, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
            "items": [{"apiVersion": f"{GROUP}/{VERSION}", "kind": "MindClass",
                       "metadata": {"name": f"{tag}-{c}"},
                       "spec": {"priority": p, "protectionWindowSeconds": 300}}
                      for c, p in classes]}))  # fmt: skip
    engines = [{
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "Engine",
        "metadata": {"name": f"e{i:03d}", "namespace": ns, "labels": {"bench": tag}},
        "spec": {"model": {"facts": {"layers": 4, "layerBytes": 64 * 2**20,
                                     "inputBytes": 2**20, "outputBytes": 2**20,
                                     "kvBytesPerTokenPerLayer": 1024,
                                     "computeBytes": 64 * 2**20}},
                 "contextTokensPerMind": 4096, "minds": {"min": 1, "max": args.slots},
                 # One node each: the plan does not count a node's GPUs (docs/operator.md).
                 "placement": {"nodeSelector": {"bench": tag, "bench-engine": f"e{i:03d}"}}},
    } for i in range(args.engines)]  # fmt: skip
    kubectl(kc, path, "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List",
            "items": engines}))  # fmt: skip

    log = work / "transitions.jsonl"

    def start_operator() -> subprocess.Popen[bytes]:
        with (work / "operator.log").open("ab") as out:
            return subprocess.Popen(
                [sys.executable, "-m", "continuum_operator.cli", "operator", "--kubeconfig", kc,
                 "--resync", "5", "--engine-image", "continuum-engine:bench",
                 "--engine-selector", f"bench={tag}", "--transition-log", str(log)],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PATH": path},
            )  # fmt: skip

    operator = start_operator()
    t0 = time.monotonic()
    while True:
        items = objects.list_namespaced_custom_object(GROUP, VERSION, ns, "grantledgers")["items"]
        serving = [
            e for e in items
            if ((e.get("status") or {}).get("grantCapacity") or {}).get("phase") == "Serving"
        ]  # fmt: skip
        if len(serving) == args.engines:
            break
        if time.monotonic() - t0 > args.timeout or operator.poll() is not None:
            raise SystemExit(f"only {len(serving)} of {args.engines} engines serving; "
                             f"see {work / 'operator.log'}")  # fmt: skip
        time.sleep(1)
    slots = sum(e["status"]["grantCapacity"]["slots"] for e in serving)
    print(f"{args.engines} engines serving ({slots} slots) after "
          f"{time.monotonic() - t0:.1f} s; creating {args.minds} minds", flush=True)  # fmt: skip

    applied: dict[str, float] = {}
    granted: dict[str, float] = {}
    stop = threading.Event()
    watching = threading.Event()

    def watcher() -> None:
        w = watch.Watch()
        rv = objects.list_namespaced_custom_object(GROUP, VERSION, ns, "minds")["metadata"][
            "resourceVersion"
        ]
        watching.set()
        while not stop.is_set():
            for ev in w.stream(objects.list_namespaced_custom_object, GROUP, VERSION, ns,
                               "minds", resource_version=rv, timeout_seconds=5):  # fmt: skip
                obj = ev["object"]
                rv = obj["metadata"]["resourceVersion"]
                state = ((obj.get("status") or {}).get("grant") or {}).get("state")
                name = obj["metadata"]["name"]
                if state == "Granted" and name not in granted:
                    granted[name] = time.time()
                if stop.is_set():
                    w.stop()
                    break

    th = threading.Thread(target=watcher, daemon=True)
    th.start()
    watching.wait(30)

    def create(i: int) -> None:
        name = f"m{i:04d}"
        body = mind_body(name, f"e{i % args.engines:03d}", f"{tag}-{classes[i % 3][0]}")
        applied[name] = time.time()
        objects.create_namespaced_custom_object(GROUP, VERSION, ns, "minds", body)

    if args.backlog:  # a clean stop hands the Lease over; the next start leads at once
        operator.send_signal(signal.SIGTERM)
        operator.wait(timeout=60)
    start = first_create = time.time()
    with ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(create, range(args.minds)))
    created = time.time()
    if args.backlog:
        start = time.time()
        operator = start_operator()
        print(f"backlog: {args.minds} minds created with no operator; started it", flush=True)
    expect = min(args.minds, slots)
    deadline = time.monotonic() + args.timeout
    while len(granted) < expect and time.monotonic() < deadline:
        time.sleep(0.2)
    stop.set()
    base = {n: start for n in applied} if args.backlog else applied
    lat = [granted[n] - base[n] for n in granted if n in base]
    if not lat:
        raise SystemExit("no mind was granted")
    last = max(granted.values())
    took = created - first_create
    print(f"minds created: {args.minds} in {took:.1f} s "
          f"({args.minds / took:.0f}/s, {args.clients} clients)")  # fmt: skip
    print(f"granted: {len(granted)} of {expect} expected")
    what = "operator-start-to-granted" if args.backlog else "apply-to-granted"
    print(f"{what}: p50 {percentile(lat, 0.5):.2f} s, p90 {percentile(lat, 0.9):.2f}"
          f" s, p99 {percentile(lat, 0.99):.2f} s, max {max(lat):.2f} s")  # fmt: skip
    since = "operator start" if args.backlog else "first create"
    print(f"grants/s: {len(granted) / (last - start):.1f} "
          f"({since} to last grant: {last - start:.1f} s)")  # fmt: skip
    text = (work / "operator.log").read_text()
    writes = sum(1 for x in log.read_text().splitlines() if '"event": "capacity"' in x)
    steps = len({(json.loads(x)["engine"], json.loads(x)["seq"])
                 for x in log.read_text().splitlines()})  # fmt: skip
    print(f"ledger steps logged: {steps}; capacity lines: {writes}; "
          f"conflicts re-decided: {text.count('409')}")  # fmt: skip
    checked = subprocess.run([sys.executable, "-m", "continuum_operator.cli", "check-log",
                              str(log)], capture_output=True, text=True)  # fmt: skip
    print(f"check-log: {checked.stdout.strip() or checked.stderr.strip()}")
    print(f"work directory: {work}")
    api_client.close()
    return operator


if __name__ == "__main__":
    raise SystemExit(main())
