"""A mind's workloads: the pod templates her service account writes are mutated as her own pods
are, so the pods a controller makes from them are her children (docs/children.md, "Pods her
workloads make")."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from continuum_operator.kube.base.settings import ChildrenSettings, PodSettings
from continuum_operator.kube.children import webhook
from continuum_operator.kube.children.membership import (
    BACKGROUND,
    CLASS_ANNOTATION,
    CLASS_ENV,
    MIND_LABEL,
)
from continuum_operator.kube.children.workloads import WORKLOADS, mutate_workload
from tests.support.builders import tree

PODS = PodSettings(children_priority_class="kids", children_priority=-5)
CHILDREN = ChildrenSettings(cpu_request="1m")


def template(**spec: Any) -> dict[str, Any]:
    resources = {"requests": {"cpu": "4"}, "limits": {"cpu": "4", "memory": "1Gi"}}
    box = {"name": "web", "image": "nginx", "resources": resources}
    return {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [box], **spec}}


def workload(resource: tuple[str, str], **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"metadata": {"name": "w", "namespace": "ns"}}
    node = body
    for key in WORKLOADS[resource][:-1]:
        node = node.setdefault(key, {})
    node[WORKLOADS[resource][-1]] = template(**spec)
    return body


def template_of(resource: tuple[str, str], body: dict[str, Any]) -> dict[str, Any]:
    node: Any = body
    for key in WORKLOADS[resource]:
        node = node[key]
    return dict(node)


@pytest.mark.parametrize("resource", list(WORKLOADS))
def test_a_workload_a_mind_creates_gets_her_childs_template(resource: tuple[str, str]) -> None:
    body = workload(resource, priorityClassName="continuum-engine", priority=1_000_000)
    m = mutate_workload(resource, body, None, PODS, CHILDREN, "ada")
    assert m is not None
    t = template_of(resource, m.pod)
    assert t["spec"]["priorityClassName"] == "kids"
    # The Priority plugin resolves these on each pod from the class (and refuses a mismatch).
    assert "priority" not in t["spec"] and "preemptionPolicy" not in t["spec"]
    box = t["spec"]["containers"][0]
    assert box["resources"] == {"requests": {"cpu": "1m"}, "limits": {"memory": "1Gi"}}
    assert {"name": CLASS_ENV, "value": BACKGROUND} in box["env"]
    assert t["metadata"]["labels"] == {"app": "web", MIND_LABEL: "ada"}  # the pod handler sees it
    assert t["metadata"]["annotations"][CLASS_ANNOTATION] == BACKGROUND
    assert "pod template: priorityClassName continuum-engine replaced by kids" in m.notes
    assert tree(m.pod)["metadata"] == body["metadata"]  # the workload's own metadata is hers
    again = mutate_workload(resource, m.pod, None, PODS, CHILDREN, "ada")
    assert again is not None and again.pod == m.pod and not again.notes  # idempotent


def test_a_workload_no_mind_writes_is_left_alone() -> None:
    deployment = ("apps", "deployments")
    assert mutate_workload(deployment, workload(deployment), None, PODS, CHILDREN, None) is None
    pod_kind = ("", "pods")
    assert mutate_workload(pod_kind, workload(deployment), None, PODS, CHILDREN, "ada") is None


def test_an_update_is_mutated_only_when_it_writes_the_template() -> None:
    jobs = ("batch", "jobs")
    old = workload(jobs)
    scaled = copy.deepcopy(old)
    scaled["spec"]["parallelism"] = 3  # the template as it was: whoever wrote it decided
    assert mutate_workload(jobs, scaled, old, PODS, CHILDREN, "ada") is None
    rewritten = copy.deepcopy(old)
    rewritten["spec"]["template"]["spec"]["containers"][0]["image"] = "gcc"
    m = mutate_workload(jobs, rewritten, old, PODS, CHILDREN, "ada")
    assert m is not None
    assert tree(m.pod)["spec"]["template"]["spec"]["priorityClassName"] == "kids"


def test_the_configuration_sends_the_workloads_a_service_account_writes() -> None:
    cfg = tree(
        webhook.webhook_configuration(
            {"url": "https://127.0.0.1:9443", "caBundle": "Q0E="},
            ChildrenSettings(timeout_seconds=3),
        )
    )
    _, hook = cfg["webhooks"]
    assert hook["clientConfig"] == {"url": "https://127.0.0.1:9443/mind-workloads",
                                    "caBundle": "Q0E="}  # fmt: skip
    assert (hook["failurePolicy"], hook["timeoutSeconds"]) == ("Ignore", 3)
    sent = {(g, r) for rule in hook["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert sent == set(WORKLOADS)
    assert all(rule["operations"] == ["CREATE", "UPDATE"] for rule in hook["rules"])
    expression = hook["matchConditions"][0]["expression"]
    assert "!request.userInfo.username.startsWith('system:serviceaccount:kube-system:')" in (
        expression
    )
