"""The gateway in front of the stand-in llama-server, for the tests of its native endpoints: the
grant table's entries, and a rig serving both on loopback (`run`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from continuum_operator.core.grants import EnginePhase
from continuum_operator.engine.admission import (
    GrantTable,
    TableEntry,
)
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER
from continuum_operator.model.mind import GrantState
from tests.support.fake_llama import FakeLlama, serve

MIRA, VIP = "minds/mira", "minds/vip"


def granted(mind: str = MIRA, slot: int = 0, tokens: int = 512) -> TableEntry:
    return TableEntry(mind, GrantState.GRANTED, "SlotFree", slot=slot, tokens=tokens, since="g")


def reclaiming(mind: str = MIRA, slot: int = 0, deadline: float | None = None) -> TableEntry:
    return TableEntry(
        mind,
        GrantState.RECLAIMING,
        "Preempted",
        slot=slot,
        tokens=512,
        by=VIP,
        deadline=deadline if deadline is not None else time.time() + 30,
        since="r",
    )


def queued(mind: str, reason: str = "PoolFull") -> TableEntry:
    return TableEntry(mind, GrantState.QUEUED, reason)


def table(*entries: TableEntry, phase: EnginePhase = EnginePhase.SERVING) -> GrantTable:
    return GrantTable(512, phase, {e.mind: e for e in entries})


@dataclass
class Rig:
    url: str
    admin_url: str
    gateway: Gateway
    fake: FakeLlama
    http: aiohttp.ClientSession

    async def open(self, mind: str = MIRA, **body: Any) -> tuple[int, dict[str, Any], Any]:
        async with self.http.post(
            f"{self.url}/v1/turns", json=body, headers={MIND_HEADER: mind}
        ) as resp:
            return resp.status, await resp.json(), resp.headers

    async def complete(
        self, turn_id: str, body: dict[str, Any], mind: str = MIRA
    ) -> tuple[int, Any]:
        async with self.http.post(
            f"{self.url}/completion",
            json=body,
            headers={MIND_HEADER: mind, TURN_HEADER: turn_id},
        ) as resp:
            return resp.status, await resp.json()


def run(
    initial: GrantTable | None,
    body: Callable[[Rig], Awaitable[None]],
    fake: FakeLlama | None = None,
) -> FakeLlama:
    fake = fake or FakeLlama()

    async def main() -> None:
        upstream_runner, upstream = await serve(fake.app())
        gateway = Gateway(GatewaySettings(upstream=upstream, health_seconds=0.05))
        await gateway.start()
        if initial is not None:
            gateway.set_table(initial)
        runner, url = await serve(gateway.app())
        admin_runner, admin_url = await serve(gateway.admin_app())
        try:
            async with aiohttp.ClientSession() as http:
                await body(Rig(url, admin_url, gateway, fake, http))
        finally:
            await admin_runner.cleanup()
            await runner.cleanup()
            await gateway.close()
            await upstream_runner.cleanup()

    asyncio.run(main())
    return fake
