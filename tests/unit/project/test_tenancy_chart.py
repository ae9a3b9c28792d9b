"""The chart's tenancy policies (docs/tenancy.md), as `helm template` renders them: the MindClass
namespaces policy on by default and bound to every MindClass, the engine PriorityClass guard
on by default, in every namespace, keyed by who writes the pod or template; the operator's
TokenQuota rights. Their CEL is judged by the real API server in tests/e2e/test_tenancy.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.kube.children.workloads import WORKLOADS
from tests.support.helm import by_kind, documents, find_helm, one, template


@pytest.fixture(scope="module")
def helm_bin() -> Path:
    return find_helm()


def render(helm_bin: Path, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    return documents(template(helm_bin, values).stdout)


def test_the_mindclass_policy_is_installed_by_default_and_checks_every_class(
    helm_bin: Path,
) -> None:
    docs = render(helm_bin)
    policy = one(docs, "ValidatingAdmissionPolicy", "-mindclass-namespaces")["spec"]
    assert policy["paramKind"] == {"apiVersion": "continuum.dev/v1alpha1", "kind": "MindClass"}
    assert policy["failurePolicy"] == "Fail"
    [rule] = policy["matchConstraints"]["resourceRules"]
    assert (rule["resources"], rule["operations"]) == (["minds"], ["CREATE", "UPDATE"])
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "-mindclass-namespaces")["spec"]
    assert binding["policyName"].endswith("-mindclass-namespaces")
    # An empty selector: every MindClass is a parameter, each evaluated; none found: allowed.
    assert binding["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}
    assert binding["validationActions"] == ["Deny"]


def test_the_mindclass_policy_can_be_left_out_or_only_warn(helm_bin: Path) -> None:
    off = render(helm_bin, {"tenancy": {"mindClassPolicy": {"enabled": False}}})
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        names = [d["metadata"]["name"] for d in by_kind(off, kind)]
        assert not [n for n in names if n.endswith("-mindclass-namespaces")]
    warn = render(helm_bin, {"tenancy": {"mindClassPolicy": {"validationActions": ["Warn"]}}})
    binding = one(warn, "ValidatingAdmissionPolicyBinding", "-mindclass-namespaces")
    assert binding["spec"]["validationActions"] == ["Warn"]


def test_the_engine_priority_guard_is_on_by_default_everywhere_keyed_by_the_writer(
    helm_bin: Path,
) -> None:
    docs = render(helm_bin)
    account = one(docs, "ServiceAccount", "-operator")["metadata"]
    policy = one(docs, "ValidatingAdmissionPolicy", "-engine-priority-guard")["spec"]
    assert policy["failurePolicy"] == "Fail"
    rules = {
        (g, r): tuple(rule["operations"])
        for rule in policy["matchConstraints"]["resourceRules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
    }
    # Pods, and every built-in kind a controller makes pods from (tests/e2e: their CEL).
    assert rules == {
        ("", "pods"): ("CREATE",),
        **{k: ("CREATE", "UPDATE") for k in WORKLOADS},
    }
    variables = {v["name"]: v["expression"] for v in policy["variables"]}
    assert variables["reserved"] == '["continuum-engine"]'
    # Trusted by who writes, never by a label: the chart's operator account, the controllers.
    trusted = variables["trusted"]
    assert f'"system:serviceaccount:{account["namespace"]}:{account["name"]}"' in trusted
    assert "startsWith('system:serviceaccount:kube-system:')" in trusted
    assert "'system:masters' in request.userInfo.groups" in trusted
    assert "label" not in json.dumps(policy)
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "-engine-priority-guard")["spec"]
    assert "matchResources" not in binding  # every namespace, the engines' included
    assert binding["validationActions"] == ["Deny"]


def test_the_guard_takes_its_classes_trusted_users_and_scope_from_values(helm_bin: Path) -> None:
    scope = {"matchLabels": {"team": "a"}}
    values = {
        "tenancy": {
            "enginePriorityGuard": {
                "priorityClassNames": ["continuum-engine", "gold"],
                "trustedUsers": ["ops@example.com"],
                "namespaceSelector": scope,
            }
        }
    }
    docs = render(helm_bin, values)
    policy = one(docs, "ValidatingAdmissionPolicy", "-engine-priority-guard")["spec"]
    variables = {v["name"]: v["expression"] for v in policy["variables"]}
    assert variables["reserved"] == '["continuum-engine","gold"]'
    assert '"ops@example.com"' in variables["trusted"]
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "-engine-priority-guard")["spec"]
    assert binding["matchResources"]["namespaceSelector"] == scope
    off = render(helm_bin, {"tenancy": {"enginePriorityGuard": {"enabled": False}}})
    assert not [
        d
        for d in by_kind(off, "ValidatingAdmissionPolicy")
        if d["metadata"]["name"].endswith("-engine-priority-guard")
    ]


def test_bad_tenancy_values_are_refused_by_the_schema(helm_bin: Path) -> None:
    bad: dict[str, Any]
    for bad in (
        {"tenancy": {"mindClassPolicy": {"validationActions": ["Block"]}}},
        {"tenancy": {"enginePriorityGuard": {"priorityClassNames": []}}},
        {"tenancy": {"enginePriorityGuard": {"enabeld": True}}},
        {"tenancy": {"enginePriorityGuard": {"namespaceLabel": "continuum.dev/engines"}}},
    ):
        proc = template(helm_bin, bad, check=False)
        assert proc.returncode != 0, bad
        assert "tenancy" in proc.stderr, proc.stderr


def test_the_operator_may_read_token_quotas_and_write_only_their_status(helm_bin: Path) -> None:
    rules = one(render(helm_bin), "ClusterRole", "-operator")["rules"]

    def allowed(resource: str, verb: str) -> bool:
        return any(
            "continuum.dev" in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
            for r in rules
        )

    for verb in ("get", "list", "watch"):
        assert allowed("tokenquotas", verb)
    assert allowed("tokenquotas/status", "patch")
    for verb in ("create", "update", "patch", "delete"):
        assert not allowed("tokenquotas", verb)
