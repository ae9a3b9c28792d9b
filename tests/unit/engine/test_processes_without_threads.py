"""The engine's and the lane's processes make their API calls on the event loop, not in its
executor's threads (`kube.client.async_api`): with an executor that runs nothing, the engine's watch
hands over its grant table, its status.runtime is written and a mind's token reviewed, and the
lane follows its lease. They ran in threads before: the watch in a daemon thread, the reads
and writes through `asyncio.to_thread`, the reviews in two thread pools."""

from __future__ import annotations

import asyncio
from pathlib import Path

from continuum_operator.door.accounts import ServiceAccount
from continuum_operator.door.token_review import TokenReviewer
from continuum_operator.embed.runtime import LaneObject, LaneState
from continuum_operator.engine.admission import GrantTable
from continuum_operator.engine.grants_source import EngineStatusWriter, watch_ledger
from tests.support.fake_apiserver import NS, served
from tests.support.grants_source import CAPACITY, LEDGERS, NAME, ledger
from tests.support.lane_watch import LANES, lane
from tests.support.threads import NoThreads
from tests.support.waiting import until

AUDIENCE = f"continuum.dev/engine/{NS}/{NAME}"


def test_the_engines_and_the_lanes_api_calls_run_on_the_loop_without_a_thread(
    tmp_path: Path,
) -> None:
    tables: list[GrantTable | None] = []
    leases: list[LaneState] = []

    async def main() -> list[str]:
        async with served(tmp_path) as (fake, api):  # logged in first: the loader's thread
            refusing = NoThreads()
            asyncio.get_running_loop().set_default_executor(refusing)
            fake.put("engines", {"kind": "Engine", "metadata": {"name": NAME, "uid": "u-1"}})
            fake.put(LEDGERS, ledger({"grants": [], "grantCapacity": CAPACITY}))
            fake.put(LANES, lane(512))
            fake.tokens = {"good": (f"system:serviceaccount:{NS}:mira", [AUDIENCE])}
            following = [
                asyncio.create_task(watch_ledger(NS, NAME, tables.append, api=api)),
                asyncio.create_task(LaneObject(NS, "docs", api=api).watch(leases.append)),
            ]
            try:
                await until(lambda: bool(tables) and bool(leases))
                fake.put(LANES, lane(1024))
                await until(lambda: len(leases) == 2)
                await EngineStatusWriter(NS, NAME, api=api).write({"phase": "Serving"})
                reviewer = TokenReviewer(AUDIENCE, api=api)
                assert await reviewer("good") == ServiceAccount(NS, "mira")
            finally:
                for task in following:
                    task.cancel()
                await asyncio.gather(*following, return_exceptions=True)
            assert fake.objects["engines", NAME]["status"]["runtime"] == {"phase": "Serving"}
            return refusing.asked

    asked = asyncio.run(main())
    assert asked == []
    assert [t.slot_tokens if t else None for t in tables] == [2048]
    assert [s.leased_context_tokens for s in leases] == [512, 1024]
