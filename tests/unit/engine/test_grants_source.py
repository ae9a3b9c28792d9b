"""The gateway's grant source in a cluster (`engine.grants_source.watch_ledger`), against a
fake API: the Engine's GrantLedger is read and watched, and a ledger the operator has not made
or written yet is a quiet wait, not an error each second."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from continuum_operator.engine import grants_source
from continuum_operator.engine.admission import GrantTable
from continuum_operator.model.base import GROUP, VERSION
from continuum_operator.model.grant_ledger import GrantLedger
from tests.support.waiting import until

NS, NAME = "minds", "coder"
CAPACITY = {"phase": "Serving", "slots": 2, "tokensPerSlot": 2048}


def ledger(version: int, status: dict[str, Any], owner: str = "u-1") -> dict[str, Any]:
    meta = {"namespace": NS, "name": NAME, "resourceVersion": str(version),
            "ownerReferences": [{"kind": "Engine", "name": NAME, "uid": owner}]}  # fmt: skip
    return {"kind": GrantLedger.KIND, "metadata": meta, "status": status}


class Stream:
    """A watch response: its events as lines, then the end of the watch."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events

    def stream(self, amt: Any = None, decode_content: bool = False) -> Iterator[bytes]:
        for e in self.events:
            yield (json.dumps(e) + "\n").encode()

    def close(self) -> None:
        pass

    def release_conn(self) -> None:
        pass


class FakeLedgers:
    """The GrantLedger API of one namespace: 404 until `absent_gets` gets have been answered,
    then the ledger as made (no status); its watch then brings the operator's first write."""

    def __init__(self, absent_gets: int, owner: str = "u-1", then_deleted: bool = False) -> None:
        self.absent_gets = absent_gets
        self.owner = owner  # the uid the ledgers name as their Engine's
        self.then_deleted = then_deleted  # the watch brings a DELETED after the write
        self.gets: list[tuple[str, ...]] = []
        self.watches: list[dict[str, Any]] = []
        self.idle = threading.Event()

    def get_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, name: str
    ) -> dict[str, Any]:
        if plural == "engines":  # the Engine itself: its uid
            return {"metadata": {"namespace": NS, "name": NAME, "uid": "u-1"}}
        self.gets.append((group, version, namespace, plural, name))
        if len(self.gets) <= self.absent_gets:
            raise client.ApiException(status=404, reason="Not Found")
        return ledger(1, {}, self.owner)

    def list_namespaced_custom_object(
        self, group: str, version: str, namespace: str, plural: str, **kwargs: Any
    ) -> Stream:
        self.watches.append({"plural": plural, **kwargs})
        if len(self.watches) > 1:
            self.idle.wait(0.05)  # a quiet watch that ends, as at its timeout
            return Stream([])
        written = ledger(2, {"grants": [], "grantCapacity": CAPACITY}, self.owner)
        deleted = [{"type": "DELETED", "object": written}] if self.then_deleted else []
        return Stream([{"type": "MODIFIED", "object": written}, *deleted])


def test_a_ledger_not_made_yet_is_waited_for_quietly_then_watched(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(grants_source, "RETRY_SECONDS", 0.01)
    api = FakeLedgers(absent_gets=5)
    tables: list[GrantTable | None] = []

    async def main() -> None:
        task = asyncio.create_task(grants_source.watch_ledger(NS, NAME, tables.append, api=api))
        await until(lambda: bool(tables))
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger=grants_source.log.name):
        asyncio.run(main())
    api.idle.set()

    assert len(api.gets) == 6
    assert {g[:4] for g in api.gets} == {(GROUP, VERSION, NS, GrantLedger.PLURAL)}
    assert api.watches[0]["plural"] == GrantLedger.PLURAL
    assert api.watches[0]["field_selector"] == f"metadata.name={NAME}"
    assert api.watches[0]["resource_version"] == "1"
    # Five 404s and a ledger made with no status: no table until its first write, told once
    # each at INFO, never a warning.
    assert [t.slot_tokens if t else None for t in tables] == [2048]
    told = [r for r in caplog.records if r.name == grants_source.log.name]
    assert all(r.levelno == logging.INFO for r in told), [r.getMessage() for r in told]
    assert [r.getMessage() for r in told] == [
        f"no GrantLedger {NS}/{NAME} yet; refusing turns until the operator writes one",
        f"GrantLedger {NS}/{NAME} made, its status not written yet; refusing turns until it is",
    ]


def test_a_ledger_an_earlier_engine_of_the_name_left_gives_no_table(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(grants_source, "RETRY_SECONDS", 0.01)
    api = FakeLedgers(absent_gets=0, owner="u-0")  # owned by the Engine deleted before
    tables: list[GrantTable | None] = []

    async def main() -> None:
        task = asyncio.create_task(grants_source.watch_ledger(NS, NAME, tables.append, api=api))
        await until(lambda: len(api.watches) >= 2)  # its first write delivered, and passed
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger=grants_source.log.name):
        asyncio.run(main())
    api.idle.set()
    assert tables == []
    told = [r.getMessage() for r in caplog.records if r.name == grants_source.log.name]
    assert told == [
        f"GrantLedger {NS}/{NAME} belongs to an earlier Engine of that name; refusing turns "
        "until the operator replaces it"
    ]


def test_a_deleted_ledgers_table_is_withdrawn_not_enforced_as_if_held(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(grants_source, "RETRY_SECONDS", 0.01)
    api = FakeLedgers(absent_gets=0, then_deleted=True)  # deleted by hand after its write
    tables: list[GrantTable | None] = []

    async def main() -> None:
        task = asyncio.create_task(grants_source.watch_ledger(NS, NAME, tables.append, api=api))
        await until(lambda: len(api.watches) >= 2)
        await asyncio.sleep(0.05)  # what the thread handed over reaches the loop
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger=grants_source.log.name):
        asyncio.run(main())
    api.idle.set()
    assert [t.slot_tokens if t else None for t in tables] == [2048, None]  # withdrawn once
    told = [r.getMessage() for r in caplog.records if r.name == grants_source.log.name]
    assert f"GrantLedger {NS}/{NAME} deleted; refusing turns until the operator writes one" in told


def test_a_withdrawn_table_refuses_her_turn_where_the_deleted_one_granted_it() -> None:
    from continuum_operator.engine.admission import Answer, admit_turn, parse_table
    from continuum_operator.engine.gateway import Gateway, GatewaySettings

    gateway = Gateway(GatewaySettings(upstream="http://127.0.0.1:1"))
    gateway.set_table(
        parse_table(
            {"slotTokens": 2048, "grants": [{"mind": "minds/mira", "state": "Granted", "slot": 0}]}
        )
    )
    assert admit_turn(gateway.table, "minds/mira").answer is Answer.ADMIT
    gateway.set_table(None)
    refused = admit_turn(gateway.table, "minds/mira")
    assert refused.answer is Answer.REFUSE and refused.status == 503  # a wait, as at start
