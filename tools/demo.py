"""The demo's main job, run by tools/demo once the control plane and CRDs are up.

`start`: creates a KWOK node for every example board (a discrete 80 GiB A100, an H200, two L4s,
a unified GB10 and an M5, a CPU node and a GPU node of unknown mode), writes each board's status
and the agent's Lease (`core.heartbeat`: beside the kubelet's, never it) as the node agent would,
starts `continuum operator` in the background (its log and pid in the cluster's state
directory), applies the example engines, waits for the operator to place or refuse each one, and
prints the plans as a table with how to look further.
`renew`: renews the agent Leases. `stop`: stops the operator and the control plane.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from continuum_operator import yaml_text
from continuum_operator.core.heartbeat import (
    agent_lease_metadata,
)
from continuum_operator.testing.mind_pod import mind_pod, service_account

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
STATE = Path(
    os.environ.get(
        "CONTINUUM_CLUSTER_DIR",
        Path(os.environ.get("CONTINUUM_CACHE", Path.home() / ".cache/continuum")) / "demo-cluster",
    )
)
PID_FILE = STATE / "operator.pid"
LOG_FILE = STATE / "operator.log"
METRICS_PORT_FILE = STATE / "operator.metrics-port"
# No engine gateway runs behind the demo's fake pods, so nothing reports a reclaimed slot
# released: each release waits for its grace deadline. 5 s instead of the operator's 30 s keeps
# a deleted Mind's slot from sitting idle half a minute (the printed text says so).
GRACE_SECONDS = 5
LEASE_SECONDS = 3600  # no agent runs in the demo: one renewal keeps a board fresh for an hour
GiB = 2**30

# Nodes whose board says nothing of their GPUs: the node that has one but no GPU backend.
EXTRA_CAPACITY: dict[str, dict[str, str]] = {"cpu-or-unprobed-03": {"nvidia.com/gpu": "1"}}


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    done = subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True)
    if check and done.returncode != 0:
        sys.exit(f"demo: kubectl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout


def boards() -> list[dict[str, Any]]:
    return [yaml.safe_load(p.read_text()) for p in sorted((EXAMPLES / "boards").glob("*.yaml"))]


def node_of(board: dict[str, Any]) -> dict[str, Any]:
    status = board["status"]
    name = board["metadata"]["name"]
    host = next(p for p in status["pools"] if p["kind"] in ("host", "unified"))
    nvidia = [g for g in status.get("gpus", []) if str(g.get("name", "")).startswith("NVIDIA")]
    capacity = {"cpu": "64", "pods": "110", "memory": str(host["capacityBytes"])}
    if nvidia:
        capacity["nvidia.com/gpu"] = str(len(nvidia))
    capacity.update(EXTRA_CAPACITY.get(name, {}))
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "continuum.dev/memory-mode": status["memoryMode"],
            },
        },
        "spec": {},
        "status": {"capacity": capacity, "allocatable": capacity},
    }


def renew_leases() -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    leases = [
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": agent_lease_metadata(b["metadata"]["name"]),
            "spec": {
                "holderIdentity": "continuum-demo",
                "leaseDurationSeconds": LEASE_SECONDS,
                "renewTime": now,
            },
        }
        for b in boards()
    ]
    kubectl("apply", "-f", "-", stdin=yaml_text.dump_all(leases))
    print(f"demo: renewed {len(leases)} node Leases (fresh for {LEASE_SECONDS // 60} minutes)")


def apply_nodes_and_boards() -> None:
    for board in boards():
        name = board["metadata"]["name"]
        kubectl("apply", "-f", "-", stdin=yaml_text.dump(node_of(board)))
        status = board["status"]
        spec_only = {k: v for k, v in board.items() if k != "status"}
        kubectl("apply", "-f", "-", stdin=yaml_text.dump(spec_only))
        kubectl("patch", "nodeboard", name, "--subresource=status", "--type=merge",
                "-p", json.dumps({"status": status}))  # fmt: skip
        print(f"demo: node/{name} with its board ({status['memoryMode']})")
    renew_leases()


def operator_pid() -> int | None:
    try:
        pid = int(PID_FILE.read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def stop_operator() -> None:
    pid = operator_pid()
    if pid is None:
        return
    os.kill(pid, signal.SIGTERM)
    for _ in range(100):
        if operator_pid() is None:
            break
        time.sleep(0.1)
    PID_FILE.unlink(missing_ok=True)
    print(f"demo: operator (pid {pid}) stopped")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_operator() -> None:
    stop_operator()  # a fresh operator for a fresh demo
    metrics_port = free_port()
    with LOG_FILE.open("a") as log:
        proc = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "continuum"), "operator",
             "--kubeconfig", os.environ["KUBECONFIG"], "--engine-image", engine_image(),
             # the real node has 2 CPUs: an engine of 1 leaves room for its minds' pods
             "--engine-cpu-min", "1",
             # the real turn's model lies on the node under this directory (docs/security.md)
             "--allowed-host-path-prefix", str(REAL_MODEL.parent),
             # a mind's child pods get the lowest class and CPU weight (docs/children.md)
             "--webhook", "--webhook-listen", "127.0.0.1", "--webhook-port", str(free_port()),
             "--grace", str(GRACE_SECONDS), "--metrics-port", str(metrics_port)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    PID_FILE.write_text(str(proc.pid))
    METRICS_PORT_FILE.write_text(str(metrics_port))
    time.sleep(1)
    if proc.poll() is not None:
        sys.exit(f"demo: the operator exited at once; see {LOG_FILE}")
    print(f"demo: operator started (pid {proc.pid}, log {LOG_FILE}, metrics on port "
          f"{metrics_port}, grace {GRACE_SECONDS} s)")  # fmt: skip


def apply_engines() -> list[tuple[str, str]]:
    docs = [yaml.safe_load(p.read_text()) for p in sorted((EXAMPLES / "engines").glob("*.yaml"))]
    for ns in sorted({d["metadata"]["namespace"] for d in docs}):
        manifest = kubectl("create", "namespace", ns, "--dry-run=client", "-o", "yaml")
        kubectl("apply", "-f", "-", stdin=manifest)
    print(kubectl("apply", "-f", str(EXAMPLES / "engines")), end="")
    return [(d["metadata"]["namespace"], d["metadata"]["name"]) for d in docs]


def condition(body: dict[str, Any], type_: str) -> dict[str, Any]:
    for c in (body.get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return dict(c)
    return {}


def settled(body: dict[str, Any]) -> bool:
    return (
        condition(body, "Ready").get("status") == "True"
        or condition(body, "Unschedulable").get("status") == "True"
        or condition(body, "Planned").get("reason") == "InvalidSpec"
    )


def wait_for(engines: list[tuple[str, str]], timeout: float = 90) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        items = json.loads(kubectl("get", "engines", "-A", "-o", "json"))["items"]
        mine = [i for i in items if (i["metadata"]["namespace"], i["metadata"]["name"]) in engines]
        if len(mine) == len(engines) and all(settled(i) for i in mine):
            return mine
        if time.monotonic() > deadline:
            print("demo: some engines have not settled yet; showing them as they are")
            return mine
        time.sleep(0.5)


def gib(n: int) -> str:
    return f"{n / GiB:,.1f}"


def table(items: list[dict[str, Any]]) -> str:
    head = ("ENGINE", "NODE", "MODE", "LAYERS", "MINDS", "POOL TOKENS", "DEVICE GiB", "HOST GiB",
            "READY", "WHY")  # fmt: skip
    rows = [head]
    for i in sorted(items, key=lambda i: i["metadata"]["name"]):
        status = i.get("status") or {}
        plan = status.get("plan") or {}
        ready = condition(i, "Ready")
        why = ready.get("reason", "")
        if ready.get("status") != "True":
            why += ": " + ready.get("message", "")
        elif plan.get("mindsGrantable", 0) < i["spec"].get("minds", {}).get("max", 1):
            why += f" ({condition(i, 'Degraded').get('message', '')})"
        if not plan:
            rows.append((i["metadata"]["name"], "-", "-", "-", "-", "-", "-", "-",
                         ready.get("status", "?"), why))  # fmt: skip
            continue
        b = plan["bytes"]
        rows.append(
            (
                i["metadata"]["name"],
                plan["node"],
                plan["memoryMode"] + ("" if plan["governed"] else " (ungoverned)"),
                f"{plan['layersOnDevice']}/{plan['totalLayers']}",
                str(plan["mindsGrantable"]),
                f"{plan['poolTokens']:,}",
                gib(b["device"]["total"]),
                gib(b["host"]["total"]),
                ready.get("status", "?"),
                why,
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(head) - 1)]
    lines = []
    for r in rows:
        cells = [r[c].ljust(widths[c]) for c in range(len(head) - 1)]
        why = r[-1] if len(r[-1]) <= 110 else r[-1][:107] + "..."
        lines.append("  ".join(cells) + "  " + why)
    return "\n".join(lines)


def start() -> int:
    apply_nodes_and_boards()
    start_operator()
    engines = apply_engines()
    print("demo: waiting for the operator to place or refuse every engine...")
    items = wait_for(engines)
    print()
    print(table(items))
    print()
    print(kubectl("get", "nodeboards", "-o", "wide"), end="")
    print()
    print(kubectl("get", "engines", "-A", "-o", "wide"), end="")
    print()
    # Each Engine's grant ledger, made at its first grant step (docs/grants.md).
    print(kubectl("get", "grantledgers", "-A"), end="")
    print()
    print(kubectl("get", "deployments,pods", "-n", "minds", "-o", "wide"), end="")
    env = f"CONTINUUM_CLUSTER_DIR={STATE}"
    metrics_port = METRICS_PORT_FILE.read_text().strip()
    print(
        f"""
