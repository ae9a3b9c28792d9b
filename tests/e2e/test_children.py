"""A mind's children on the real API server (docs/design.md rule 8, docs/children.md): pods applied
with kubectl pass the operator's mutating webhook (kopf's admission server, a self-signed
certificate, the API server calling it on loopback); a child arrives at the lowest class and CPU
weight, a pod of no mind is untouched, and with the webhook stopped pods are still created,
unmutated, and counted (metric and event) once the operator is back."""

from __future__ import annotations

import json
import time
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
from tests.support.cluster import Cluster
from tests.support.local_http import free_port
from tests.support.webhook_operator import WEBHOOK, crds, operator, pod, wait_while_up

pytestmark = pytest.mark.e2e

__all__ = ["crds"]  # a fixture, used by name

PODS = PodSettings()


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
        wait_while_up(lambda: webhook_serving(cluster, namespace), "the webhook", op)
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
        mutated = wait_while_up(
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
        wait_while_up(lambda: webhook_serving(cluster, namespace), "the webhook", op)
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
        live = wait_while_up(
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

        found = wait_while_up(event, "the ChildNotMutated event", op)
        assert found["type"] == "Warning"
        assert "ada" in found["message"]
        cluster.kubectl("delete", "pod", "missed", "-n", namespace, "--wait=false")
        gone = wait_while_up(
            lambda: (
                op.metric("continuum_mind_children_unmutated_live", namespace=namespace) == 0
                and "gone"
            ),
            "the live count to fall when the child is deleted",
            op,
        )
        assert gone
