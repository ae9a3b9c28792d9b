"""MindClass: the priority and the most tokens a mind of the class may hold (cluster-scoped),
and which namespaces may use it (docs/tenancy.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from continuum_operator.model.base import Name, Resource, Spec


class MindClassSpec(Spec):
    """A class's priority, limits and who may use it."""

    priority: int = Field(ge=-1_000_000, le=1_000_000, description="Higher may preempt lower.")
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=2**40,
        description="The most tokens a grant of the class holds; a Mind asking more is refused "
        "(ClassLimit). Absent: a slot's size.",
    )
    protection_window_seconds: int = Field(
        default=300, ge=0, le=86_400, description="A new grant is not reclaimed within it."
    )
    default: bool = Field(default=False, description="The class of Minds that name none.")
    allowed_namespaces: list[Name] | None = Field(
        default=None,
        max_length=1024,
        description="Namespaces whose Minds may use the class, checked at admission by the "
        "chart's ValidatingAdmissionPolicy and by the operator at every grant decision "
        "(ClassNotAllowed, docs/tenancy.md); absent: every namespace.",
    )


class MindClass(Resource):
    """A class of Minds (cluster-scoped): the priority and the most tokens a mind of the class may
    hold, and which namespaces may use it (docs/tenancy.md)."""

    KIND = "MindClass"
    PLURAL = "mindclasses"
    SHORT_NAMES = ("mc",)
    NAMESPACED = False
    PRINTER_COLUMNS = (
        {"name": "Priority", "type": "integer", "jsonPath": ".spec.priority"},
        {"name": "Max-Tokens", "type": "integer", "jsonPath": ".spec.maxTokens"},
        {"name": "Default", "type": "boolean", "jsonPath": ".spec.default"},
    )

    kind: Literal["MindClass"] = "MindClass"
    spec: MindClassSpec