What is real here and what is not:
- The API server, the scheduler, the controllers and the operator are real; the plans, grants
  and statuses above are the operator's.
- The nodes and every pod on them are KWOK fakes: a pod shows Running 1/1 and its Engine Ready
  once scheduled, but no container runs, no image is pulled, and nothing answers at an
  engine's Service or a Mind's endpoint. (A real turn needs a real node.)
- No engine gateway runs, so a reclaimed slot is released at its grace deadline: the operator
  runs with --grace {GRACE_SECONDS} (seconds; 30 by default) so a freed slot is not idle long.
- The operator's metrics: curl -s http://127.0.0.1:{metrics_port}/metrics | grep ^continuum_
- An Engine with a model file (examples/engines/with-source/) is not placed here: the
  operator reads a file's facts with a Job on the node, and KWOK nodes run no Job.

Look around (the control plane and the operator keep running):

    eval "$({env} tools/cluster env)"
    kubectl get nodeboards,engines -A -o wide
    kubectl describe engine -n minds llama-405b-f16     # why it is unschedulable, node by node
    kubectl get engine -n minds agent-32b -o yaml       # the full plan, placement, conditions
    kubectl get deployments,pods -n minds -o wide        # engines as pods on KWOK nodes (fakes)
    kubectl get events -n minds --sort-by=.lastTimestamp
    kubectl run build -n minds --image=busybox -l continuum.dev/mind=mira --dry-run=server \\
      -o jsonpath='{{.spec.priorityClassName}} {{.spec.containers[0].resources}}{{"\\n"}}'
    tail -f {LOG_FILE}

