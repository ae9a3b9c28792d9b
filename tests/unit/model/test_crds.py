"""The CRDs under crds/ are generated from the models and stay structural."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from continuum_operator.core.conditions import EngineFacts, PodPhase, engine_conditions
from continuum_operator.model import crdgen
from continuum_operator.model.base import CONDITION_REASON, Condition
from continuum_operator.model.engine import Engine
from tests.support.builders import ROOT

CRDS = ROOT / "crds"


def test_the_committed_crds_match_the_models() -> None:
    assert crdgen.main(["--check", str(CRDS)]) == 0, "run `make crds` and commit the result"


def test_a_drifted_crd_is_reported(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    crdgen.main([str(tmp_path)])
    victim = next(tmp_path.glob("*engines.yaml"))
    victim.write_text(victim.read_text().replace("maximum: 4096", "maximum: 4097"))
    assert crdgen.main(["--check", str(tmp_path)]) == 1
    assert victim.name in capsys.readouterr().err


def _walk(node: dict[str, Any], path: str) -> list[str]:
    """Paths of schema nodes that are not structural: no type and no x-kubernetes escape."""
    bad = []
    open_node = node.get("x-kubernetes-preserve-unknown-fields") or node.get(
        "x-kubernetes-int-or-string"
    )
    if "type" not in node and not open_node:
        bad.append(path)
    for key in ("$ref", "anyOf", "oneOf", "allOf", "additionalProperties"):
        allowed = (key == "additionalProperties" and isinstance(node.get(key), dict)) or (
            key == "anyOf" and node.get("x-kubernetes-int-or-string")
        )
        if key in node and not allowed:
            bad.append(f"{path} ({key})")
    if isinstance(node.get("exclusiveMinimum"), int) and not isinstance(
        node["exclusiveMinimum"], bool
    ):
        bad.append(f"{path} (numeric exclusiveMinimum)")
    for name, sub in node.get("properties", {}).items():
        bad += _walk(sub, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        bad += _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        bad += _walk(node["additionalProperties"], f"{path}{{}}")
    return bad


@pytest.mark.parametrize("resource", crdgen.RESOURCES, ids=lambda r: r.KIND)
def test_every_schema_node_is_structural(resource: type[Any]) -> None:
    schema = crdgen.crd(resource)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _walk(schema, "") == []


@pytest.mark.parametrize("resource", crdgen.RESOURCES, ids=lambda r: r.KIND)
def test_every_resource_has_printer_columns_and_a_status_subresource(resource: type[Any]) -> None:
    doc = yaml.safe_load((CRDS / f"continuum.dev_{resource.PLURAL}.yaml").read_text())
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1"
    assert [c["name"] for c in version["additionalPrinterColumns"]][-1] == "Age"
    if "status" in resource.model_fields:
        assert version["subresources"] == {"status": {}}


def test_minds_min_above_max_is_refused_by_a_cel_rule() -> None:
    spec = crdgen.crd(Engine)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    minds = spec["properties"]["spec"]["properties"]["minds"]
    assert {
        "rule": "self.min <= self.max",
        "message": "minds.min must not exceed minds.max",
    } in minds["x-kubernetes-validations"]


def _undescribed(node: dict[str, Any], path: str) -> list[str]:
    """Paths of schema properties (and list items or map values) that `kubectl explain` would
    show with no description."""
    bad = []
    for name, sub in node.get("properties", {}).items():
        if not sub.get("description", "").strip():
            bad.append(f"{path}.{name}")
        bad += _undescribed(sub, f"{path}.{name}")
    for key, mark in (("items", "[]"), ("additionalProperties", "{}")):
        if isinstance(node.get(key), dict):
            bad += _undescribed(node[key], path + mark)
    return bad


def _root(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((CRDS / name).read_text())
    root: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return root


COMMITTED = sorted(p.name for p in CRDS.glob("*.yaml"))


@pytest.mark.parametrize("name", COMMITTED)
def test_kubectl_explain_describes_every_field_of_every_kind(name: str) -> None:
    root = _root(name)
    assert root.get("description"), "the kind itself has no description (the class docstring)"
    for part in ("spec", "status"):
        if part in root["properties"]:
            assert root["properties"][part].get("description"), f"{part} has no description"
    # `metadata` is ObjectMeta's, described by the API server; a CRD may say nothing of it
    # beyond its name (the API server refuses a description there).
    assert "description" not in root["properties"]["metadata"]
    described = {
        **root,
        "properties": {k: v for k, v in root["properties"].items() if k != "metadata"},
    }
    assert _undescribed(described, name.split("_")[1].removesuffix(".yaml")) == []


def test_a_field_without_a_description_is_reported() -> None:
    schema = {"properties": {"a": {"description": "x", "items": {"properties": {"b": {}}}}}}
    assert _undescribed(schema, "") == [".a[].b"]


def _conditions(node: dict[str, Any], path: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for name, sub in node.get("properties", {}).items():
        if name == "conditions":
            found.append((f"{path}.{name}", sub))
        found += _conditions(sub, f"{path}.{name}")
    return found


@pytest.mark.parametrize("name", COMMITTED)
def test_conditions_are_a_map_keyed_by_type_with_a_required_reason(name: str) -> None:
    """The API conventions' conditions: one entry per type (server-side apply merges by it) and
    always a reason. Every status with conditions is checked, not only the first."""
    found = _conditions(_root(name), "")
    # A MindClass has no status; a GrantLedger's is a record the ledger's writer keeps, with no
    # condition of its own (its Engine's carry them).
    if name not in ("continuum.dev_mindclasses.yaml", "continuum.dev_grantledgers.yaml"):
        assert found, "no status.conditions found"
    for path, schema in found:
        assert schema["x-kubernetes-list-type"] == "map", path
        assert schema["x-kubernetes-list-map-keys"] == ["type"], path
        item = schema["items"]
        assert {"type", "status", "reason"} <= set(item["required"]), path
        assert item["properties"]["reason"]["minLength"] == 1, path


@pytest.mark.parametrize("reason", ["", "two words", "3Leading", "trailing:"])
def test_a_condition_without_a_one_word_reason_is_refused(reason: str) -> None:
    with pytest.raises(ValueError, match="reason"):
        Condition(type="Ready", status="True", reason=reason)


def test_a_condition_with_no_reason_at_all_is_refused() -> None:
    with pytest.raises(ValueError, match="reason"):
        Condition.model_validate({"type": "Ready", "status": "True"})


def test_the_engine_conditions_the_operator_writes_all_have_reasons() -> None:
    """Every condition type for every pod phase: the reason comes from an enum, never empty."""
    for pod in PodPhase:
        for conditions in (
            engine_conditions(EngineFacts(generation=1, pod=pod)),
            engine_conditions(EngineFacts(generation=1, pod=pod, board_fresh=False)),
        ):
            assert conditions and all(re.match(CONDITION_REASON, c.reason) for c in conditions)
