"""An Engine's `status.plan` as its CRD types it: the plan's JSON Schema (`plan_output.schema.json`
beside this module, what `continuum plan -o json` prints; tests/unit/model/test_plan_schema.py holds
it to the plan) in the structural form the API server takes (the rest of the translation is
`model.crdgen`'s, as for every schema), with `specGeneration`, the spec generation the plan was
made for (`kube.engines.engine_pass.plan_status`).

One schema for both, so `kubectl explain engine.status.plan` says what docs/plan.md says, and
the API server keeps every field the operator writes (a typed object prunes the fields its
schema does not name: tests/unit/model/test_plan_status_schema.py checks the plans of every example
against it). Pure: reads a file of this package.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

__all__ = ["READING", "SPEC_GENERATION", "plan_output_schema", "plan_status_schema"]

SPEC_GENERATION = "specGeneration"
READING = "reading"

# What `model.crdgen` does not already translate for every schema (titles, `additionalProperties:
# false`, an enum's type): the document's own keywords, and uniqueItems, which the API server
# refuses (quadratic to check); the plan writes each GPU once.
_DROPPED = {"$schema", "$id", "uniqueItems"}


@cache
def plan_output_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of `continuum plan -o json`."""
    text = resources.files(__package__).joinpath("plan_output.schema.json").read_text()
    schema: dict[str, Any] = json.loads(text)
    return schema


def _structural(node: Any) -> Any:
    if isinstance(node, list):
        return [_structural(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _structural(v) for k, v in node.items() if k not in _DROPPED}
    kind = out.get("type")
    if isinstance(kind, list):
        # ["integer", "null"]: OpenAPI v3.0 says nullable instead.
        (out["type"],) = [t for t in kind if t != "null"]
        if "null" in kind:
            out["nullable"] = True
    if "required" in out:
        # A null is written by a merge patch as a deletion (RFC 7386): a field the plan may
        # write as null is absent from the stored object then, so it cannot be required.
        props = out.get("properties", {})
        out["required"] = [k for k in out["required"] if not props.get(k, {}).get("nullable")]
    if out.get("type") == "object" and "properties" not in out:
        # An object the plan copies whole (the receipt, docs/receipts.md): kept as written.
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def plan_status_schema(description: str) -> dict[str, Any]:
    """The CRD schema of `status.plan`, described by `description` (the field's own)."""
    schema: dict[str, Any] = _structural(plan_output_schema())
    schema["properties"][SPEC_GENERATION] = {
        "type": "integer",
        "minimum": 0,
        "description": "The Engine's metadata.generation the plan was made for.",
    }
    schema["properties"][READING] = {
        "type": "string",
        "maxLength": 64,
        "description": "A digest of what the plan read of its node (the board's pools and mode, "
        "the other leases there, the receipts), when it was made or last confirmed: a re-plan "
        "with other arguments on the same reading is held (PlanHeld, docs/operator.md).",
    }
    return {**schema, "description": description, "nullable": True}
