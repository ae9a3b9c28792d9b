"""Mind: an agent that takes turns on an engine while it holds a grant of the engine's pool.

The grant's one home is the Engine's GrantLedger (`status.grants`); a Mind's `status.grant` is
only a projection of it, written by the operator (docs/design.md "The grant ledger has one home").
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from continuum_operator.model.base import (
    Bytes,
    Conditions,
    Name,
    ObservedGeneration,
    Resource,
    Spec,
)


class GrantState(StrEnum):
    QUEUED = "Queued"
    GRANTED = "Granted"
    RECLAIMING = "Reclaiming"
    RELEASED = "Released"


#: The states in which a mind holds a slot (a tuple: StrEnum members compare equal to their
#: string values, so it serves the ledger's plain entries and the allocator's grants alike).
HOLDING_STATES = (GrantState.GRANTED, GrantState.RECLAIMING)


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
    """The engine a mind takes turns on, her class and the context she needs."""

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
    turn_deadline_seconds: int = Field(
        default=1500,
        ge=1,
        le=86_400,
        description="The longest one turn waits for a grant, queued or behind a relaunch, "
        "before her turn client gives up with the reason (`engine.turn`).",
    )


class GrantProjection(Spec):
    """Her grant as the Engine's GrantLedger (`status.grants`) holds it; the operator copies it
    here."""

    state: ProjectedState
    tokens: int = Field(default=0, ge=0, description="KV tokens she holds (Granted, Reclaiming).")
    slot: int | None = Field(default=None, ge=0, description="Her slot on the engine.")
    since: str | None = Field(default=None, description="When she entered the state (RFC 3339).")
    reason: str = Field(default="", description="Why she is in the state, as one CamelCase word.")
    message: str = Field(default="", description="Why, in words, and what would change it.")


class ParkedContext(Spec):
    """Her context in her Engine's park store (docs/gateway.md, "Parked contexts"), as the
    engine reports it (`status.runtime.park`): restored at her next request on a slot."""

    tokens: int = Field(ge=0, le=16_777_216, description="Tokens of her context parked.")
    bytes: Bytes = Field(description="Bytes of the Engine's park store it takes.")


class MindStatus(Spec):
    """Her grant, where she takes turns, and her conditions; written by the operator."""

    grant: GrantProjection | None = None
    parked: ParkedContext | None = Field(
        default=None,
        description="Her context parked in her Engine's park store, as its runtime last "
        "reported it; absent: none.",
    )
    endpoint: str | None = Field(
        default=None,
        max_length=2048,
        description="Where she takes turns: her engine's gateway (docs/gateway.md).",
    )
    conditions: Conditions = Field(
        default_factory=list, description="Granted and ContextTooLarge, each always present."
    )
    observed_generation: ObservedGeneration = None


class Mind(Resource):
    """An agent that takes turns on an Engine while she holds a grant of its KV-cache pool
    (docs/grants.md)."""

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
    )

    kind: Literal["Mind"] = "Mind"
    spec: MindSpec
    status: MindStatus = Field(default_factory=MindStatus)
