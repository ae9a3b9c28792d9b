"""One grant entry on the wire (`model.grant`): the schema the Engine CRD carries, the one parser
the operator and the gateway share, and each reader's policy on an entry it cannot read."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from continuum_operator.core.grants import Grant, GrantReason
from continuum_operator.engine.admission import GrantTableError, Refusal, admit_turn, parse_table
from continuum_operator.kube.ledger import grant_ledger
from continuum_operator.model.base import API_VERSION
from continuum_operator.model.engine import Engine
from continuum_operator.model.grant import GrantEntry, grant_entries, parse_entries
from continuum_operator.model.grant_ledger import GrantLedger
from continuum_operator.model.mind import GrantState
from tests.support.builders import ROOT, engine_body

G, Q, R, X = GrantState.GRANTED, GrantState.QUEUED, GrantState.RECLAIMING, GrantState.RELEASED


def every_kind_of_grant() -> dict[str, Grant]:
    """A ledger that takes every branch of the writer: a holder, a reclaim (by, deadline,
    reclaimedAt), a queued mind (position) and a refusal (askedTokens)."""
    t = 1796281200.123456
    grants = [
        Grant("ns/a", G, GrantReason.SLOT_FREE, t, 4096, slot=0, granted_at=t, priority=5,
              protection_window=300.0),
        Grant("ns/b", R, GrantReason.PREEMPTED, t + 1, 4096, slot=1, by="ns/vip", deadline=t + 31,
              granted_at=t - 60, reclaimed_at=t + 1, protection_window=30.0),
        Grant("ns/c", Q, GrantReason.POOL_FULL, t + 2, priority=-3),
        Grant("ns/d", X, GrantReason.CONTEXT_TOO_LARGE, t + 3),
    ]  # fmt: skip
    return {g.mind: g for g in grants}


def written() -> list[dict[str, object]]:
    """The entries as the GrantLedger stores them."""
    return [e.wire() for e in grant_entries(every_kind_of_grant(), {}, {"ns/d": 99_999})]


def crd_entry_schema() -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / "continuum.dev_grantledgers.yaml").read_text())
    root = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    items: dict[str, Any] = root["properties"]["status"]["properties"]["grants"]["items"]
    return items


def schema_faults(value: Any, schema: Mapping[str, Any]) -> list[str]:
    """What the API server would refuse of one value, for the keywords the entry schema uses."""
    faults = []
    kind = schema.get("type")
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind == "string" and not isinstance(value, str):
        faults.append("not a string")
    if kind == "integer" and not (is_number and isinstance(value, int)):
        faults.append("not an integer")
    if kind == "number" and not is_number:
        faults.append("not a number")
    if "enum" in schema and value not in schema["enum"]:
        faults.append("not in the enum")
    if "minimum" in schema and is_number and value < schema["minimum"]:
        faults.append("below the minimum")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        faults.append("does not match the pattern")
    return faults


class TestTheCrdSchema:
    def test_every_key_the_writer_emits_is_listed_so_the_api_server_does_not_prune_it(
        self,
    ) -> None:
        items = crd_entry_schema()
        # Typed items: the API server prunes any field the schema does not list.
        assert "x-kubernetes-preserve-unknown-fields" not in items
        emitted = {key for e in written() for key in e}
        assert emitted <= set(items["properties"]), emitted - set(items["properties"])
        # The ledger above takes every branch of the writer: each field is written by it.
        assert emitted == set(items["properties"])

    def test_every_entry_the_writer_emits_passes_the_crd_schema(self) -> None:
        props = crd_entry_schema()["properties"]
        faults = {
            (e["mind"], key): schema_faults(value, props[key])
            for e in written()
            for key, value in e.items()
        }
        assert {k: f for k, f in faults.items() if f} == {}

    def test_the_schema_requires_mind_and_state_only_and_writes_no_defaults(self) -> None:
        # A hand-written table (docs/gateway.md) gives mind and state; a default the API server
        # filled in would make the stored entries differ from those the operator wrote.
        items = crd_entry_schema()
        assert items["required"] == ["mind", "state"]
        assert [k for k, v in items["properties"].items() if "default" in v] == []

    def test_the_deadline_is_open_for_unix_seconds_or_rfc3339(self) -> None:
        deadline = crd_entry_schema()["properties"]["deadline"]
        assert "type" not in deadline and deadline["x-kubernetes-preserve-unknown-fields"]

    def test_the_ledger_model_types_its_entries_and_the_operator_reads_them_one_by_one(
        self,
    ) -> None:
        body: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": "GrantLedger",
            "metadata": {"name": "coder", "namespace": "minds"},
            "status": {"grants": written()},
        }
        typed = GrantLedger.model_validate(body).status.grants
        assert typed is not None and [e.wire() for e in typed] == written()
        bad = [*written(), {"mind": "no-namespace", "state": "Held"}]
        with pytest.raises(ValidationError):
            GrantLedger.model_validate({**body, "status": {"grants": bad}})
        # One bad entry does not make the whole ledger unreadable: the operator skips it.
        assert [e.wire() for e in grant_ledger.read_entries(bad)] == written()

    def test_an_engine_names_no_ledger_field(self) -> None:
        # The ledger is a GrantLedger's: an Engine's status that carries one is refused.
        body = engine_body()
        body["status"] = {"grants": [{"mind": "minds/a", "state": "Held"}]}
        with pytest.raises(ValidationError):
            Engine.model_validate(body)

    def test_the_model_package_does_not_import_the_entry_whose_reason_is_cores(self) -> None:
        # core.grants imports model.mind, so model/__init__ importing model.grant (and through
        # it core.grants) would make `import continuum_operator.core.grants` fail.
        code = (
            "import sys, continuum_operator.core.grants, continuum_operator.model; "
            "assert 'continuum_operator.model.grant' not in sys.modules"
        )
        subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


class TestParsing:
    def test_what_the_writer_emits_reads_back_into_the_same_grants(self) -> None:
        entries, unread = parse_entries(written())
        assert unread == []
        assert {e.mind: e.grant() for e in entries} == every_kind_of_grant()

    def test_entries_it_cannot_read_are_named_by_place_and_field_and_the_rest_kept_in_order(
        self,
    ) -> None:
        raw = [
            {"mind": "ns/a", "state": "Queued", "reason": "PoolFull"},
            {"mind": "ns/b", "state": "Held", "slot": True},
            "not an entry",
            {"mind": "ns/c", "state": "Granted", "slot": 0, "tokens": 8, "unknown": 1},
        ]
        entries, unread = parse_entries(raw)
        assert [e.mind for e in entries] == ["ns/a", "ns/c"]
        assert [(u.index, u.fields) for u in unread] == [(1, ("state", "slot")), (2, ())]
        assert "state: Input should be 'Queued'" in unread[0].why

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("mind", "no-namespace"),
            ("tokens", "12"),
            ("tokens", True),
            ("tokens", -1),
            ("slot", 1.0),
            ("priority", 1.5),
            ("sinceUnix", "12"),
            ("deadline", "tomorrow"),
            ("reason", "Whatever"),
        ],
    )
    def test_a_field_of_the_wrong_kind_is_not_read(self, field: str, value: Any) -> None:
        _, unread = parse_entries([{"mind": "ns/a", "state": "Granted", field: value}])
        assert [u.fields for u in unread] == [(field,)]

    def test_a_deadline_in_rfc3339_is_read_as_unix_seconds_utc_when_no_offset(self) -> None:
        for text in ("2026-12-03T07:00:00Z", "2026-12-03T07:00:00"):
            e = GrantEntry.model_validate({"mind": "ns/a", "state": "Reclaiming", "deadline": text})
            assert e.deadline == 1796281200.0

    def test_since_is_read_from_its_text_when_no_unix_seconds_are_given(self) -> None:
        e = GrantEntry.model_validate(
            {
                "mind": "ns/a",
                "state": "Queued",
                "reason": "Arrived",
                "since": "1970-01-01T00:01:40Z",
            }
        )
        assert e.since_seconds() == 100.0
        assert GrantEntry.model_validate({"mind": "ns/a", "state": "Queued"}).since_seconds() == 0


class TestEachReadersPolicy:
    def test_the_operator_skips_an_entry_it_cannot_read_or_allocate_from_and_reads_the_rest(
        self,
    ) -> None:
        raw = [
            *written(),
            {"mind": "ns/bad", "state": "Held", "reason": "PoolFull"},
            {"mind": "ns/noreason", "state": "Queued"},
        ]
        assert grant_ledger.read_grants(grant_ledger.read_entries(raw)) == every_kind_of_grant()

    def test_the_gateway_refuses_the_whole_table_for_one_entry_it_cannot_read(self) -> None:
        doc = {
            "slotTokens": 8,
            "grants": [*written(), {"mind": "ns/x", "state": "Granted", "slot": -1}],
        }
        with pytest.raises(GrantTableError, match=r"grant table\.grants\[4\]: slot: "):
            parse_table(doc)

    def test_the_gateway_relays_a_reason_it_does_not_know_and_serves_by_state(self) -> None:
        # An operator newer than the gateway may write a reason it does not know: its table
        # must not freeze while the operator reclaims slots.
        doc = {
            "slotTokens": 4096,
            "grants": [
                {"mind": "ns/a", "state": "Granted", "slot": 0, "tokens": 4096, "reason": "New"},
                {"mind": "ns/b", "state": "Reclaiming", "slot": 1, "reason": "Newer"},
                {"mind": "ns/c", "state": "Queued", "reason": "PoolFull"},
            ],
        }
        table = parse_table(doc)
        assert [(e.mind, e.reason) for e in table.entries.values()] == [
            ("ns/a", "New"),
            ("ns/b", "Newer"),
            ("ns/c", "PoolFull"),
        ]
        assert admit_turn(table, "ns/a").slot == 0
        cut = admit_turn(table, "ns/b")
        assert (cut.refusal, cut.body["reason"]) == (Refusal.RECLAIMING, "Newer")

    def test_the_gateway_refuses_a_reason_that_is_not_text(self) -> None:
        doc = {"slotTokens": 8, "grants": [{"mind": "ns/a", "state": "Queued", "reason": 7}]}
        with pytest.raises(GrantTableError, match=r"grants\[0\]: reason: "):
            parse_table(doc)
