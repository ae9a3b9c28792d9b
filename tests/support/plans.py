"""The example boards and engines the plan tests run over, and JSON Schema helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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
