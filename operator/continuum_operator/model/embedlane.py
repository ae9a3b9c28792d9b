"""EmbedLane: an embedding context beside an engine, or with a model of its own.

Charged where it resides (DESIGN.md rule 6): the operator writes `status.placement`
(residence, bytes per pool, floors), the lane runtime writes `status.runtime`.
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import Field, model_validator

from continuum_operator.model.base import Condition, Name, ObjectMeta, OpenStatus, Resource, Spec
from continuum_operator.model.engine import ModelRef


class EmbedLaneSpec(Spec):
    engine: Name | None = Field(default=None, description="Engine whose backend the lane shares.")
    model: ModelRef | None = Field(default=None, description="A model of the lane's own.")
    max_context_tokens: int = Field(ge=1, le=16_777_216)

    @model_validator(mode="after")
    def _engine_or_model(self) -> Self:
        if (self.engine is None) == (self.model is None):
            raise ValueError("an EmbedLane names exactly one of `engine` or `model`")
        return self


class EmbedLaneStatus(Spec):
    placement: OpenStatus | None = None
    runtime: OpenStatus | None = None
    conditions: list[Condition] = Field(default_factory=list)


class EmbedLane(Resource):
    KIND = "EmbedLane"
    PLURAL = "embedlanes"
    SHORT_NAMES = ("lane",)
    PRINTER_COLUMNS = (
        {"name": "Engine", "type": "string", "jsonPath": ".spec.engine"},
        {"name": "Max-Context", "type": "integer", "jsonPath": ".spec.maxContextTokens"},
        {"name": "Residence", "type": "string", "jsonPath": ".status.placement.residence"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    )

    kind: Literal["EmbedLane"] = "EmbedLane"
    metadata: ObjectMeta
    spec: EmbedLaneSpec
    status: EmbedLaneStatus = Field(default_factory=EmbedLaneStatus)
