"""The CRDs under crds/ are generated from the models and stay structural."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from continuum_operator.model import crdgen
from continuum_operator.model.engine import Engine
from tests.builders import ROOT

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
