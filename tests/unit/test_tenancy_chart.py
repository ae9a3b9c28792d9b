"""The chart's tenancy policies (docs/tenancy.md), as `helm template` renders them: the MindClass
namespaces policy on by default and bound to every MindClass, the engine PriorityClass guard
off by default and scoped to namespaces not labelled for engines, the operator's TokenQuota
rights. Their CEL is judged by the real API server in tests/e2e/test_tenancy.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helm import by_kind, documents, find_helm, one, template

GUARD = {"tenancy": {"enginePriorityGuard": {"enabled": True}}}


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
    # The engine guard is opt-in: engine namespaces must be labelled first.
    assert not [
        d
        for d in by_kind(docs, "ValidatingAdmissionPolicy")
        if d["metadata"]["name"].endswith("-engine-priority-guard")
    ]


def test_the_mindclass_policy_can_be_left_out_or_only_warn(helm_bin: Path) -> None:
    off = render(helm_bin, {"tenancy": {"mindClassPolicy": {"enabled": False}}})
    for kind in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
        names = [d["metadata"]["name"] for d in by_kind(off, kind)]
        assert not [n for n in names if n.endswith("-mindclass-namespaces")]
    warn = render(helm_bin, {"tenancy": {"mindClassPolicy": {"validationActions": ["Warn"]}}})
    binding = one(warn, "ValidatingAdmissionPolicyBinding", "-mindclass-namespaces")
    assert binding["spec"]["validationActions"] == ["Warn"]


def test_the_engine_priority_guard_refuses_the_engine_class_outside_labelled_namespaces(
    helm_bin: Path,
) -> None:
    docs = render(helm_bin, GUARD)
    policy = one(docs, "ValidatingAdmissionPolicy", "-engine-priority-guard")["spec"]
    [rule] = policy["matchConstraints"]["resourceRules"]
    assert (rule["resources"], rule["operations"]) == (["pods"], ["CREATE"])
    assert policy["variables"] == [{"name": "reserved", "expression": '["continuum-engine"]'}]
    message = policy["validations"][0]["messageExpression"]
    assert "kubectl label namespace ' + request.namespace" in message
    assert "continuum.dev/engines=allowed" in message
    binding = one(docs, "ValidatingAdmissionPolicyBinding", "-engine-priority-guard")["spec"]
    assert binding["matchResources"]["namespaceSelector"] == {
        "matchExpressions": [
            {"key": "continuum.dev/engines", "operator": "NotIn", "values": ["allowed"]}
        ]
    }


def test_the_guard_takes_its_classes_label_and_extra_scope_from_values(helm_bin: Path) -> None:
    extra = [{"key": "team", "operator": "In", "values": ["a"]}]
    values = {
        "tenancy": {
            "enginePriorityGuard": {
                "enabled": True,
                "priorityClassNames": ["continuum-engine", "gold"],
                "namespaceLabel": "example.com/engines",
                "namespaceLabelValue": "yes",
                "extraMatchExpressions": extra,
            }
        }
    }
    docs = render(helm_bin, values)
    policy = one(docs, "ValidatingAdmissionPolicy", "-engine-priority-guard")["spec"]
    assert policy["variables"][0]["expression"] == '["continuum-engine","gold"]'
    assert "example.com/engines=yes" in policy["validations"][0]["messageExpression"]
    selector = one(docs, "ValidatingAdmissionPolicyBinding", "-engine-priority-guard")["spec"][
        "matchResources"
    ]["namespaceSelector"]
    assert selector["matchExpressions"] == [
        {"key": "example.com/engines", "operator": "NotIn", "values": ["yes"]},
        *extra,
    ]


def test_bad_tenancy_values_are_refused_by_the_schema(helm_bin: Path) -> None:
    bad: dict[str, Any]
    for bad in (
        {"tenancy": {"mindClassPolicy": {"validationActions": ["Block"]}}},
        {"tenancy": {"enginePriorityGuard": {"priorityClassNames": []}}},
        {"tenancy": {"enginePriorityGuard": {"enabeld": True}}},
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
