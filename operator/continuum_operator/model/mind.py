"""Mind: an agent that takes turns on an engine while it holds a grant of the engine's pool.

The grant's one home is the Engine's `status.grants`; a Mind's `status.grant` is only a
projection of it, written by the operator (docs/design.md "The grant ledger has one home").
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from continuum_operator.model.base import Condition, Name, ObjectMeta, Resource, Spec


class GrantState(StrEnum):
    QUEUED = "Queued"
    GRANTED = "Granted"
    RECLAIMING = "Reclaiming"
    RELEASED = "Released"


class ProjectedState(StrEnum):
    """A Mind's `status.grant.state`: her ledger entry's state, or `Refused` when she holds
    nothing until her spec, her class or the Engine changes: asking more than a slot or her
    class holds (`Released` in the ledger), or kept out of it (Engine or class not found, an
    Engine that does not serve her namespace)."""

    QUEUED = "Queued"
    GRANTED = "Granted"
    RECLAIMING = "Reclaiming"
    RELEASED = "Released"
    REFUSED = "Refused"


class MindSpec(Spec):
    engine: Name = Field(description="The Engine whose pool the mind draws on.")
    engine_namespace: Name | None = Field(
        default=None,
        description="The Engine's namespace; the Mind's own when absent. The Engine must list "
        "the Mind's namespace in spec.allowedNamespaces (docs/tenancy.md).",
    )
    class_name: Name | None = Field(
        default=None, description="A MindClass; the cluster's default class when absent."
    )
    context_tokens: int = Field(ge=1, le=16_777_216, description="Context the mind needs per turn.")
    turn_deadline_seconds: int = Field(default=1500, ge=1, le=86_400)


class GrantProjection(Spec):
    state: ProjectedState
    tokens: int = Field(default=0, ge=0)
    slot: int | None = Field(default=None, ge=0)
    since: str | None = None
    reason: str = ""
    message: str = ""


class MindStatus(Spec):
    grant: GrantProjection | None = None
    endpoint: str | None = Field(
        default=None,
        max_length=2048,
        description="Where she takes turns: her engine's gateway (docs/gateway.md).",
    )
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None


class Mind(Resource):
    KIND = "Mind"
    PLURAL = "minds"
    SHORT_NAMES = ("mnd",)
    PRINTER_COLUMNS = (
        {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"},
        {"name": "Class", "type": "string", "jsonPath": ".spec.className"},
        {"name": "Grant", "type": "string", "jsonPath": ".status.grant.state"},
        {"name": "Tokens", "type": "integer", "jsonPath": ".status.grant.tokens"},
        {"name": "Reason", "type": "string", "jsonPath": ".status.grant.reason"},
        {"name": "Message", "type": "string", "jsonPath": ".status.grant.message", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    )

    kind: Literal["Mind"] = "Mind"
    metadata: ObjectMeta
    spec: MindSpec
    status: MindStatus = Field(default_factory=MindStatus)
