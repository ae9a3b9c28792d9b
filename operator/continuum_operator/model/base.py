"""Shared pieces of every resource: camelCase fields, strict input, object metadata.

Fields are snake_case in Python and camelCase on the wire, as Kubernetes users write them.
Unknown fields are refused (`extra="forbid"`) so a typo in a spec is an error, not a silent
default; the CRD schemas generated from these models prune unknown fields the same way.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

GROUP = "continuum.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Bytes are int64 on the wire; pydantic and the CRD schema both refuse negatives.
#: The most bytes any figure of a resource may carry (JSON's int64, with room to add).
MAX_BYTES = 2**62
Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]
PositiveInt = Annotated[int, Field(gt=0, le=2**31 - 1)]
Name = Annotated[
    str, Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
]
# An RFC 1035 label: what a Service's name and a label's value both hold (63 bytes, no dots).
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class Spec(BaseModel):
    """Base of every spec and status part: camelCase aliases, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )


def spec_config_with_rules(*rules: JsonDict) -> ConfigDict:
    """`Spec`'s model config plus CEL rules the API server checks on the object, each
    `{"rule": CEL, "message": why}` as the CRD's `x-kubernetes-validations` lists them (the
    model's own validators check the same in Python)."""
    config = Spec.model_config.copy()
    config["json_schema_extra"] = {"x-kubernetes-validations": list(rules)}
    return config


def label_selector(labels: Mapping[str, str]) -> str:
    """An equality label selector, `key=value,...` in key order: what a list's or a watch's
    `labelSelector` takes (the same labels always the same text)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def nullable(description: str) -> Any:
    """An optional status field its writer writes as null where it does not know it: the CRD
    says `nullable`, so the API server keeps the null (in a list, which a merge patch replaces
    whole, or in an object written by replace) rather than prune it."""
    return Field(default=None, description=description, json_schema_extra={"nullable": True})


class ObjectMeta(BaseModel):
    """The part of Kubernetes object metadata the core reads; the rest passes through."""

    model_config = ConfigDict(populate_by_name=True, extra="allow", frozen=True)

    name: Name
    namespace: str | None = None
    generation: int | None = None
    resource_version: str | None = Field(default=None, alias="resourceVersion")
    labels: dict[str, str] = Field(default_factory=dict)


class LabelNamedMeta(ObjectMeta):
    """Metadata of a resource whose name the operator gives to a Service or a label value: the
    API server would refuse those objects for a longer or dotted name, so the resource's own
    CRD refuses the name first (crdgen copies this constraint into `metadata.name`)."""

    # The pattern is the CRD's (crdgen reads it); the check below says it in words.
    name: Annotated[
        str,
        Field(
            min_length=1,
            max_length=63,
            description="A DNS label (at most 63 characters, no dots): the operator gives the "
            "name to a Service and to label values.",
            json_schema_extra={"pattern": DNS_LABEL},
        ),
    ]

    @field_validator("name")
    @classmethod
    def _dns_label(cls, value: str) -> str:
        if not re.match(DNS_LABEL, value):
            raise ValueError(
                "the name is a DNS label (the operator names a Service and labels after it): "
                "lowercase letters, digits and '-', starting with a letter and ending with a "
                "letter or digit, no dots"
            )
        return value


# A condition's reason, as the API conventions (metav1.Condition) constrain it: one CamelCase word.
CONDITION_REASON = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Condition(Spec):
    """A Kubernetes condition, keyed by type and written whole by its one writer."""

    type: str = Field(
        min_length=1, max_length=316, description="What the condition is about, in CamelCase."
    )
    status: str = Field(pattern="^(True|False|Unknown)$", description="True, False or Unknown.")
    reason: str = Field(
        min_length=1,
        max_length=1024,
        pattern=CONDITION_REASON,
        description="Why the condition has its status, as one CamelCase word (for tools).",
    )
    message: str = Field(
        default="",
        max_length=32_768,
        description="Why, in words (for people): what is wrong and what to do about it.",
    )
    last_transition_time: str | None = Field(
        default=None, description="When the status last changed (RFC 3339)."
    )
    observed_generation: int | None = Field(
        default=None, ge=0, description="The metadata.generation the condition was decided from."
    )


# Conditions as the API conventions list them: a map keyed by type (one entry per type, which
# server-side apply merges by key), each entry written whole by the status part's one writer.
Conditions = Annotated[
    list[Condition],
    Field(
        max_length=64,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    ),
]
# The generation a status part was last written for: readers tell a stale status from a new one.
ObservedGeneration = Annotated[
    int | None,
    Field(ge=0, description="The metadata.generation this status was last written for."),
]


class Resource(BaseModel):
    """A whole object as kubectl writes it: apiVersion, kind, metadata, spec, status."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", frozen=True)

    # CRD facts read by crdgen; each subclass sets them.
    KIND: ClassVar[str]
    PLURAL: ClassVar[str]
    SHORT_NAMES: ClassVar[tuple[str, ...]] = ()
    NAMESPACED: ClassVar[bool] = True
    CATEGORIES: ClassVar[tuple[str, ...]] = ("continuum",)
    # `kubectl get` columns before Age: crdgen ends every table with its `AGE_COLUMN`.
    PRINTER_COLUMNS: ClassVar[tuple[dict[str, Any], ...]] = ()

    api_version: str = Field(default=API_VERSION, alias="apiVersion", pattern=f"^{API_VERSION}$")
    kind: str
    metadata: ObjectMeta

    @classmethod
    def spec_model(cls) -> type[BaseModel] | None:
        field = cls.model_fields.get("spec")
        return field.annotation if field is not None else None  # type: ignore[return-value]
