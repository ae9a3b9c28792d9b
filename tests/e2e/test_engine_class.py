"""Below the engine, whoever makes the pod (docs/children.md "Pods her workloads make",
docs/security.md "The engines' class"), on the real API server with the chart's defaults.

A mind's Deployment, Job and CronJob, created by her service account, run their pods in the
children's class: the ReplicaSet and Job controllers of the test cluster make the pods from
templates the webhook mutated. And the chart's guard, on by default, refuses a pod or a pod
template asking for the engines' class in every namespace (the engines' too) unless the
operator's account writes it; the pods the controllers make from the operator's Deployment are
admitted."""

from __future__ import annotations

import copy
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from continuum_operator import yaml_text
from continuum_operator.kube.base.settings import ChildrenSettings, PodSettings
from continuum_operator.kube.children.membership import MIND_LABEL
from continuum_operator.kube.workloads.priority_classes import priority_classes
from tests.support.admission_policies import (
    EDITOR,
    install_checked,
    installed,
    kubectl_as,
    namespace_editor,
    policies,
    refused_once_active,
    scoped_namespace,
    tag,
)
from tests.support.cluster import Cluster
from tests.support.helm import documents, find_helm, one, template
from tests.support.local_http import free_port
from tests.support.webhook_operator import crds, operator, wait_ready, wait_while_up

pytestmark = pytest.mark.e2e

__all__ = ["crds", "installed", "tag"]  # fixtures, used by name

PODS = PodSettings()
ENGINE_CLASS = PODS.engine_priority_class


def pod_template(labels: dict[str, str], priority_class: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [
            {
                "name": "work",
                "image": "registry.local/none:1",
                "resources": {
                    "requests": {"cpu": "4", "memory": "64Mi"},
                    "limits": {"cpu": "4", "memory": "64Mi"},
                },
            }
        ],
    }
    if priority_class is not None:
        spec["priorityClassName"] = priority_class
    return {"metadata": {"labels": labels}, "spec": spec}


def deployment(name: str, priority_class: str | None) -> dict[str, Any]:
    t = pod_template({"app": name}, priority_class)
    t["spec"]["restartPolicy"] = "Always"
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}}, "template": t},
    }


def job(name: str, priority_class: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": pod_template({"app": name}, priority_class)},
    }


def cronjob(name: str, priority_class: str | None) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "CronJob",
        "metadata": {"name": name},
        "spec": {
            "schedule": "0 0 1 1 *",
            "jobTemplate": {"spec": job(name, priority_class)["spec"]},
        },
    }


def pod(name: str, priority_class: str | None) -> dict[str, Any]:
    t = pod_template({}, priority_class)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": t["spec"]}


def create_as(
    cluster: Cluster, user: str, body: dict[str, Any], ns: str, dry_run: bool = False
) -> subprocess.CompletedProcess[str]:
    args = ["create", "-f", "-", "-n", ns, "-o", "json", *(["--dry-run=server"] if dry_run else [])]
    return kubectl_as(cluster, user, *args, input=json.dumps(body))


