"""EmbedLane: an embedding context beside an engine, or with a model of its own.

Charged where it resides (docs/design.md rule 6): the operator writes `status.placement`
(residence, bytes per pool, floors), the lane runtime writes `status.runtime`.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from continuum_operator.model.base import (
    Bytes,
    Conditions,
    LabelNamedMeta,
    Name,
    ObservedGeneration,
    Resource,
    Spec,
    spec_config_with_rules,
)
from continuum_operator.model.engine import ModelRef
from continuum_operator.model.runtime import LaneRuntimeStatus


class EmbedLaneSpec(Spec):
    """Beside which engine (or with which model) the lane embeds, and its largest context."""

    model_config = spec_config_with_rules(
        {
            "rule": "has(self.engine) != has(self.model)",
            "message": "an EmbedLane names exactly one of engine or model",
        },
    )

    engine: Name | None = Field(default=None, description="Engine whose backend the lane shares.")
    model: ModelRef | None = Field(default=None, description="A model of the lane's own.")
    max_context_tokens: int = Field(
        ge=1, le=16_777_216, description="The largest context the lane embeds, in tokens."
    )

    @model_validator(mode="after")
    def _engine_or_model(self) -> Self:
        if (self.engine is None) == (self.model is None):
            raise ValueError("an EmbedLane names exactly one of `engine` or `model`")
        return self


class LanePoolBytes(Spec):
    """What the lane holds in one pool, and the floor no reclaim or grant goes below."""

    pool: str = Field(
        pattern=r"^(unified|host|device/[0-9]+)$",
        description="unified, host, or device/N for GPU N.",
    )
    bytes: Bytes = Field(description="Bytes charged there.")
    floor_bytes: Bytes = Field(
        default=0, description="The bytes of the largest context embedded, kept while it lives."
    )


class LaneContextBytes(Spec):
    """Bytes of the lane's context on each side."""

    device: Bytes = Field(default=0, description="On the device.")
    host: Bytes = Field(default=0, description="On the host.")


class EmbedLanePlacement(Spec):
    """Where the lane resides and what it is charged (core.embed.LanePlacement), written by
    the operator; floors never fall while the lane lives."""

    node: str = Field(min_length=1, max_length=253, description="The node of the lane.")
    verdict: Literal["Fits", "Waits", "Fails"] = Field(
        description="Fits (charged and placed), Waits (for room or an input) or Fails."
    )
    reason: str = Field(default="", max_length=64, description="Why, as one CamelCase word.")
    message: str = Field(default="", max_length=4096, description="Why, in words.")
    residence: Literal["device", "host", "split"] = Field(
        description="Where the context lives: device, host, or split (each pool charged its "
        "upper bound)."
    )
    residence_reason: str = Field(
        default="", max_length=64, description="Why it resides there, as one CamelCase word."
    )
    bytes_source: Literal["receipt", "estimate"] = Field(
        default="estimate", description="receipt (measured by the lane runtime) or estimate."
    )
    context_tokens: int = Field(default=0, ge=0, le=16_777_216, description="Context leased.")
    floor_tokens: int = Field(default=0, ge=0, le=16_777_216, description="Largest embedded.")
    context_bytes: LaneContextBytes = Field(default_factory=LaneContextBytes)
    gpus: list[int] = Field(default_factory=list, description="GPU indices it uses.")
    pools: list[LanePoolBytes] = Field(
        default_factory=list, description="What it is charged per pool, with floors."
    )


class EmbedLaneStatus(Spec):
    """Where the lane resides and what it is charged (the operator), what it has embedded (the
    lane runtime)."""

    placement: EmbedLanePlacement | None = None
    runtime: LaneRuntimeStatus | None = Field(
        default=None,
        description="What the lane runtime reports: the largest context embedded, receipts.",
    )
    conditions: Conditions = Field(default_factory=list, description="Placed, always present.")
    observed_generation: ObservedGeneration = None


class EmbedLane(Resource):
    """An embedding context beside an Engine, or with a model of its own, charged in the pools
    where it resides (docs/embedlanes.md)."""

    KIND = "EmbedLane"
    PLURAL = "embedlanes"
    SHORT_NAMES = ("lane",)
    PRINTER_COLUMNS = (
        {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"},
        {"name": "Max-Context", "type": "integer", "jsonPath": ".spec.maxContextTokens"},
        {"name": "Node", "type": "string", "jsonPath": ".status.placement.node"},
        {"name": "Residence", "type": "string", "jsonPath": ".status.placement.residence"},
        {"name": "Context", "type": "integer", "jsonPath": ".status.placement.contextTokens"},
        {
            "name": "Placed",
            "type": "string",
            "jsonPath": ".status.conditions[?(@.type=='Placed')].status",
        },
    )

    kind: Literal["EmbedLane"] = "EmbedLane"
    metadata: LabelNamedMeta  # its pod's labels carry the name
    spec: EmbedLaneSpec
    status: EmbedLaneStatus = Field(default_factory=EmbedLaneStatus)
