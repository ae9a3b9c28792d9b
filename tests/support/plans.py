"""The example boards and engines the plan tests run over, and JSON Schema helpers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator.cli import main
from continuum_operator.model.plan_status import SPEC_GENERATION
from tests.support.builders import ROOT

BOARDS = sorted((ROOT / "examples" / "boards").glob("*.yaml"))


ENGINES = sorted((ROOT / "examples" / "engines").glob("*.yaml"))


def unschedulable_engine(tmp_path: Path) -> Path:
    """The first example Engine asking more context than any example board holds."""
    doc = yaml.safe_load(ENGINES[0].read_text())
    doc["spec"]["contextTokensPerMind"] = 16_000_000
    doc["spec"]["minds"] = {"min": 64, "max": 64}
    engine = tmp_path / "engine.yaml"
    engine.write_text(yaml.safe_dump(doc))
    return engine


def as_json_schema(node: Any) -> Any:
    """The CRD's schema read as the API server applies it, in JSON Schema: nullable is a null
    type, and an object with properties keeps nothing else (the server prunes the rest: closed
    here, so a field it would drop is an error)."""
    if isinstance(node, list):
        return [as_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: as_json_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes")}
    if out.pop("nullable", False):
        out["type"] = [out["type"], "null"]
    if "properties" in out:
        out["additionalProperties"] = False
    return out


def plans_as_status_holds_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Iterator[Any]:
    """Every example pair's plan, and an unschedulable one per board, as `continuum plan -o
    json` prints them (`ServingPlan.to_dict`, what `kube.engines.engine_pass.plan_status` writes)
    with the spec generation the operator adds."""
    huge = unschedulable_engine(tmp_path)
    for board in BOARDS:
        for engine in [*ENGINES, huge]:
            code = main(["plan", "--board", str(board), "--engine", str(engine), "-o", "json"])
            out, err = capsys.readouterr()
            assert code in (0, 3), err
            yield {**json.loads(out), SPEC_GENERATION: 7}
