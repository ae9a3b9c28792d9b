"""One entry of an Engine's grant ledger (a GrantLedger's `status.grants`) as the wire carries
it: its schema, its one parser, and its writer from the allocator's `Grant`s.

The operator's leader writes the entries (`grant_entries`); two readers parse them through
`parse_entries`, each with its own policy on an entry it cannot read: the operator's next step
(`kube.ledger.grant_ledger.read_grants`) skips it, the gateway (`engine.admission`) refuses the
whole table and keeps its last good one. The CRD describes each entry from `GrantEntry`
(`entry_schema`), so the API server refuses a malformed entry before either reader sees it, and
prunes any field the schema does not list: every key `grant_entries` writes must be a field here (a
unit test holds them together).

Not imported by the `model` package itself: the reason is `core.grants`' enum, and `core.grants`
imports `model.mind`.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, Strict, TypeAdapter, ValidationError, field_validator

from continuum_operator.core import rfc3339
from continuum_operator.core.grants import REFUSALS, Grant, GrantReason, MindDemand
from continuum_operator.model.base import Spec
from continuum_operator.model.mind import HOLDING_STATES, GrantState

__all__ = [
    "GrantEntry",
    "Unread",
    "entry_schema",
    "grant_entries",
    "iso_micro",
    "parse_entries",
    "wire_entries",
]

# Strict: a bool is not a count, nor a string of digits; a float is not a slot. Every number the
# writer puts here is an int or a float already.
Count = Annotated[int, Strict(), Field(ge=0)]
Seconds = Annotated[float, Strict()]
MIND_PATTERN = r"^[^/]+/[^/]+$"
_MIND = re.compile(MIND_PATTERN)


class GrantEntry(Spec):
    """One Mind's entry in an Engine's grant ledger, written only by the operator's leader
    (docs/grants.md); the engine's gateway serves her turns only while it says Granted."""

    # A newer writer's field is ignored by an older reader rather than refusing the entry.
    model_config = Spec.model_config | {"extra": "ignore"}

    mind: str = Field(
        max_length=317,
        description="The Mind, as namespace/name.",
        json_schema_extra={"pattern": MIND_PATTERN},
    )
    state: GrantState = Field(
        description="Queued, Granted (she holds a slot), Reclaiming (her slot is being taken "
        "back: her turn ends by the deadline) or Released."
    )
    reason: GrantReason | None = Field(
        default=None, description="Why she is in this state (docs/grants.md)."
    )
    since: str | None = Field(
        default=None,
        description="When this state began (RFC 3339, microseconds); names one reclaim, which "
        "the gateway reports released by (mind, slot, since).",
    )
    since_unix: Seconds | None = Field(default=None, description="`since` in Unix seconds.")
    tokens: Count = Field(default=0, description="Tokens of context her grant holds.")
    priority: Annotated[int, Strict()] = Field(
        default=0, description="Her MindClass's priority when the entry was written."
    )
    protection_window: Seconds = Field(
        default=0.0,
        description="Seconds a grant of hers is safe from preemption (her MindClass's).",
    )
    slot: Count | None = Field(default=None, description="The engine's slot she holds.")
    by: str | None = Field(default=None, description="Preempted: the Mind she yields her slot to.")
    # Open in the CRD (no type): the operator writes Unix seconds, and a grant table may give
    # RFC 3339 (docs/gateway.md); the schema cannot say number-or-string.
    deadline: Seconds | None = Field(
        default=None,
        description="Reclaiming: the grace deadline, Unix seconds (or RFC 3339).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    granted_at: Seconds | None = Field(
        default=None, description="When her current grant was made, Unix seconds."
    )
    reclaimed_at: Seconds | None = Field(
        default=None, description="When her last reclaim began, Unix seconds."
    )
    position: Count | None = Field(default=None, description="Queued: her place in line, 1 first.")
    asked_tokens: Count | None = Field(
        default=None,
        description="Refused: the tokens she asks, more than a slot or her class holds.",
    )

    @field_validator("mind")
    @classmethod
    def _namespaced(cls, value: str) -> str:
        # The CRD's pattern (above), said in words for the gateway's log.
        if not _MIND.match(value):
            raise ValueError(f"expected namespace/name, got {value!r}")
        return value

    @field_validator("deadline", mode="before")
    @classmethod
    def _rfc3339_deadline(cls, value: object) -> object:
        """A grant table file may give the deadline as RFC 3339 (docs/gateway.md); a time
        without an offset is UTC."""
        if not isinstance(value, str):
            return value
        try:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError as err:
            raise ValueError(f"not an RFC 3339 time: {value!r}") from err
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=dt.UTC)
        return parsed.timestamp()

    def since_seconds(self) -> float:
        """When this state began, Unix seconds: `sinceUnix`, else `since` read, else 0."""
        return self.since_unix or rfc3339.parse(self.since) or 0.0

    def grant(self) -> Grant | None:
        """The allocator's `Grant`, or None without a reason (the allocator needs one)."""
        if self.reason is None:
            return None
        return Grant(
            mind=self.mind,
            state=self.state,
            reason=self.reason,
            since=self.since_seconds(),
            tokens=self.tokens,
            slot=self.slot,
            by=self.by,
            deadline=self.deadline,
            granted_at=self.granted_at,
            reclaimed_at=self.reclaimed_at,
            priority=self.priority,
            protection_window=self.protection_window,
        )

    def wire(self) -> dict[str, object]:
        """The entry as the GrantLedger stores it: wire names, no nulls (an absent field is
        None when read), in the fields' order."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


@dataclass(frozen=True, slots=True)
class Unread:
    """An entry `parse_entries` could not read: its place in the list and why, by field."""

    index: int
    entry: object
    why: str
    fields: tuple[str, ...]  # the wire names at fault; () when the entry itself is


# The whole list in one call: a step reads up to ~320 entries (kube.ledger.grant_ledger.QUEUE_KEPT
# and REFUSED_KEPT beside the holders), and a list validates in one pass over pydantic-core.
_ENTRIES = TypeAdapter(list[GrantEntry])


def parse_entries(raw: Iterable[object] | None) -> tuple[list[GrantEntry], list[Unread]]:
    """Typed entries from `status.grants` (or a grant table file's `grants`), and the entries
    that could not be read, in their order. What to do with those is the reader's policy."""
    items = list(raw or ())
    try:
        return _ENTRIES.validate_python(items), []
    except ValidationError:
        pass
    entries: list[GrantEntry] = []
    unread: list[Unread] = []
    for i, item in enumerate(items):
        try:
            entries.append(GrantEntry.model_validate(item))
        except ValidationError as err:
            unread.append(_unread(i, item, err))
    return entries, unread


def _unread(index: int, item: object, err: ValidationError) -> Unread:
    errors = err.errors(include_url=False, include_context=False)
    fields = tuple(dict.fromkeys(str(e["loc"][0]) for e in errors if e["loc"]))
    why = "; ".join(
        f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" if e["loc"] else str(e["msg"])
        for e in errors
    )
    return Unread(index, item, why, fields)


def entry_schema() -> dict[str, Any]:
    """The JSON schema of one entry for the Engine CRD: enums inlined, and no defaults (the API
    server would write them into the stored entries, which are compared with what was written)."""
    raw = GrantEntry.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, list):
            return [inline(x) for x in node]
        if not isinstance(node, dict):
            return node
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return {k: inline(v) for k, v in node.items() if k != "default"}

    schema: dict[str, Any] = inline(raw)
    return schema


