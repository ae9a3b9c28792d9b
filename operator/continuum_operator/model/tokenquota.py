"""TokenQuota: the most KV tokens all Minds of a namespace may hold at once (namespaced).

Summed over every engine the namespace's Minds use: a grant's tokens count while it is
`Granted` or `Reclaiming`. Several TokenQuotas in one namespace all apply (the tightest wins).
The operator enforces it in the allocator (`core.grants`, `QuotaExceeded`) and writes the
status; lowering a quota below what is held reclaims nothing (docs/tenancy.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from continuum_operator.model.base import (
    Conditions,
    Name,
    ObservedGeneration,
    Resource,
    Spec,
)


class TokenQuotaSpec(Spec):
    """The namespace's limit."""

    max_tokens: int = Field(
        ge=0,
        le=2**40,
        description="The most tokens the namespace's Minds may hold at once, over all engines.",
    )


class TokenQuotaStatus(Spec):
    """The namespace's use against the quota, written by the operator."""

    used_tokens: int = Field(default=0, ge=0, description="Tokens the namespace holds now.")
    minds_held: int = Field(default=0, ge=0, description="Minds holding a grant.")
    minds_queued: int = Field(default=0, ge=0, description="Minds the quota holds back.")
    queued: list[Name] = Field(
        default_factory=list, max_length=64, description="The first of them, by name."
    )
    conditions: Conditions = Field(
        default_factory=list,
        description="Limiting: True while this quota is the tightest and holds Minds back.",
    )
    observed_generation: ObservedGeneration = None


class TokenQuota(Resource):
    """The most KV tokens all Minds of a namespace may hold at once, over every engine
    (docs/tenancy.md)."""

    KIND = "TokenQuota"
    PLURAL = "tokenquotas"
    SHORT_NAMES = ("tq",)
    PRINTER_COLUMNS = (
        {"name": "Max-Tokens", "type": "integer", "jsonPath": ".spec.maxTokens"},
        {"name": "Used", "type": "integer", "jsonPath": ".status.usedTokens"},
        {"name": "Held", "type": "integer", "jsonPath": ".status.mindsHeld"},
        {"name": "Queued", "type": "integer", "jsonPath": ".status.mindsQueued"},
    )

    kind: Literal["TokenQuota"] = "TokenQuota"
    spec: TokenQuotaSpec
    status: TokenQuotaStatus = Field(default_factory=TokenQuotaStatus)
