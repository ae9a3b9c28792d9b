"""`model.plan_status.PlanStatus`, the plan as the operator reads and writes `status.plan`: it
names every field of the plan's JSON Schema and no other, and a plan as `continuum plan -o json`
prints it comes back out of the model as it went in (what the operator writes is unchanged)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from continuum_operator.kube.client.merge_patch import merge_patch
from continuum_operator.model.plan_status import (
    READING,
    SPEC_GENERATION,
    PlanStatus,
    plan_output_schema,
)
from tests.support.plans import plans_as_status_holds_them


def _fields(model: type[BaseModel]) -> dict[str, tuple[str, bool]]:
    return {(f.alias or name): (name, f.is_required()) for name, f in model.model_fields.items()}


def _nested(annotation: Any) -> type[BaseModel] | None:
    for arg in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _check(schema: dict[str, Any], model: type[BaseModel], where: str) -> None:
    fields = _fields(model)
    assert set(fields) == set(schema["properties"]), where
    for key, sub in schema["properties"].items():
        name, required = fields[key]
        nullable = "null" in (sub.get("type") if isinstance(sub.get("type"), list) else ())
        # What the schema requires and never lets be null, the model requires; no more.
        assert required == (key in schema.get("required", ()) and not nullable), f"{where}.{key}"
        inner = sub.get("items", sub)
        nested = _nested(model.model_fields[name].annotation)
        if inner.get("type") == "object" and "properties" in inner:
            assert nested is not None, f"{where}.{key}"
            _check(inner, nested, f"{where}.{key}")


def test_the_model_names_every_field_of_the_plans_schema_and_requires_what_it_requires() -> None:
    schema = plan_output_schema()
    status = {
        **schema,
        "properties": {**schema["properties"], SPEC_GENERATION: {}, READING: {}},
    }
    _check(status, PlanStatus, "status.plan")


def test_every_example_plan_comes_back_out_of_the_model_as_it_went_in(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = 0
    for doc in plans_as_status_holds_them(tmp_path, capsys):
        stored = merge_patch({}, doc)
        assert PlanStatus.model_validate(doc).to_status() == stored
        assert PlanStatus.model_validate(stored).to_status() == stored
        without = {k: v for k, v in stored.items() if k != SPEC_GENERATION}
        assert PlanStatus.model_validate(without).to_status() == without
        seen += 1
    assert seen > 0