# --- the writer -------------------------------------------------------------------------------

# Cached: a step writes every entry's `since`, and a long queue's are the same few instants.
iso_micro = functools.lru_cache(maxsize=65536)(rfc3339.format_micro)


def grant_entries(
    grants: Mapping[str, Grant],
    demands: Mapping[str, MindDemand],
    asked: Mapping[str, int] | None = None,
) -> list[GrantEntry]:
    """`status.grants` from the allocator's ledger: holders by slot, then the queue in order.
    Built as the wire has them, each key a `GrantEntry` field's wire name, and read in one
    pass over pydantic-core (a step writes every entry: ~400 models made one by one cost more
    than the step); `wire_entries` gives them back as the GrantLedger stores them."""
    asked = asked or {}

    def rank(g: Grant) -> tuple[int, float, str]:
        d = demands.get(g.mind)
        return d.rank() if d is not None else (-g.priority, 0.0, g.mind)

    ordered = sorted(
        grants.values(),
        key=lambda g: (
            0 if g.state in HOLDING_STATES else 1 if g.state is GrantState.QUEUED else 2,
            g.slot if g.slot is not None else -1,
            rank(g),
        ),
    )
    out: list[dict[str, object]] = []
    position = 0
    for g in ordered:
        e: dict[str, object] = {
            "mind": g.mind,
            "state": g.state.value,
            "reason": g.reason.value,
            "since": iso_micro(g.since),
            "sinceUnix": g.since,
            "tokens": g.tokens,
            "priority": g.priority,
            "protectionWindow": g.protection_window,
        }
        if g.slot is not None:
            e["slot"] = g.slot
        if g.by is not None:
            e["by"] = g.by
        if g.deadline is not None:
            e["deadline"] = g.deadline
        if g.granted_at is not None:
            e["grantedAt"] = g.granted_at
        if g.reclaimed_at is not None:
            e["reclaimedAt"] = g.reclaimed_at
        if g.state is GrantState.QUEUED:
            position += 1
            e["position"] = position
        if g.reason in REFUSALS and g.mind in asked:
            e["askedTokens"] = asked[g.mind]
        out.append(e)
    return _ENTRIES.validate_python(out)


def wire_entries(entries: list[GrantEntry]) -> list[dict[str, object]]:
    """Entries as the GrantLedger stores them (`GrantEntry.wire`), in one pass."""
    wired: list[dict[str, object]] = _ENTRIES.dump_python(
        entries, mode="json", by_alias=True, exclude_none=True
    )
    return wired