See a queue move (tiny-chat's two slots, four Minds of two classes; examples/minds/minds.yaml
says what each line will show):

    kubectl apply -f examples/minds/
    kubectl get minds -n minds                 # ada, bo Granted; cy Queued; dee Refused
    kubectl delete mind -n minds bo            # returns once her slot is freed ({GRACE_SECONDS} s)
    kubectl get minds -n minds                 # cy Granted
    curl -s http://127.0.0.1:{metrics_port}/metrics | grep ^continuum_grant_transitions_total

The demo's boards stay fresh for an hour (no node agent runs here): `tools/demo renew`.
Stop everything: `tools/demo stop`."""
    )
    if real_node_up():
        real_turn()
    return 0


REAL_NODE = "continuum-node"
# The real turn's Engine and Minds, apart from the KWOK example's in `minds` (whose queue the
# README reads line by line).
REAL_NS = "minds-real"
# The label tools/cluster node-up gives the real node: the real turn's Engine and pods keep to it.
REAL_NODE_LABEL = {"continuum.dev/real-node": "true"}
AGENT_PID_FILE = STATE / "agent.pid"
AGENT_LOG_FILE = STATE / "agent.log"
REAL_MODEL = Path("/var/lib/continuum/models/tiny.gguf")


def real_node_up() -> bool:
    return os.environ.get("CONTINUUM_DEMO_REAL_NODE") == "1"


def engine_image() -> str:
    """The engine image tools/images built (the real node runs it); a name only, otherwise."""
    if not real_node_up():
        return "continuum-engine:demo"
    out = subprocess.run([str(ROOT / "tools" / "images"), "refs"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return dict(line.split("=", 1) for line in out.split())["engine"]


def stop_agent() -> None:
    if AGENT_PID_FILE.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(AGENT_PID_FILE.read_text()), signal.SIGTERM)
        AGENT_PID_FILE.unlink(missing_ok=True)


def start_agent() -> None:
    """`continuum agent` for the real node, as the chart's DaemonSet would run it there."""
    stop_agent()
    with AGENT_LOG_FILE.open("a") as log:
        proc = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "continuum"), "agent", "--node-name", REAL_NODE,
             "--kubeconfig", os.environ["KUBECONFIG"], "--interval", "5"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    AGENT_PID_FILE.write_text(str(proc.pid))


