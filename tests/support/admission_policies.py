"""The chart's ValidatingAdmissionPolicies on the local control plane and the parties they limit:
a policy and its binding as `helm template` renders them (`policies`), installed once the API
server has type-checked their CEL (`install_checked`, deleted after the test by `installed`), a
refusal waited for until the new policy is active (`refused_once_active`); namespaces of a test's
`tag` (`scoped_namespace`), and a namespace editor (`EDITOR`, `namespace_editor`) acting through
`kubectl --as` (`kubectl_as`)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.cluster import Cluster
from tests.support.helm import by_kind, documents, find_helm, template
from tests.support.waiting import wait_for

#: The label of a test's namespaces: `tag` deletes those of its value when the test ends.
SCOPE = "continuum.dev/e2e-scope"
EDITOR = "alice@example.com"  # a namespace editor: `edit`, and Engines, in her namespace only


@pytest.fixture
def tag(cluster: Cluster) -> Iterator[str]:
    """This test's label value; its namespaces are deleted when it ends."""
    value = uuid.uuid4().hex[:8]
    yield value
    cluster.kubectl("delete", "namespace", "-l", f"{SCOPE}={value}", "--wait=false", check=False)


def scoped_namespace(cluster: Cluster, tag: str, **labels: str) -> str:
    """A namespace of this test's `tag` (and `labels`), once its default ServiceAccount exists."""
    name = f"sc-{uuid.uuid4().hex[:8]}"
    cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": {SCOPE: tag, **labels}},
        }
    )
    cluster.kubectl("wait", "--for=create", "serviceaccount/default", "-n", name, "--timeout=60s")
    return name


def policies(values: dict[str, Any], suffix: str) -> list[dict[str, Any]]:
    """The chart's policy and binding named `*-<suffix>`, as `helm template` renders them."""
    docs = documents(template(find_helm(), values, release="e2e").stdout)
    kinds = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    return [d for k in kinds for d in by_kind(docs, k) if d["metadata"]["name"].endswith(suffix)]


@pytest.fixture
def installed(cluster: Cluster) -> Iterator[Callable[[list[dict[str, Any]]], None]]:
    """Applies policies; deletes them at the end whatever happened."""
    made: list[dict[str, Any]] = []

    def install(docs: list[dict[str, Any]]) -> None:
        made.extend(docs)
        cluster.apply(docs)

    yield install
    for d in reversed(made):
        kind = d["kind"].lower() + ".admissionregistration.k8s.io"
        cluster.kubectl("delete", kind, d["metadata"]["name"], "--ignore-not-found", check=False)


def type_checked(cluster: Cluster, name: str) -> dict[str, Any]:
    """The policy's status once the API server has type-checked its CEL."""

    def probe() -> dict[str, Any] | None:
        body = cluster.get_json("validatingadmissionpolicy", name)
        status = body.get("status") or {}
        done = status.get("observedGeneration") == body["metadata"]["generation"]
        return status if done else None

    return dict(wait_for(f"policy {name} type-checked", probe, timeout=60))


def install_checked(
    cluster: Cluster, installed: Callable[[list[dict[str, Any]]], None], docs: list[dict[str, Any]]
) -> None:
    """A chart policy and its binding installed, once the API server has type-checked its CEL
    with no warning."""
    assert [d["kind"] for d in docs] == [
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"
    ]  # fmt: skip
    installed(docs)
    status = type_checked(cluster, docs[0]["metadata"]["name"])
    assert not (status.get("typeChecking") or {}).get("expressionWarnings"), status


def kubectl_as(
    cluster: Cluster, user: str, *args: str, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    return cluster.kubectl("--as", user, *args, input=input, check=False)


def refused_once_active(
    create: Callable[[], subprocess.CompletedProcess[str]], what: str
) -> subprocess.CompletedProcess[str]:
    """`create` repeated until a policy refuses it (a new policy takes a moment to reach the
    API server's admission chain: seen past 60 s once in a full run on this machine, so the
    wait is longer, and the last answer is printed when it runs out)."""
    tries: list[subprocess.CompletedProcess[str]] = []

    def refused() -> subprocess.CompletedProcess[str] | None:
        tries.append(p := create())
        return p if p.returncode != 0 and "denied request" in p.stderr else None

    try:
        answer: subprocess.CompletedProcess[str] = wait_for(what, refused, timeout=180)
    except BaseException:
        last = tries[-1] if tries else None
        print(f"last try: {last and (last.returncode, last.stdout, last.stderr)}")
        raise
    return answer


def namespace_editor(cluster: Cluster, ns: str) -> None:
    """EDITOR gets the built-in `edit` role in `ns`, and Engines and EmbedLanes (not their
    status), as a cluster admin would give a team."""
    cluster.apply(
        [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "Role",
                "metadata": {"name": "continuum-editor", "namespace": ns},
                "rules": [
                    {
                        "apiGroups": ["continuum.dev"],
                        "resources": ["engines", "embedlanes", "minds"],
                        "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"],
                    }
                ],
            },
            *(
                {
                    "apiVersion": "rbac.authorization.k8s.io/v1",
                    "kind": "RoleBinding",
                    "metadata": {"name": f"alice-{role.lower()}", "namespace": ns},
                    "roleRef": {
                        "apiGroup": "rbac.authorization.k8s.io",
                        "kind": kind,
                        "name": role,
                    },
                    "subjects": [
                        {"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": EDITOR}
                    ],
                }
                for kind, role in (("ClusterRole", "edit"), ("Role", "continuum-editor"))
            ),
        ]
    )
