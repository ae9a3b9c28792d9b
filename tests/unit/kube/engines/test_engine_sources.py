"""Engine model sources as a trust boundary (docs/security.md): hostPath only under the cluster
admin's directories and only the file itself, pods of the `restricted` profile, and facts from
the file rather than from the tenant."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from continuum_operator.cli import build_parser
from continuum_operator.cli.operator import settings_from
from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.engines.engine_pass import Memory
from continuum_operator.kube.engines.reconcile import facts_disagreements, reconcile
from continuum_operator.kube.workloads import engine_objects, facts_job, lane_objects
from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
from continuum_operator.model.engine import Engine, ModelFacts
from tests.support.reconcile import (
    NOW,
    SETTINGS,
    after,
    conditions,
    discrete,
    engine_obj,
    snapshot,
    with_file_facts,
)

NO_PREFIXES = replace(SETTINGS, pods=PodSettings())


def host_path_engine(path: str) -> dict[str, Any]:
    body = engine_obj()
    body["spec"]["model"]["source"] = {"kind": "hostPath", "path": path}
    return body


def message(body: dict[str, Any], kind: str = "Planned") -> str:
    return str(next(c for c in body["status"]["conditions"] if c["type"] == kind)["message"])


# --- hostPath: only under the admin's directories ----------------------------------------------


@pytest.mark.parametrize("path", ["/", "/shadow", "/etc/kubernetes/admin.conf", "/models/m.gguf"])
def test_with_no_allowed_directory_every_host_path_is_refused_naming_the_setting(path: str) -> None:
    body = host_path_engine(path)
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, NO_PREFIXES)
    out = after(body, w)
    assert conditions(out)["Planned"] == ("False", "InvalidSpec")
    text = message(out)
    assert f"hostPath {path} is not under a directory" in text
    assert "--allowed-host-path-prefix" in text and "engineSources.allowedHostPathPrefixes" in text
    assert w.facts_job is None and w.deployment is None  # nothing mounts it, not even to read


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/srv/models/m.gguf", True),
        ("/srv/models/qwen/m.gguf", True),
        ("/srv/models-evil/m.gguf", False),  # a prefix is a directory, not a string
        ("/srv/models", False),  # the directory itself is not a file under it
        ("/srv/model.gguf", False),
    ],
)
def test_a_host_path_is_allowed_only_strictly_inside_an_allowed_directory(
    path: str, allowed: bool
) -> None:
    pods = PodSettings(allowed_host_path_prefixes=("/srv/models/",))
    model = Engine.model_validate(host_path_engine(path)).spec.model
    assert (engine_objects.host_path_refusal(model, pods) is None) is allowed


def test_an_allowed_host_path_is_read_by_a_job_mounting_only_the_file_read_only() -> None:
    body = host_path_engine("/models/coder.gguf")
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    assert conditions(after(body, w))["Planned"] == ("False", "FactsPending")
    job = w.facts_job
    assert job is not None
    pod = job["spec"]["template"]["spec"]
    assert pod["volumes"] == [
        {"name": "model", "hostPath": {"path": "/models/coder.gguf", "type": "File"}}
    ]
    (container,) = pod["containers"]
    assert container["volumeMounts"] == [
        {"name": "model", "mountPath": "/models/coder.gguf", "readOnly": True}
    ]
    assert pod["automountServiceAccountToken"] is False


def test_the_operator_flag_is_repeatable_and_refuses_relative_or_climbing_directories() -> None:
    parser = build_parser()
    args = parser.parse_args(
        ["operator", "--allowed-host-path-prefix", "/srv/models/",
         "--allowed-host-path-prefix", "/data"]
    )  # fmt: skip
    assert settings_from(args).pods.allowed_host_path_prefixes == ("/srv/models", "/data")
    assert settings_from(parser.parse_args(["operator"])).pods.allowed_host_path_prefixes == ()
    for bad in ("models", "/srv/../etc"):
        with pytest.raises(SystemExit):
            parser.parse_args(["operator", "--allowed-host-path-prefix", bad])


def test_a_lane_with_a_host_path_outside_the_allowed_directories_gets_no_pod() -> None:
    lane = EmbedLane.model_validate(
        {
            "apiVersion": "continuum.dev/v1alpha1",
            "kind": "EmbedLane",
            "metadata": {"name": "l", "namespace": "ns"},
            "spec": {
                "maxContextTokens": 512,
                "model": {**copy.deepcopy(engine_obj()["spec"]["model"]),
                          "source": {"kind": "hostPath", "path": "/etc/shadow"}},
            },
        }
    )  # fmt: skip
    placement = EmbedLanePlacement.model_validate(
        {"verdict": "Fits", "residence": "host", "node": "a"}
    )
    why = lane_objects.why_no_pod(lane, placement, None, PodSettings())
    assert why is not None and "hostPath /etc/shadow is not under" in why
    allowed = PodSettings(allowed_host_path_prefixes=("/etc",))
    assert lane_objects.why_no_pod(lane, placement, None, allowed) is None


# --- pods of the restricted profile ------------------------------------------------------------

RESTRICTED_CONTAINER = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
}
RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def _restricted(pod: dict[str, Any]) -> None:
    assert pod["securityContext"] == RESTRICTED_POD
    for c in pod["containers"]:
        assert c["securityContext"] == RESTRICTED_CONTAINER, c["name"]


def test_engine_facts_and_lane_pods_meet_the_restricted_profile() -> None:
    body = with_file_facts(host_path_engine("/models/coder.gguf"))
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    assert w.deployment is not None
    engine_pod = w.deployment["spec"]["template"]["spec"]
    _restricted(engine_pod)
    (c,) = engine_pod["containers"]
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]  # the one writable place
    engine = Engine.model_validate(body)
    _restricted(facts_job.facts_job(engine, "u", PodSettings())["spec"]["template"]["spec"])
    lane = EmbedLane.model_validate(
        {
            "apiVersion": "continuum.dev/v1alpha1",
            "kind": "EmbedLane",
            "metadata": {"name": "l", "namespace": "ns"},
            "spec": {"maxContextTokens": 512, "engine": "coder"},
        }
    )
    placement = EmbedLanePlacement.model_validate(
        {"verdict": "Fits", "residence": "host", "node": "a", "pools": []}
    )
    lane_pod = lane_objects.lane_deployment(lane, "u", placement, engine, PodSettings())
    _restricted(lane_pod["spec"]["template"]["spec"])


# --- facts: the file's, not the tenant's -------------------------------------------------------


def test_inline_facts_beside_a_source_wait_for_the_file_and_are_not_planned_from() -> None:
    body = host_path_engine("/models/coder.gguf")
    assert body["spec"]["model"]["facts"]  # inline facts given too
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    out = after(body, w)
    assert conditions(out)["Planned"] == ("False", "FactsPending")
    assert "plan" not in out["status"] and w.deployment is None


def test_inline_facts_that_disagree_with_the_file_are_refused_with_both_values() -> None:
    body = with_file_facts(host_path_engine("/models/coder.gguf"))
    file_kv = body["status"]["modelFacts"]["facts"]["kvBytesPerTokenPerLayer"]
    body["spec"]["model"]["facts"]["kvBytesPerTokenPerLayer"] = 1  # a tenant's lie: tiny KV
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    out = after(body, w)
    assert conditions(out)["Planned"] == ("False", "InvalidSpec")
    assert f"kvBytesPerTokenPerLayer is 1 inline, {file_kv} in the file" in message(out)
    assert w.deployment is None and "plan" not in out["status"]


def test_inline_facts_that_agree_with_the_file_are_planned() -> None:
    body = with_file_facts(host_path_engine("/models/coder.gguf"))
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    assert conditions(after(body, w))["Planned"] == ("True", "Planned")


def test_one_number_for_every_layer_agrees_with_a_list_of_it() -> None:
    base = {"layers": 3, "layerBytes": 10, "inputBytes": 1, "kvBytesPerTokenPerLayer": 8}
    one = ModelFacts.model_validate(base)
    listed = ModelFacts.model_validate({**base, "layerBytes": [10, 10, 10]})
    assert facts_disagreements(one, listed) == []
    other = ModelFacts.model_validate({**base, "layerBytes": [10, 10, 11]})
    assert facts_disagreements(one, other) == ["layerBytes is 10 inline, [10, 10, 11] in the file"]


@pytest.mark.parametrize("kv", [0, -1, [0, 0, 0], []])
def test_zero_or_negative_kv_facts_are_refused(kv: Any) -> None:
    with pytest.raises(ValueError, match="kvBytesPerTokenPerLayer"):
        ModelFacts.model_validate(
            {"layers": 3, "layerBytes": 10, "inputBytes": 1, "kvBytesPerTokenPerLayer": kv}
        )


def test_the_crd_refuses_a_kv_rate_below_one_given_as_one_number() -> None:
    from continuum_operator.model.crdgen import openapi_schema

    facts = openapi_schema(Engine)["properties"]["spec"]["properties"]["model"]["properties"][
        "facts"
    ]["properties"]["kvBytesPerTokenPerLayer"]
    assert facts["minimum"] == 1


# --- the chart -----------------------------------------------------------------------------------


def test_the_chart_allows_no_host_path_by_default_and_passes_the_admins_directories() -> None:
    from tests.support.helm import by_kind, documents, find_helm, one, template

    helm = find_helm()
    default = documents(template(helm, {}).stdout)
    policy = one(default, "ValidatingAdmissionPolicy", "-engine-sources")
    prefixes = next(v for v in policy["spec"]["variables"] if v["name"] == "prefixes")
    assert prefixes["expression"] == "[]"
    one(default, "ValidatingAdmissionPolicy", "-engine-status")
    operator = next(
        d for d in by_kind(default, "Deployment") if "operator" in d["metadata"]["name"]
    )
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert not [a for a in args if a.startswith("--allowed-host-path-prefix")]

    allowed = documents(
        template(helm, {"engineSources": {"allowedHostPathPrefixes": ["/srv/models/"]}}).stdout
    )
    policy = one(allowed, "ValidatingAdmissionPolicy", "-engine-sources")
    prefixes = next(v for v in policy["spec"]["variables"] if v["name"] == "prefixes")
    assert prefixes["expression"] == '["/srv/models/"]'
    operator = next(
        d for d in by_kind(allowed, "Deployment") if "operator" in d["metadata"]["name"]
    )
    args = operator["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--allowed-host-path-prefix=/srv/models/" in args