def wait(what: str, probe: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(0.5)
    sys.exit(f"demo: timed out waiting for {what} (operator log: {LOG_FILE})")


def mind_grant(name: str) -> dict[str, Any]:
    status = json.loads(kubectl("get", "mind", "-n", REAL_NS, name, "-o", "json")).get("status", {})
    return {**(status.get("grant") or {}), "endpoint": status.get("endpoint")}


def turn(name: str, prompt: str) -> dict[str, Any]:
    """Her pod takes one turn at the address in her status, with her token."""
    pod = f"{name}-turn-{int(time.time())}"
    kubectl("apply", "-f", "-", stdin=yaml_text.dump(service_account(REAL_NS, name)))
    body = mind_pod(name=pod, namespace=REAL_NS, service_account_name=name,
                    engine_namespace=REAL_NS, engine_name="tiny-real",
                    endpoint=mind_grant(name)["endpoint"], image=engine_image(),
                    prompt=prompt, max_tokens=24,
                    node_selector=REAL_NODE_LABEL)  # fmt: skip
    kubectl("apply", "-f", "-", stdin=yaml_text.dump(body))

    def ended() -> bool:
        pod_body = json.loads(kubectl("get", "pod", "-n", REAL_NS, pod, "-o", "json"))
        return pod_body["status"].get("phase") in {"Succeeded", "Failed"}

    wait(f"{pod} to end", ended, 180)
    answer: dict[str, Any] = json.loads(
        kubectl("logs", "-n", REAL_NS, pod).strip().splitlines()[-1]
    )
    return answer


def real_turn() -> None:
    """A real engine on the real node, a Mind's turn through its gateway, and a reclaim."""
    print("\ndemo: a real turn on the real node (the tiny random-weight model: its text is noise)")
    start_agent()
    REAL_MODEL.parent.mkdir(parents=True, exist_ok=True)
    # The demo's own file (the same seed, the same bytes): a second `make demo` writes it again.
    made = subprocess.run([str(ROOT / ".venv" / "bin" / "continuum"), "model", "tiny",
                           str(REAL_MODEL), "--force"], capture_output=True, text=True)  # fmt: skip
    if made.returncode != 0:
        sys.exit(f"demo: continuum model tiny {REAL_MODEL} failed: {made.stderr.strip()}")
    REAL_MODEL.chmod(0o644)
    digest = hashlib.sha256(REAL_MODEL.read_bytes()).hexdigest()
    docs = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": REAL_NS}},
    ] + [
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "MindClass", "metadata": {"name": n},
         "spec": {"priority": p, "protectionWindowSeconds": 0}}
        for n, p in (("demo-batch", 0), ("demo-interactive", 10))
    ] + [
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "Engine",
         "metadata": {"name": "tiny-real", "namespace": REAL_NS},
         "spec": {"model": {"source": {"kind": "hostPath", "path": str(REAL_MODEL)},
                            "sha256": digest},
                  "contextTokensPerMind": 256, "minds": {"min": 1, "max": 1}, "offload": 0,
                  "reserveBytes": 0,
                  "placement": {"nodeSelector": REAL_NODE_LABEL}}},
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "Mind",
         "metadata": {"name": "rae", "namespace": REAL_NS},
         "spec": {"engine": "tiny-real", "className": "demo-batch", "contextTokens": 256}},
    ]  # fmt: skip
    kubectl("apply", "-f", "-", stdin=yaml_text.dump_all(docs))
    print("demo: waiting for tiny-real's facts Job and engine pod on the real node...")

    def ready() -> bool:
        body = json.loads(kubectl("get", "engine", "-n", REAL_NS, "tiny-real", "-o", "json"))
        return condition(body, "Ready").get("status") == "True"

    wait("tiny-real Ready", ready, 300)
    wait("rae's grant", lambda: mind_grant("rae").get("state") == "Granted", 120)
    grant = mind_grant("rae")
    print(f"demo: rae granted {grant.get('tokens')} tokens on slot {grant.get('slot')} "
          f"at {grant['endpoint']}")  # fmt: skip
    answer = turn("rae", "Hello")
    print(f"demo: rae's turn: HTTP {answer['status']}, {answer['events']} events, "
          f"{answer['seconds']} s: {answer['text']!r}")  # fmt: skip
    started = time.monotonic()
    kubectl(
        "apply",
        "-f",
        "-",
        stdin=yaml_text.dump(
            {
                "apiVersion": "continuum.dev/v1alpha1",
                "kind": "Mind",
                "metadata": {"name": "sol", "namespace": REAL_NS},
                "spec": {
                    "engine": "tiny-real",
                    "className": "demo-interactive",
                    "contextTokens": 256,
                },
            }
        ),
    )
    wait("sol's grant", lambda: mind_grant("sol").get("state") == "Granted", 120)
    print(f"demo: sol (class demo-interactive) reclaimed rae's slot in "
          f"{time.monotonic() - started:.1f} s: rae is {mind_grant('rae').get('state')} "
          f"({mind_grant('rae').get('reason')})")  # fmt: skip
    refused = turn("rae", "Hello again")
    print(f"demo: rae's next turn is refused: HTTP {refused['status']} {refused['error']}")
    print(f"""
Look at the real node:

    kubectl get pods -n {REAL_NS} -o wide --field-selector spec.nodeName={REAL_NODE}
    kubectl get minds -n {REAL_NS} rae sol
    kubectl logs -n {REAL_NS} -l continuum.dev/engine=tiny-real --tail=20""")


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else "start"
    if command == "stop":
        stop_agent()
        stop_operator()
        subprocess.run([str(ROOT / "tools" / "cluster"), "down"], check=False)
        return 0
    if command == "renew":
        renew_leases()
        return 0
    return start()


if __name__ == "__main__":
    sys.exit(main())