def pods_of(cluster: Cluster, ns: str, app: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.get_json("pods", "-n", ns, "-l", f"app={app}")["items"]
    return items


VERBS = ["create", "get", "update", "patch"]


def workload_rbac(ns: str, user_kind: str, user: str, user_ns: str | None = None) -> list[Any]:
    """A Role to write Deployments, Jobs and CronJobs in `ns`, bound to one subject."""
    subject: dict[str, Any] = {"kind": user_kind, "name": user}
    if user_ns is not None:
        subject["namespace"] = user_ns
    else:
        subject["apiGroup"] = "rbac.authorization.k8s.io"
    name = f"workloads-{user_kind.lower()}"
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": name, "namespace": ns},
            "rules": [
                {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": VERBS},
                {"apiGroups": ["batch"], "resources": ["jobs", "cronjobs"], "verbs": VERBS},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": name, "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [subject],
        },
    ]


def assert_a_child(p: dict[str, Any], mind: str) -> None:
    spec = p["spec"]
    where = f"pod {p['metadata']['name']}: {json.dumps(spec)[:400]}"
    assert spec["priorityClassName"] == PODS.children_priority_class, where
    assert spec["priority"] == PODS.children_priority, where
    assert spec["preemptionPolicy"] == "Never", where
    resources = spec["containers"][0]["resources"]
    assert resources["requests"]["cpu"] == ChildrenSettings().cpu_request, where
    assert "cpu" not in resources.get("limits", {}), where
    assert p["metadata"]["labels"][MIND_LABEL] == mind  # counted if a later one is missed


def test_a_minds_deployment_job_and_cronjob_run_their_pods_in_the_childrens_class(
    cluster: Cluster,
    crds: None,
    namespace: str,
    tmp_path: Path,
    installed: Callable[[list[dict[str, Any]]], None],
) -> None:
    ns = namespace
    # The chart's defaults: the webhook and the engines' class guard both on. The webhook
    # mutates before the guard validates, so her Deployment asking for the engines' class is
    # admitted, in the children's class.
    install_checked(cluster, installed, policies({}, "-engine-priority-guard"))
    mind = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Mind",
        "metadata": {"name": "ada", "namespace": ns},
        "spec": {"engine": "coder", "contextTokens": 4096},
    }
    account = {"apiVersion": "v1", "kind": "ServiceAccount",
               "metadata": {"name": "ada", "namespace": ns}}  # fmt: skip
    cluster.apply([mind, account, *workload_rbac(ns, "ServiceAccount", "ada", ns)])
    as_ada = f"system:serviceaccount:{ns}:ada"
    with operator(cluster, tmp_path, free_port()) as op:
        wait_ready(op)  # her Minds listed, the webhook installed and serving
        # What the finding showed: her Deployment asking for the engines' class and 4 CPUs.
        made = {
            "web": create_as(cluster, as_ada, deployment("web", ENGINE_CLASS), ns),
            "build": create_as(cluster, as_ada, job("build", None), ns),
            "nightly": create_as(cluster, as_ada, cronjob("nightly", None), ns),
        }
        for name, proc in made.items():
            assert proc.returncode == 0, f"{name}: {proc.stderr}"
        assert f"priorityClassName {ENGINE_CLASS} replaced by" in made["web"].stderr  # warned
        web = wait_while_up(lambda: pods_of(cluster, ns, "web"), "the Deployment's pod", op)
        build = wait_while_up(lambda: pods_of(cluster, ns, "build"), "the Job's pod", op)
    # Made by the ReplicaSet and Job controllers, not by her account.
    assert web[0]["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
    assert build[0]["metadata"]["ownerReferences"][0]["kind"] == "Job"
    assert_a_child(web[0], "ada")
    assert_a_child(build[0], "ada")
    nightly = cluster.get_json("cronjob", "nightly", "-n", ns)
    t = nightly["spec"]["jobTemplate"]["spec"]["template"]
    assert t["spec"]["priorityClassName"] == PODS.children_priority_class
    assert t["metadata"]["labels"][MIND_LABEL] == "ada"


def test_the_engines_class_is_refused_to_every_pod_and_template_the_operator_did_not_write(
    cluster: Cluster, tag: str, installed: Callable[[list[dict[str, Any]]], None]
) -> None:
    # The class must exist, or the Priority admission plugin refuses the pod first, for that.
    classes = {c["metadata"]["name"]: c for c in priority_classes(PODS)}
    for body in classes.values():
        cluster.kubectl("create", "-f", "-", input=yaml_text.dump(body), check=False)
    # The chart's defaults: the guard is on, in every namespace.
    docs = policies({}, "-engine-priority-guard")
    install_checked(cluster, installed, docs)
    rendered = documents(template(find_helm(), {}, release="e2e").stdout)
    sa = one(rendered, "ServiceAccount", "-operator")["metadata"]
    operator_user = f"system:serviceaccount:{sa['namespace']}:{sa['name']}"

    ordinary = scoped_namespace(cluster, tag)
    # The old guard's opening: a namespace labelled for engines. It opens nothing now.
    engines = scoped_namespace(cluster, tag, **{"continuum.dev/engines": "allowed"})
    for ns in (ordinary, engines):
        namespace_editor(cluster, ns)
    cluster.apply(workload_rbac(engines, "User", operator_user))

    first = refused_once_active(
        lambda: create_as(cluster, EDITOR, pod("squatter", ENGINE_CLASS), ordinary, dry_run=True),
        "the guard refusing a pod of the engines' class",
    )
    for words in (
        f"Pod {ordinary}/squatter asks for PriorityClass {ENGINE_CLASS}",
        "kept for continuum engines",
        f"only the continuum operator ({operator_user})",
        f"not {EDITOR}",
    ):
        assert words in first.stderr, first.stderr
    for ns in (ordinary, engines):
        for body in (pod("squatter", ENGINE_CLASS), deployment("squat", ENGINE_CLASS),
                     job("squat", ENGINE_CLASS), cronjob("squat", ENGINE_CLASS)):  # fmt: skip
            answer = create_as(cluster, EDITOR, body, ns, dry_run=True)
            assert answer.returncode != 0, f"{body['kind']} in {ns} admitted"
            assert "kept for continuum engines" in answer.stderr, answer.stderr
        # Other classes are hers to ask for: the minds' (it never preempts) and none.
        for body in (pod("mind", PODS.mind_priority_class), pod("plain", None)):
            answer = create_as(cluster, EDITOR, body, ns, dry_run=True)
            assert answer.returncode == 0, answer.stderr

    # The operator's Deployment is admitted, and so is the pod the ReplicaSet controller makes.
    made = create_as(cluster, operator_user, deployment("engine", ENGINE_CLASS), engines)
    assert made.returncode == 0, made.stderr
    engine_pods = wait_for_pods(cluster, engines, "engine")
    assert engine_pods[0]["spec"]["priority"] == PODS.engine_priority
    # Its namespace's editor may not rewrite its template (her image at the engines' class).
    rewritten = copy.deepcopy(deployment("engine", ENGINE_CLASS))
    rewritten["spec"]["template"]["spec"]["containers"][0]["image"] = "registry.local/mine:1"
    answer = kubectl_as(cluster, EDITOR, "apply", "-n", engines, "--server-side",
                        "--force-conflicts", "-f", "-", input=json.dumps(rewritten))  # fmt: skip
    assert answer.returncode != 0 and "kept for continuum engines" in answer.stderr, answer


def wait_for_pods(cluster: Cluster, ns: str, app: str) -> list[dict[str, Any]]:
    from tests.support.waiting import wait_for as wait

    found: list[dict[str, Any]] = wait(
        f"pods of {app} in {ns}", lambda: pods_of(cluster, ns, app), timeout=60
    )
    return found
