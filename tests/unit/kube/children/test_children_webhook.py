"""The children's webhook as pure functions: which pods are a mind's children, how one is
mutated (class, CPU weight, mark), the configuration the API server is given, and the count of
children the webhook did not reach (docs/design.md rule 8, docs/children.md)."""

from __future__ import annotations

import copy
from typing import Any

from continuum_operator.kube.base.settings import ChildrenSettings, PodSettings
from continuum_operator.kube.children import membership as children
from continuum_operator.kube.children import webhook
from continuum_operator.kube.children.membership import (
    BACKGROUND,
    CLASS_ANNOTATION,
    CLASS_ENV,
    MIND_LABEL,
    mind_of,
    mutate,
)
from continuum_operator.kube.children.webhook import Unmarked
from tests.support.builders import tree

PODS = PodSettings(children_priority_class="kids", children_priority=-5)
CHILDREN = ChildrenSettings(cpu_request="1m")


def pod(
    *,
    labels: dict[str, str] | None = None,
    owners: list[dict[str, Any]] | None = None,
    containers: list[dict[str, Any]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "build-1", "namespace": "ns", "uid": "u-1"}
    if labels is not None:
        meta["labels"] = labels
    if owners is not None:
        meta["ownerReferences"] = owners
    box = {"name": "make", "image": "gcc", "resources": {}}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": containers or [box], **spec},
    }


def child(**kw: Any) -> dict[str, Any]:
    return pod(labels={MIND_LABEL: "ada", "app": "build"}, **kw)


def mutated(p: dict[str, Any]) -> dict[str, Any]:
    m = mutate(p, PODS, CHILDREN)
    assert m is not None
    return m.pod


# --------------------------------------------------------------------------------------------
# whose child


def test_a_pod_labelled_with_a_mind_is_that_minds_child() -> None:
    assert mind_of(child()) == "ada"


def test_a_pod_owned_by_a_mind_is_her_child_and_gets_her_label() -> None:
    owner = {"apiVersion": "continuum.dev/v1alpha1", "kind": "Mind", "name": "bo", "uid": "m"}
    p = pod(owners=[owner])
    assert mind_of(p) == "bo"
    assert mutated(p)["metadata"]["labels"] == {MIND_LABEL: "bo"}


def test_an_owned_child_of_a_mind_whose_name_is_no_label_value_is_admitted_without_it() -> None:
    long = "m" * 64  # a Mind's name may be 253 characters, a label value 63
    owner = {"apiVersion": "continuum.dev/v1alpha1", "kind": "Mind", "name": long, "uid": "m"}
    m = mutate(pod(owners=[owner]), PODS, CHILDREN)
    assert m is not None
    assert MIND_LABEL not in tree(m.pod)["metadata"]["labels"]
    assert tree(m.pod)["spec"]["priorityClassName"] == "kids"
    assert any("no label value" in n for n in m.notes)


def test_a_pod_of_no_mind_is_left_untouched() -> None:
    other_mind = {"apiVersion": "example.com/v1", "kind": "Mind", "name": "x", "uid": "m"}
    for p in (pod(), pod(labels={"app": "web"}), pod(owners=[other_mind])):
        before = copy.deepcopy(p)
        assert mutate(p, PODS, CHILDREN) is None
        assert p == before


MINDS = {"ns/ada", "team/bo"}


def test_a_pod_her_service_account_creates_is_her_child_without_the_label() -> None:
    creator = children.mind_of_creator("system:serviceaccount:ns:ada", MINDS.__contains__)
    assert creator == "ada"
    m = mutate(pod(labels={"app": "build"}), PODS, CHILDREN, creator)
    assert m is not None
    assert tree(m.pod)["metadata"]["labels"] == {"app": "build", MIND_LABEL: "ada"}  # now counted
    assert tree(m.pod)["spec"]["priorityClassName"] == "kids"


def test_only_the_service_account_of_an_existing_mind_makes_children() -> None:
    def of(user: str) -> str | None:
        return children.mind_of_creator(user, MINDS.__contains__)

    assert of("system:serviceaccount:ns:web") is None  # no Mind ns/web
    assert of("system:serviceaccount:team:ada") is None  # ada is a Mind of ns, not of team
    assert of("ada") is None  # a user, not a service account
    assert of("system:serviceaccount:ns:ada:x") is None
    assert of("") is None
    assert mutate(pod(), PODS, CHILDREN, None) is None


