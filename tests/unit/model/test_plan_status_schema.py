"""The Engine CRD types `status.plan` with the plan's own JSON Schema (`model.plan_status`): the
API server keeps every field the operator writes there, and refuses what the plan never writes."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft202012Validator

from continuum_operator.model.plan_status import READING, SPEC_GENERATION, plan_output_schema
from tests.support.builders import ROOT
from tests.support.plans import (
    BOARDS,
    ENGINES,
    as_json_schema,
    plans_as_status_holds_them,
)


def crd_plan_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "continuum.dev_engines.yaml").read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    plan: dict[str, Any] = root["properties"]["status"]["properties"]["plan"]
    return plan


def test_status_plan_is_typed_open_only_where_the_plan_copies_a_receipt_whole() -> None:
    plan = crd_plan_schema()
    assert plan["type"] == "object" and "x-kubernetes-preserve-unknown-fields" not in plan
    open_parts = [
        name
        for name, sub in plan["properties"].items()
        if sub.get("x-kubernetes-preserve-unknown-fields")
    ]
    assert open_parts == ["receipt"]
    assert plan["properties"][SPEC_GENERATION]["type"] == "integer"


def test_the_crd_names_every_field_of_the_plans_schema_with_its_type() -> None:
    def fields(node: dict[str, Any], where: str = "") -> Iterator[tuple[str, Any]]:
        for name, sub in node.get("properties", {}).items():
            kind = sub.get("type")
            kinds = kind if isinstance(kind, list) else [kind]
            yield f"{where}/{name}", [t for t in kinds if t != "null"]
            yield from fields(sub, f"{where}/{name}")
            if "items" in sub:
                yield from fields(sub["items"], f"{where}/{name}[]")

    crd = dict(fields(as_json_schema(crd_plan_schema())))
    docs = dict(fields(plan_output_schema()))
    crd.pop(f"/{SPEC_GENERATION}")
    crd.pop(f"/{READING}")  # the operator's, as specGeneration: not a field of the plan's
    # An enum without a type in the plan's schema is a string in the CRD.
    assert crd == {k: ["string"] if v == [None] else v for k, v in docs.items()}


def merge_patched(value: Any) -> Any:
    """`value` as the API server stores it from a JSON merge patch (RFC 7386, how the operator
    writes status): a null deletes its field."""
    if isinstance(value, dict):
        return {k: merge_patched(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [merge_patched(v) for v in value]
    return value


def test_every_plan_as_status_holds_it_passes_the_crd_schema_and_loses_no_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    validator = Draft202012Validator(as_json_schema(crd_plan_schema()))
    plans = list(plans_as_status_holds_them(tmp_path, capsys))
    assert len(plans) == len(BOARDS) * (len(ENGINES) + 1)
    assert any(p["schedulable"] for p in plans) and not all(p["schedulable"] for p in plans)
    assert any(p["budget"]["device"] is None for p in plans)  # nulls: written by a replace
    # Replaced whole (nulls kept: nullable) or merge-patched (nulls deleted: not required).
    faults = {
        (i, how, "/".join(map(str, e.absolute_path)), e.message)
        for i, p in enumerate(plans)
        for how, doc in (("replace", p), ("merge patch", merge_patched(p)))
        for e in validator.iter_errors(doc)
    }
    assert faults == set()


def test_the_crd_schema_refuses_what_the_plan_never_writes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    validator = Draft202012Validator(as_json_schema(crd_plan_schema()))
    plan = next(plans_as_status_holds_them(tmp_path, capsys))
    for path, value in (
        (("memoryMode",), "shared"),
        (("layersOnDevice",), -1),
        (("bytes", "device", "weights"), "1 GiB"),
        (("charges",), [{"pool": "device/0"}]),
    ):
        bad = copy.deepcopy(plan)
        target = bad
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        assert list(validator.iter_errors(bad)), path
