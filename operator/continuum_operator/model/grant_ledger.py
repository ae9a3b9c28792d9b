"""GrantLedger: the grant ledger of one Engine's KV-cache pool, in an object of its own.

One per Engine, of the same name and namespace, owned by it (deleted with it), written by the
operator's leader alone (`kube.grants.ledger_write`, a replace of its status conditioned on its
resourceVersion) and read by the Engine's gateway (`engine.grants_source`), which enforces it.
It was the Engine's `status.grants`: in an object of its own, a grant no longer rewrites the
Engine (nine kilobytes sent to every Engine watcher at each grant), and the engine pod's right
to read its ledger is RBAC's (a Role by resource name) with no right to write it
(docs/grants.md, docs/security.md "The ledger").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

from continuum_operator.model.base import LabelNamedMeta, Resource, Spec, nullable
from continuum_operator.model.grant import GrantEntry, entry_schema

__all__ = [
    "GrantCapacity",
    "GrantLedger",
    "GrantLedgerStatus",
    "GrantQueue",
    "GrantStep",
    "GrantStepLine",
    "engine_owners",
]


def _grant_entries_schema(schema: dict[str, Any]) -> None:
    """The CRD's `status.grants` items: `GrantEntry` with its enums inlined and no defaults
    (`model.grant.entry_schema`), as the CRD has always said them."""
    schema["items"] = entry_schema()


class GrantCapacity(Spec):
    """The pool the grant ledger was last made for (`kube.ledger.grant_ledger.GrantPool`), written
    with it by the operator's leader: a launch that changed while minds hold slots of the old one
    drains."""

    phase: str = Field(
        max_length=32,
        description="Serving, Draining, Relaunching, Starting or Unschedulable.",
    )
    slots: int = Field(ge=0, description="Slots the ledger grants from.")
    tokens_per_slot: int = Field(ge=0, description="KV tokens of one slot.")
    launch: str | None = nullable(
        "The launch (node and engine arguments, hashed) the slots belong to."
    )
    target_slots: int | None = Field(
        default=None, ge=0, description="Draining: the slots of the new launch."
    )


class GrantQueue(Spec):
    """Written with the ledger only when entries were left out of it: the totals, and what the
    GrantLedger keeps (docs/grants.md, "Bounded")."""

    queued: int = Field(ge=0, description="Minds queued in all.")
    refused: int = Field(ge=0, description="Minds refused in all.")
    kept_queued: int = Field(ge=0, description="Queued entries status.grants keeps.")
    kept_refused: int = Field(ge=0, description="Refused entries status.grants keeps.")


class GrantStepLine(Spec):
    """One transition log line of the step (docs/transition-log.md): a `capacity` line or a
    `transition` line, with times as RFC 3339."""

    t: str = Field(max_length=64, description="When the step was decided.")
    engine: str = Field(max_length=512, description="NAMESPACE/NAME of the Engine.")
    event: str = Field(max_length=32, description="capacity or transition.")
    phase: str | None = nullable("capacity: the pool's phase.")
    slots: int | None = nullable("capacity: its slots.")
    tokens_per_slot: int | None = nullable("capacity: tokens of one slot.")
    mind: str | None = nullable("transition: NAMESPACE/NAME of the Mind.")
    from_: str | None = Field(
        default=None,
        alias="from",
        description="transition: her state before (null: she was not in the ledger).",
        json_schema_extra={"nullable": True},
    )
    to: str | None = nullable("transition: her state after.")
    reason: str | None = nullable("transition: why.")
    by: str | None = nullable("transition: the Mind she yields her slot to.")
    tokens: int | None = nullable("transition: tokens she holds.")
    slot: int | None = nullable("transition: her slot.")
    priority: int | None = nullable("transition: her priority.")
    protection_window: float | None = nullable("transition: her protection window (seconds).")
    deadline: str | None = nullable("transition: the grace deadline of a reclaim (RFC 3339).")
    ledger: str | None = nullable(
        "The uid of the GrantLedger the step was written to: an Engine made again under its "
        "name starts a ledger of its own, and the log says so."
    )


class GrantStep(Spec):
    """The journal of the ledger's last step (`kube.ledger.journal`), written with it: a leader
    that died between the ledger write and the log append has its step logged by the next."""

    seq: int = Field(ge=0, description="The step's sequence number.")
    t: str = Field(max_length=64, description="When it was decided (RFC 3339).")
    lines: list[GrantStepLine] = Field(description="Its log lines, of the minds the Engine keeps.")
    omitted: int | None = Field(default=None, ge=0, description="Lines not kept.")


class GrantLedgerStatus(Spec):
    """The ledger, the pool it was made for, what it leaves out, and its last step's journal,
    written together in one replace by the operator's leader."""

    # Each reader of a stored object parses the entries one by one (`model.grant.parse_entries`)
    # with its own policy on an entry it cannot read (the operator skips it, the gateway refuses
    # the table), so one bad entry does not make the whole ledger unreadable.
    grants: list[GrantEntry] | None = Field(
        default=None,
        description="The grant ledger of the engine's pool, one entry per Mind (state, tokens, "
        "slot, since, reason), written only by the operator's leader (docs/grants.md).",
        json_schema_extra=_grant_entries_schema,
    )
    grant_capacity: GrantCapacity | None = None
    grant_queue: GrantQueue | None = None
    grant_step: GrantStep | None = None


class GrantLedger(Resource):
    """The grant ledger of one Engine's KV-cache pool: which Mind holds which slot, who waits
    and who is being reclaimed. Named as its Engine and owned by it; written by the operator
    alone, read by the Engine's gateway (docs/grants.md)."""

    KIND = "GrantLedger"
    PLURAL = "grantledgers"
    SHORT_NAMES = ("gl",)
    PRINTER_COLUMNS = (
        {"name": "Phase", "type": "string", "jsonPath": ".status.grantCapacity.phase"},
        {"name": "Slots", "type": "integer", "jsonPath": ".status.grantCapacity.slots"},
        {
            "name": "Tokens-Per-Slot",
            "type": "integer",
            "jsonPath": ".status.grantCapacity.tokensPerSlot",
        },
        {"name": "Queued", "type": "integer", "jsonPath": ".status.grantQueue.queued"},
        {"name": "Step", "type": "integer", "jsonPath": ".status.grantStep.seq", "priority": 1},
    )

    kind: Literal["GrantLedger"] = "GrantLedger"
    metadata: LabelNamedMeta  # the Engine's name
    status: GrantLedgerStatus = Field(default_factory=GrantLedgerStatus)


def engine_owners(ledger: Mapping[str, Any]) -> list[str]:
    """The uids of the Engines a GrantLedger object names as its owners: the operator makes each
    owned by its Engine, so one of another uid is an earlier Engine's of the same name."""
    refs = (ledger.get("metadata") or {}).get("ownerReferences") or []
    return [str(r.get("uid")) for r in refs if r.get("kind") == "Engine" and r.get("uid")]
