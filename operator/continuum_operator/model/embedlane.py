"""EmbedLane: an embedding context beside an engine, or with a model of its own.

Charged where it resides (docs/design.md rule 6): the operator writes `status.placement`
(residence, bytes per pool, floors), the lane runtime writes `status.runtime`.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from continuum_operator.model.base import (
    Bytes,
    Condition,
    LabelNamedMeta,
    Name,
    OpenStatus,
    Resource,
    Spec,
)
from continuum_operator.model.engine import ModelRef


class EmbedLaneSpec(Spec):
    model_config = Spec.model_config | {
        "json_schema_extra": {
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.engine) != has(self.model)",
                    "message": "an EmbedLane names exactly one of engine or model",
                }
            ]
        }
    }

    engine: Name | None = Field(default=None, description="Engine whose backend the lane shares.")
    model: ModelRef | None = Field(default=None, description="A model of the lane's own.")
    max_context_tokens: int = Field(ge=1, le=16_777_216)

    @model_validator(mode="after")
    def _engine_or_model(self) -> Self:
        if (self.engine is None) == (self.model is None):
            raise ValueError("an EmbedLane names exactly one of `engine` or `model`")
        return self


class LanePoolBytes(Spec):
    """What the lane holds in one pool, and the floor no reclaim or grant goes below."""

    pool: str = Field(pattern=r"^(unified|host|device/[0-9]+)$")
    bytes: Bytes
    floor_bytes: Bytes = 0


class LaneContextBytes(Spec):
    device: Bytes = 0
    host: Bytes = 0


class EmbedLanePlacement(Spec):
    """Where the lane resides and what it is charged (core.embed.LanePlacement), written by
    the operator; floors never fall while the lane lives."""

    node: str = Field(min_length=1, max_length=253)
    verdict: Literal["Fits", "Waits", "Fails"]
    reason: str = Field(default="", max_length=64)
    message: str = Field(default="", max_length=4096)
    residence: Literal["device", "host", "split"]
    residence_reason: str = Field(default="", max_length=64)
    bytes_source: Literal["receipt", "estimate"] = "estimate"
    context_tokens: int = Field(default=0, ge=0, le=16_777_216, description="Context leased.")
    floor_tokens: int = Field(default=0, ge=0, le=16_777_216, description="Largest embedded.")
    context_bytes: LaneContextBytes = Field(default_factory=LaneContextBytes)
    gpus: list[int] = Field(default_factory=list)
    pools: list[LanePoolBytes] = Field(default_factory=list)


class EmbedLaneStatus(Spec):
    model_config = Spec.model_config | {"extra": "allow"}

    placement: EmbedLanePlacement | None = None
    runtime: OpenStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)
    observed_generation: int | None = None


class EmbedLane(Resource):
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
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    )

    kind: Literal["EmbedLane"] = "EmbedLane"
    metadata: LabelNamedMeta  # its pod's labels carry the name
    spec: EmbedLaneSpec
    status: EmbedLaneStatus = Field(default_factory=EmbedLaneStatus)
