"""An Engine's `status.plan` as its CRD types it: the plan's JSON Schema (`plan_output.schema.json`
beside this module, what `continuum plan -o json` prints; tests/unit/model/test_plan_schema.py holds
it to the plan) in the structural form the API server takes (the rest of the translation is
`model.crdgen`'s, as for every schema), with `specGeneration`, the spec generation the plan was
made for (`kube.engines.engine_pass.plan_status`).

One schema for both, so `kubectl explain engine.status.plan` says what docs/plan.md says, and
the API server keeps every field the operator writes (a typed object prunes the fields its
schema does not name: tests/unit/model/test_plan_status_schema.py checks the plans of every example
against it). Pure: reads a file of this package.

`PlanStatus` is the same plan as the operator reads and writes it: a `core.plan.ServingPlan`
becomes one (`kube.engines.engine_pass.plan_status`), and everything built from a plan in force
(the engine's Deployment, its conditions, the damper's shape) reads its fields, never the dict.
tests/unit/model/test_plan_status_model.py holds its fields to the schema's.
"""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any, Literal

from pydantic import Field

from continuum_operator.model.base import Bytes, Spec
from continuum_operator.model.board import MemoryMode
from continuum_operator.model.kv import KvCacheType
from continuum_operator.model.receipt import Receipt

__all__ = [
    "READING",
    "SPEC_GENERATION",
    "EnginePoolBytes",
    "PlanBudget",
    "PlanBytes",
    "PlanPart",
    "PlanReason",
    "PlanStatus",
    "plan_output_schema",
    "plan_status_schema",
]

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


# -- the plan as the operator reads it ----------------------------------------------------------
# Field for field the schema above (`plan_output.schema.json`, which describes each); what the
# schema lets be null defaults to None, as a merge patch leaves such a field absent.


class PlanBudget(Spec):
    """What each side may use, net of reserve; None where it is not governed."""

    device: int | None = None
    host: int | None = None
    per_process_cap: int | None = None
    shared: int | None = None


class PlanPart(Spec):
    """Bytes one side (device or host) puts in its pool."""

    weights: int
    kv: int
    compute: int
    reserve: int
    park: int
    total: int

    def in_use(self) -> int:
        """The bytes the engine allocates on this side: all but the reserve kept free."""
        return self.weights + self.kv + self.compute + self.park


class PlanBytes(Spec):
    device: PlanPart
    host: PlanPart


# A plan's charge and its placement's lease are one idea: the placement is written from the
# plan's charges (`core.placements.placement_of`).
class EnginePoolBytes(Spec):
    """Bytes leased in one pool of the node."""

    pool: str = Field(
        pattern=r"^(unified|host|disk|device/[0-9]+)$",
        description="unified, host, disk (a park store on disk), or device/N for GPU N.",
    )
    bytes: Bytes = Field(description="Bytes leased there.")


class PlanReason(Spec):
    """Why the plan is what it is: a code of `core.plan`'s and its message."""

    code: str
    message: str


class PlanStatus(Spec):
    """An Engine's `status.plan`: the serving plan (`continuum plan -o json`), with the spec
    generation it was made for and the reading of its node it was made on, where known."""

    node: str
    memory_mode: MemoryMode
    governed: bool
    schedulable: bool
    layers_on_device: int
    total_layers: int
    gpu_servable: bool
    pool_tokens: int
    minds_grantable: int
    context_tokens_per_mind: int
    kv_cache_type: KvCacheType
    gpus: tuple[int, ...]
    budget: PlanBudget
    bytes: PlanBytes
    charges: tuple[EnginePoolBytes, ...]
    engine_args: tuple[str, ...]
    reasons: tuple[PlanReason, ...]
    source: Literal["receipt", "estimate"]
    receipt: Receipt | None = None
    spec_generation: int | None = Field(default=None, alias=SPEC_GENERATION)
    reading: str | None = Field(default=None, alias=READING)

    def to_status(self) -> dict[str, object]:
        """The plan as status holds it: what `continuum plan -o json` prints, less its nulls (a
        merge patch deletes a null field, so the API server never keeps one: a plan written
        back unchanged is then no change), with the spec generation and the reading where
        known."""
        doc: dict[str, object] = self.model_dump(by_alias=True, mode="json", exclude_none=True)
        return doc
