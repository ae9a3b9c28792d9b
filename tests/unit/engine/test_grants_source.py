"""The gateway's grant source in a cluster (`engine.grants_source.watch_ledger`), against a
fake API: the Engine's GrantLedger is read and watched, and a ledger the operator has not made
or written yet is a quiet wait, not an error each second."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from continuum_operator.engine import grants_source
from continuum_operator.engine.admission import GrantTable
from tests.support.fake_apiserver import NS, FakeApiServer, served
from tests.support.grants_source import CAPACITY, LEDGERS, NAME, ledger
from tests.support.waiting import until


def watched(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    script: Callable[[FakeApiServer, list[GrantTable | None]], Awaitable[None]],
) -> tuple[list[GrantTable | None], list[str], FakeApiServer]:
    """`watch_ledger` of the Engine `NS/NAME` (uid u-1) on the fake API server while `script`
    changes its ledger; the tables handed over, what was told, and the server."""
    tables: list[GrantTable | None] = []
    seen: list[FakeApiServer] = []

    async def main() -> None:
        async with served(tmp_path) as (fake, api):
            seen.append(fake)
            fake.put("engines", {"kind": "Engine", "metadata": {"name": NAME, "uid": "u-1"}})
            task = asyncio.create_task(grants_source.watch_ledger(NS, NAME, tables.append, api=api))
            try:
                await until(lambda: bool(fake.asked("WATCH", LEDGERS)))
                await script(fake, tables)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger=grants_source.log.name):
        asyncio.run(main())
    told = [r for r in caplog.records if r.name == grants_source.log.name]
    assert all(r.levelno == logging.INFO for r in told), [r.getMessage() for r in told]
    return tables, [r.getMessage() for r in told], seen[0]


def test_a_ledger_not_made_yet_is_waited_for_quietly_then_watched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def script(fake: FakeApiServer, tables: list[GrantTable | None]) -> None:
        await asyncio.sleep(0.1)  # a while with no ledger: no table, no error each second
        fake.put(LEDGERS, ledger(None))
        await asyncio.sleep(0.05)
        fake.put(LEDGERS, ledger({"grants": [], "grantCapacity": CAPACITY}))
        await until(lambda: bool(tables))

    tables, told, fake = watched(tmp_path, caplog, script)
    assert [t.slot_tokens if t else None for t in tables] == [2048]
    # A wait told once each at INFO, never a warning.
    assert told == [
        f"no GrantLedger {NS}/{NAME} yet; refusing turns until the operator writes one",
        f"GrantLedger {NS}/{NAME} made, its status not written yet; refusing turns until it is",
    ]
    # Listed once (by name), then every change came by the one watch: no reads in a loop.
    lists = fake.asked("GET", LEDGERS)
    assert lists == [{"fieldSelector": f"metadata.name={NAME}", "limit": "250"}]
    assert len(fake.asked("WATCH", LEDGERS)) == 1
    assert len(fake.asked("GET", "engines")) == 1


def test_a_ledger_an_earlier_engine_of_the_name_left_gives_no_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def script(fake: FakeApiServer, tables: list[GrantTable | None]) -> None:
        fake.put(LEDGERS, ledger({"grants": [], "grantCapacity": CAPACITY}, owner="u-0"))
        await asyncio.sleep(0.1)

    tables, told, _ = watched(tmp_path, caplog, script)
    assert tables == []
    assert told[-1] == (
        f"GrantLedger {NS}/{NAME} belongs to an earlier Engine of that name; refusing turns "
        "until the operator replaces it"
    )


def test_a_deleted_ledgers_table_is_withdrawn_not_enforced_as_if_held(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def script(fake: FakeApiServer, tables: list[GrantTable | None]) -> None:
        fake.put(LEDGERS, ledger({"grants": [], "grantCapacity": CAPACITY}))
        await until(lambda: bool(tables))
        fake.remove(LEDGERS, NAME)  # deleted by hand after its write
        await until(lambda: len(tables) == 2)

    tables, told, _ = watched(tmp_path, caplog, script)
    assert [t.slot_tokens if t else None for t in tables] == [2048, None]  # withdrawn once
    assert f"GrantLedger {NS}/{NAME} deleted; refusing turns until the operator writes one" in told


def test_the_engines_status_is_read_and_its_runtime_written_once_per_change(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with served(tmp_path) as (fake, api):
            status = {"plan": {"node": "n1"}, "runtime": {"phase": "Old"}}
            fake.put("engines", {"kind": "Engine", "metadata": {"name": NAME}, "status": status})
            assert await grants_source.read_engine_plan(NS, NAME, api=api) == {"node": "n1"}
            writer = grants_source.EngineStatusWriter(NS, NAME, api=api)
            await writer.write({"phase": "Serving"})
            await writer.write({"phase": "Serving"})  # unchanged: not sent again
            after = await grants_source.read_engine_status(NS, NAME, api=api)
            assert after == {"plan": {"node": "n1"}, "runtime": {"phase": "Serving"}}
            assert len(fake.asked("PATCH", "engines")) == 1

    asyncio.run(main())


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
