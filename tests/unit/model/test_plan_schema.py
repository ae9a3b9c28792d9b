"""model/plan_output.schema.json describes `continuum plan -o json`, and cannot drift from it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from continuum_operator.cli import main
from continuum_operator.core.plan import ReasonCode
from continuum_operator.model.board import MemoryMode
from continuum_operator.model.engine import KvCacheType
from tests.support.builders import ROOT
from tests.support.plans import BOARDS, ENGINES, unschedulable_engine

SCHEMA_PATH = ROOT / "operator" / "continuum_operator" / "model" / "plan_output.schema.json"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
    return doc


@pytest.fixture(scope="module")
def validator(schema: dict[str, Any]) -> Draft202012Validator:
    Draft202012Validator.check_schema(schema)
    return Draft202012Validator(schema)


def _plan_json(capsys: pytest.CaptureFixture[str], board: Path, engine: Path) -> Any:
    code = main(["plan", "--board", str(board), "--engine", str(engine), "-o", "json"])
    out, err = capsys.readouterr()
    assert code in (0, 3), err
    return json.loads(out)


def _errors(validator: Draft202012Validator, doc: Any) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def test_the_schema_is_draft_2020_12(schema: dict[str, Any]) -> None:
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("board", BOARDS, ids=[b.stem for b in BOARDS])
@pytest.mark.parametrize("engine", ENGINES, ids=[e.stem for e in ENGINES])
def test_the_plan_of_every_example_pair_matches_the_schema(
    board: Path,
    engine: Path,
    validator: Draft202012Validator,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _errors(validator, _plan_json(capsys, board, engine)) == []


@pytest.mark.parametrize("board", BOARDS, ids=[b.stem for b in BOARDS])
def test_an_unschedulable_plan_matches_the_schema_too(
    board: Path,
    validator: Draft202012Validator,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    plan = _plan_json(capsys, board, unschedulable_engine(tmp_path))

    assert plan["schedulable"] is False
    assert _errors(validator, plan) == []


def test_the_schema_refuses_a_field_it_does_not_describe(
    validator: Draft202012Validator, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan_json(capsys, BOARDS[0], ENGINES[0])
    plan["bytes"]["device"]["scratch"] = 1
    plan["layersOnGpu"] = 1

    assert len(_errors(validator, plan)) == 2


def test_the_reason_codes_of_the_schema_are_the_reason_codes_of_the_plan(
    schema: dict[str, Any],
) -> None:
    code = schema["properties"]["reasons"]["items"]["properties"]["code"]
    assert sorted(code["enum"]) == sorted(str(c) for c in ReasonCode)


def test_the_words_of_the_schema_are_the_words_of_the_models(schema: dict[str, Any]) -> None:
    props = schema["properties"]
    assert sorted(props["memoryMode"]["enum"]) == sorted(str(m) for m in MemoryMode)
    assert sorted(props["kvCacheType"]["enum"]) == sorted(str(k) for k in KvCacheType)


def _objects(node: Any, where: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        if "properties" in node:
            yield where or "/", node
            for name, sub in node["properties"].items():
                yield from _objects(sub, f"{where}/{name}")
        if "items" in node:
            yield from _objects(node["items"], f"{where}[]")


def test_every_object_is_closed_and_every_field_described(schema: dict[str, Any]) -> None:
    objects = list(_objects(schema))
    assert len(objects) >= 6  # plan, budget, bytes, device, host, charge, reason
    for where, obj in objects:
        assert obj.get("additionalProperties") is False, where
        assert sorted(obj["required"]) == sorted(obj["properties"]), where
        for name, sub in obj["properties"].items():
            assert sub.get("description"), f"{where}/{name} has no description"


def test_the_schema_names_every_field_the_plan_prints(
    schema: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    plan = _plan_json(capsys, BOARDS[0], ENGINES[0])
    assert sorted(schema["properties"]) == sorted(plan)
