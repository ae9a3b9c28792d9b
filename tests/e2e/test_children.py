"""A mind's children on the real API server (docs/design.md rule 8, docs/children.md): pods applied
with kubectl pass the operator's mutating webhook (kopf's admission server, a self-signed
certificate, the API server calling it on loopback); a child arrives at the lowest class and CPU
weight, a pod of no mind is untouched, and with the webhook stopped pods are still created,
unmutated, and counted (metric and event) once the operator is back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.kube.base.settings import ChildrenSettings, PodSettings
from continuum_operator.kube.children.membership import (
    BACKGROUND,
    CLASS_ANNOTATION,
    CLASS_ENV,
    MIND_LABEL,
)
from tests.e2e.conftest import ROOT, Cluster
from tests.e2e.llama_fixtures import free_port
from tests.e2e.test_operator import scrape_metric

pytestmark = pytest.mark.e2e

PODS = PodSettings()
WEBHOOK = f"e2e-children-{int(time.time())}"


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> Iterator[None]:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=established", "--timeout=60s", "-f", str(ROOT / "crds")
    )
    yield
    cluster.kubectl("delete", "mutatingwebhookconfiguration", WEBHOOK, "--ignore-not-found",
                    check=False)  # fmt: skip


@dataclass
class Operator:
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        value = scrape_metric(self.metrics_url, name, **labels)
        return 0.0 if value is None else value

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def operator(cluster: Cluster, tmp: Path, webhook_port: int) -> Iterator[Operator]:
    """`continuum operator --webhook` on loopback, until the block ends."""
    log = tmp / f"operator-{time.monotonic_ns()}.log"
    port = free_port()
    cmd = [
        sys.executable, "-m", "continuum_operator.cli", "operator",
        "--kubeconfig", str(cluster.kubeconfig),
        "--engine-image", "continuum-engine:e2e",
        "--metrics-port", str(port),
        "--webhook", "--webhook-name", WEBHOOK,
        "--webhook-listen", "127.0.0.1", "--webhook-host", "127.0.0.1",
        "--webhook-port", str(webhook_port),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env)
    op = Operator(proc, log, f"http://127.0.0.1:{port}/metrics")
    try:
        yield op
    finally:
        op.stop()


def wait_for(probe: Callable[[], Any], what: str, op: Operator, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if op.proc.poll() is not None:
            pytest.fail(f"the operator exited while waiting for {what}:\n{op.log.read_text()}")
        try:
            found = probe()
        except Exception:  # not ready yet (metrics port, API)
            found = None
        if found:
            return found
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; operator log:\n{op.log.read_text()[-4000:]}")


def wait_ready(op: Operator, timeout: float = 90) -> list[int]:
    """Poll the operator's `/readyz` closely until it answers 200: the answers before it (a
    refused connection is no answer)."""
    url = op.metrics_url.removesuffix("/metrics") + "/readyz"
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if op.proc.poll() is not None:
            pytest.fail(f"the operator exited while waiting for /readyz:\n{op.log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return seen
                seen.append(answer.status)
        except urllib.error.HTTPError as err:
            seen.append(err.code)
        except OSError:  # not listening yet
            pass
        time.sleep(0.05)
    pytest.fail(f"/readyz not 200 in {timeout} s: {seen[-3:]}; log:\n{op.log.read_text()[-4000:]}")


def pod(name: str, ns: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {
            "containers": [
                {
                    "name": "work",
                    "image": "busybox",
                    "resources": {
                        "requests": {"cpu": "2", "memory": "64Mi"},
                        "limits": {"cpu": "2", "memory": "64Mi"},
                    },
                }
            ]
        },
    }


def webhook_serving(cluster: Cluster, ns: str) -> bool:
    """A server-side dry run of a child comes back mutated: the webhook is installed and reached."""
    probe = pod("probe", ns, {MIND_LABEL: "probe"})
    out = cluster.kubectl("apply", "--dry-run=server", "-o", "json", "-f", "-",
                          input=json.dumps(probe))  # fmt: skip
    return bool(json.loads(out.stdout)["metadata"].get("annotations", {}).get(CLASS_ANNOTATION))


def get_pod(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    body: dict[str, Any] = cluster.get_json("pod", name, "-n", ns)
    return body


def test_a_minds_child_arrives_with_the_lowest_class_and_cpu_weight_and_others_are_untouched(
    cluster: Cluster, crds: None, namespace: str, tmp_path: Path
) -> None:
    with operator(cluster, tmp_path, free_port()) as op:
        wait_for(lambda: webhook_serving(cluster, namespace), "the webhook", op)
        applied = cluster.kubectl(
            "apply", "-f", "-", input=json.dumps(pod("build", namespace, {MIND_LABEL: "ada"}))
        )
        cluster.apply(pod("web", namespace, {"app": "web"}))
        # A pod owned by a Mind, without the label: the API server's match condition sends it too.
        cluster.apply(
            {
                "apiVersion": "continuum.dev/v1alpha1",
                "kind": "Mind",
                "metadata": {"name": "bo", "namespace": namespace},
                "spec": {"engine": "coder", "contextTokens": 256},
            }
        )
        uid = cluster.get_json("mind", "bo", "-n", namespace)["metadata"]["uid"]
        owned = pod("owned", namespace)
        owned["metadata"]["ownerReferences"] = [
            {"apiVersion": "continuum.dev/v1alpha1", "kind": "Mind", "name": "bo", "uid": uid}
        ]
        cluster.apply(owned)
        mutated = wait_for(
            lambda: op.metric("continuum_mind_children_mutated_total", namespace=namespace),
            "the mutation metric",
            op,
        )
        assert mutated == 2  # the two children, not the dry-run probes nor the pod of no mind
        classes = {c["metadata"]["name"]: c for c in cluster.get_json("priorityclasses")["items"]}
    child = get_pod(cluster, namespace, "build")
    spec = child["spec"]
    assert spec["priorityClassName"] == PODS.children_priority_class
    assert spec["priority"] == PODS.children_priority
    assert spec["preemptionPolicy"] == "Never"
    resources = spec["containers"][0]["resources"]
    assert resources["requests"] == {"cpu": ChildrenSettings().cpu_request, "memory": "64Mi"}
    assert resources["limits"] == {"memory": "64Mi"}  # no CPU limit: every idle core is usable
    assert child["status"]["qosClass"] == "Burstable"
    assert child["metadata"]["annotations"][CLASS_ANNOTATION] == BACKGROUND
    assert {"name": CLASS_ENV, "value": BACKGROUND} in spec["containers"][0]["env"]
    assert "CPU limit 2 removed" in applied.stderr  # the admission warning reaches the client
    # The class it runs at is installed by the operator: the lowest of all, never preempting.
    installed = classes[PODS.children_priority_class]
    assert installed["value"] == PODS.children_priority
    assert installed["preemptionPolicy"] == "Never"
    assert all(installed["value"] <= c["value"] for c in classes.values())

    owned = get_pod(cluster, namespace, "owned")
    assert owned["spec"]["priorityClassName"] == PODS.children_priority_class
    assert owned["metadata"]["labels"][MIND_LABEL] == "bo"  # so the count watches it

    other = get_pod(cluster, namespace, "web")
    assert "priorityClassName" not in other["spec"]
    assert other["spec"].get("priority", 0) == 0
    assert other["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"
    assert CLASS_ANNOTATION not in (other["metadata"].get("annotations") or {})


def test_with_the_webhook_stopped_children_are_created_unmutated_and_counted(
    cluster: Cluster, crds: None, namespace: str, tmp_path: Path
) -> None:
    webhook_port = free_port()
    with operator(cluster, tmp_path, webhook_port) as op:
        wait_for(lambda: webhook_serving(cluster, namespace), "the webhook", op)
        cluster.apply(pod("reached", namespace, {MIND_LABEL: "ada"}))
    # The operator is stopped; its configuration stays (failure policy Ignore) and calls a
    # closed port: pod creation does not block on it.
    config = cluster.get_json("mutatingwebhookconfiguration", WEBHOOK)
    assert config["webhooks"][0]["failurePolicy"] == "Ignore"
    started = time.monotonic()
    cluster.apply(pod("missed", namespace, {MIND_LABEL: "ada"}))
    took = time.monotonic() - started
    missed = get_pod(cluster, namespace, "missed")
    assert CLASS_ANNOTATION not in (missed["metadata"].get("annotations") or {})
    assert missed["spec"].get("priority", 0) == 0
    assert missed["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"
    assert took < ChildrenSettings().timeout_seconds + 15, f"creation took {took:.1f} s"

    with operator(cluster, tmp_path, webhook_port) as op:
        live = wait_for(
            lambda: op.metric("continuum_mind_children_unmutated_live", namespace=namespace),
            "the count of unmutated children",
            op,
        )
        assert live == 1  # "missed" only: "reached" carries the mark
        assert op.metric("continuum_mind_children_unmutated_total", namespace=namespace) == 1

        def event() -> dict[str, Any] | None:
            items = cluster.get_json(
                "events", "-n", namespace, "--field-selector", "involvedObject.name=missed"
            )["items"]
            return next((e for e in items if e["reason"] == "ChildNotMutated"), None)

        found = wait_for(event, "the ChildNotMutated event", op)
        assert found["type"] == "Warning"
        assert "ada" in found["message"]
        cluster.kubectl("delete", "pod", "missed", "-n", namespace, "--wait=false")
        gone = wait_for(
            lambda: (
                op.metric("continuum_mind_children_unmutated_live", namespace=namespace) == 0
                and "gone"
            ),
            "the live count to fall when the child is deleted",
            op,
        )
        assert gone