# --------------------------------------------------------------------------------------------
# the mutation


def test_a_child_gets_the_lowest_class_with_its_priority_and_never_preempts() -> None:
    spec = mutated(child())["spec"]
    assert spec["priorityClassName"] == "kids"
    assert spec["priority"] == -5
    assert spec["preemptionPolicy"] == "Never"


def test_a_child_requests_the_least_cpu_and_has_no_cpu_limit_but_keeps_its_memory() -> None:
    box = {
        "name": "make",
        "resources": {
            "requests": {"cpu": "4", "memory": "1Gi"},
            "limits": {"cpu": "4", "memory": "2Gi"},
        },
    }
    init = {"name": "fetch", "resources": {"limits": {"cpu": "500m"}}}
    m = mutate(child(containers=[box], initContainers=[init]), PODS, CHILDREN)
    assert m is not None
    spec = tree(m.pod)["spec"]
    assert spec["containers"][0]["resources"] == {
        "requests": {"cpu": "1m", "memory": "1Gi"},
        "limits": {"memory": "2Gi"},
    }
    assert spec["initContainers"][0]["resources"] == {"requests": {"cpu": "1m"}}
    assert any("CPU limit 4 removed" in n for n in m.notes)


def test_pod_level_cpu_is_dropped_so_the_containers_minimal_requests_decide() -> None:
    spec = mutated(child(resources={"limits": {"cpu": "2", "memory": "1Gi"}}))["spec"]
    assert spec["resources"] == {"limits": {"memory": "1Gi"}}
    spec = mutated(child(resources={"requests": {"cpu": "2"}}))["spec"]
    assert "resources" not in spec


def test_a_child_is_marked_for_the_runner_inside_it() -> None:
    box = {"name": "make", "env": [{"name": "A", "value": "1"}, {"name": CLASS_ENV, "value": "x"}]}
    p = mutated(child(containers=[box]))
    assert p["metadata"]["annotations"][CLASS_ANNOTATION] == BACKGROUND
    assert p["spec"]["containers"][0]["env"] == [
        {"name": "A", "value": "1"},
        {"name": CLASS_ENV, "value": BACKGROUND},
    ]
    assert children.is_marked(p)


def test_a_class_the_child_asked_for_is_replaced_and_the_client_is_told() -> None:
    m = mutate(child(priorityClassName="high"), PODS, CHILDREN)
    assert m is not None
    assert tree(m.pod)["spec"]["priorityClassName"] == "kids"
    assert any("high replaced by kids" in n for n in m.notes)


def test_a_cpu_request_the_child_asked_for_is_replaced_and_the_client_is_told() -> None:
    # Found by review: a LimitRange with a CPU min refused the pod naming a request of 1m it
    # never asked for, and nothing said the webhook wrote it.
    box = {"name": "make", "resources": {"requests": {"cpu": "2"}}}
    m = mutate(child(containers=[box]), PODS, CHILDREN)
    assert m is not None
    assert (
        tree(m.pod)["spec"]["containers"][0]["resources"]["requests"]["cpu"] == CHILDREN.cpu_request
    )
    assert any(f"make: CPU request 2 replaced by {CHILDREN.cpu_request}" in n for n in m.notes)


def test_the_mutation_is_idempotent_and_leaves_its_input_alone() -> None:
    box = {"name": "make", "resources": {"limits": {"cpu": "1"}}}
    p = child(containers=[box], priorityClassName="high")
    before = copy.deepcopy(p)
    once = mutate(p, PODS, CHILDREN)
    assert once is not None
    assert p == before
    twice = mutate(once.pod, PODS, CHILDREN)
    assert twice is not None
    assert twice.pod == once.pod
    assert twice.notes == ()


def test_the_kept_fields_of_a_child_are_unchanged() -> None:
    p = child(nodeSelector={"a": "b"}, restartPolicy="Never")
    out = mutated(p)
    assert out["spec"]["nodeSelector"] == {"a": "b"}
    assert out["spec"]["restartPolicy"] == "Never"
    assert out["spec"]["containers"][0]["image"] == "gcc"
    assert out["metadata"]["labels"]["app"] == "build"


# --------------------------------------------------------------------------------------------
# the configuration


def test_the_configuration_ignores_failures_and_sends_only_a_minds_new_pods() -> None:
    cfg = tree(
        webhook.webhook_configuration(
            {"url": "https://127.0.0.1:9443", "caBundle": "Q0E="},
            ChildrenSettings(webhook_name="wh", timeout_seconds=3),
        )
    )
    assert cfg["kind"] == "MutatingWebhookConfiguration"
    assert cfg["metadata"]["name"] == "wh"
    hook, workloads = cfg["webhooks"]
    assert workloads["name"] == "workloads.children.continuum.dev"  # test_child_workloads.py
    assert hook["failurePolicy"] == "Ignore"
    assert hook["timeoutSeconds"] == 3
    assert hook["clientConfig"] == {
        "url": f"https://127.0.0.1:9443/{webhook.HANDLER_ID}",
        "caBundle": "Q0E=",
    }
    assert hook["rules"][0]["resources"] == ["pods"]
    assert hook["rules"][0]["operations"] == ["CREATE"]
    expression = hook["matchConditions"][0]["expression"]
    assert MIND_LABEL in expression and "'Mind'" in expression
    # Pods made by a service account (a mind's may be one) are sent too, but not the
    # controllers' (kube-system): every Deployment's pods would be.
    assert "request.userInfo.username.startsWith('system:serviceaccount:')" in expression
    assert "!request.userInfo.username.startsWith('system:serviceaccount:kube-system:')" in (
        expression
    )


def test_with_a_service_the_configuration_names_it_and_no_url() -> None:
    """A managed API server may not resolve cluster DNS: a Service reference it resolves itself."""
    kopf_config = {"url": "https://op.ns.svc:9443", "caBundle": "Q0E="}
    cfg = tree(
        webhook.webhook_configuration(
            kopf_config, ChildrenSettings(port=9443, service=("continuum-system", "ctm-webhook"))
        )
    )
    assert cfg["webhooks"][0]["clientConfig"] == {
        "service": {
            "namespace": "continuum-system",
            "name": "ctm-webhook",
            "port": 9443,
            "path": f"/{webhook.HANDLER_ID}",
        },
        "caBundle": "Q0E=",
    }
    other_port = ChildrenSettings(service=("ns", "svc"), service_port=443)
    client = tree(webhook.webhook_configuration(kopf_config, other_port))["webhooks"][0][
        "clientConfig"
    ]
    assert client["service"]["port"] == 443


# --------------------------------------------------------------------------------------------
# children the webhook did not reach


def test_an_unmarked_child_is_counted_once_and_forgotten_when_deleted() -> None:
    seen = Unmarked()
    p = child()
    assert seen.observe(p, deleted=False) is True
    assert seen.observe(p, deleted=False) is False  # a later event on the same pod
    assert seen.count("ns") == 1
    assert seen.observe(p, deleted=True) is False
    assert seen.count("ns") == 0


def test_marked_children_and_pods_of_no_mind_are_not_counted() -> None:
    seen = Unmarked()
    assert seen.observe(mutated(child()), deleted=False) is False
    assert seen.observe(pod(), deleted=False) is False
    assert seen.count("ns") == 0


def test_the_event_on_an_unmutated_child_has_one_name_per_pod() -> None:
    p = child()
    a = tree(webhook.unmutated_event(p, PODS, "op-1", "2026-01-01T00:00:00Z"))
    b = tree(webhook.unmutated_event(p, PODS, "op-2", "2026-01-02T00:00:00Z"))
    assert a["metadata"]["name"] == b["metadata"]["name"]
    assert a["type"] == "Warning"
    assert a["involvedObject"]["kind"] == "Pod"
    assert "ada" in a["message"] and "kids" in a["message"]


def test_a_self_signed_certificate_names_the_address_the_api_server_calls(tmp_path: Any) -> None:
    import ssl

    cert, key = webhook.self_signed(["127.0.0.1", "0.0.0.0", "op.svc"])
    (tmp_path / "c.pem").write_bytes(cert)
    (tmp_path / "k.pem").write_bytes(key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "c.pem", tmp_path / "k.pem")
    decoded = ssl._ssl._test_decode_cert(str(tmp_path / "c.pem"))  # type: ignore[attr-defined]
    sans = set(decoded["subjectAltName"])
    assert ("IP Address", "127.0.0.1") in sans
    assert ("DNS", "op.svc") in sans
