"""The gateway in front of the stand-in llama-server, for the tests of every route it serves:
the grant table's entries, minds with tokens a stand-in TokenReview knows (`reviewed=True`),
and the rig that serves both on loopback as the engine serves them (`run`), with the official
OpenAI and Anthropic clients an agent would make (`Rig.client`, `claude`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import anthropic
import openai

from continuum_operator.core.grants import EnginePhase
from continuum_operator.door.serving import serve_app
from continuum_operator.door.token_review import Caller
from continuum_operator.engine.admission import (
    GrantTable,
    ServiceAccount,
    TableEntry,
)
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER
from continuum_operator.model.mind import GrantState
from tests.support.fake_llama import FakeLlama, serve

MIRA, BOB, VIP = "minds/mira", "minds/bob", "minds/vip"

#: The tokens the stand-in review knows: each is a service account's.
TOKENS = {
    "mira-token": ServiceAccount("minds", "mira"),
    "bob-token": ServiceAccount("minds", "bob"),
    "child-token": ServiceAccount("minds", "mira-child"),
}


def granted(mind: str = MIRA, slot: int = 0, tokens: int = 512) -> TableEntry:
    return TableEntry(mind, GrantState.GRANTED, "SlotFree", slot=slot, tokens=tokens, since="g")


def reclaiming(
    mind: str = MIRA, slot: int = 0, deadline: float | None = None, *, seconds: float = 30
) -> TableEntry:
    """Her grant reclaimed (preempted by VIP), by `deadline`, else `seconds` from now."""
    return TableEntry(
        mind,
        GrantState.RECLAIMING,
        "Preempted",
        slot=slot,
        tokens=512,
        by=VIP,
        deadline=deadline if deadline is not None else time.time() + seconds,
        since="r",
    )


def queued(mind: str, reason: str = "PoolFull") -> TableEntry:
    return TableEntry(mind, GrantState.QUEUED, reason)


def table(*entries: TableEntry, phase: EnginePhase = EnginePhase.SERVING) -> GrantTable:
    return GrantTable(512, phase, {e.mind: e for e in entries})


async def review(token: str, caller: Caller | None = None) -> ServiceAccount | None:
    return TOKENS.get(token)


@dataclass
class Rig:
    url: str
    admin_url: str
    gateway: Gateway
    fake: FakeLlama
    http: aiohttp.ClientSession
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

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

    def client(self, mind: str | None = MIRA, *, api_key: str = "unused") -> openai.AsyncOpenAI:
        """The official client, as an agent would make it (no retries: each answer is seen)."""
        headers = {MIND_HEADER: mind} if mind else {}
        client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, default_headers=headers, max_retries=0
        )
        self.clients.append(client)
        return client

    async def post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> tuple[int, Any, Any]:
        hdrs = {MIND_HEADER: MIRA} if headers is None else headers
        async with self.http.post(f"{self.url}{path}", json=body, headers=hdrs) as resp:
            return resp.status, await resp.json(), resp.headers

    async def post_get(
        self, path: str, headers: dict[str, str] | None = None
    ) -> tuple[int, Any, Any]:
        """A GET, as `post` (the mind named unless `headers` say otherwise)."""
        hdrs = {MIND_HEADER: MIRA} if headers is None else headers
        async with self.http.get(f"{self.url}{path}", headers=hdrs) as resp:
            return resp.status, await resp.json(), resp.headers


def run(
    initial: GrantTable | None,
    body: Callable[[Rig], Awaitable[None]],
    fake: FakeLlama | None = None,
    *,
    reviewed: bool = False,
    **overrides: Any,
) -> FakeLlama:
    """Serve the stand-in llama-server and the gateway in front of it (its routes as the
    engine serves them, and its admin routes) around `body`. `reviewed`: minds' tokens are
    reviewed (`TOKENS`), else the mind header is believed; `overrides`: more settings."""
    fake = fake or FakeLlama()

    async def main() -> None:
        upstream_runner, upstream = await serve(fake.app())
        settings = GatewaySettings(
            upstream=upstream,
            health_seconds=0.05,
            review_token=review if reviewed else None,
            **overrides,
        )
        gateway = Gateway(settings)
        await gateway.start()
        if initial is not None:
            gateway.set_table(initial)
        runner, address = await serve_app(gateway.app(), "127.0.0.1", 0)
        admin_runner, admin_url = await serve(gateway.admin_app())
        try:
            async with aiohttp.ClientSession() as http:
                rig = Rig(f"http://{address}", admin_url, gateway, fake, http)
                try:
                    await body(rig)
                finally:
                    for client in rig.clients:
                        await client.close()
        finally:
            await admin_runner.cleanup()
            await runner.cleanup()
            await gateway.close()
            await upstream_runner.cleanup()

    asyncio.run(main())
    return fake


def claude(rig: Rig, mind: str | None = MIRA, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    """Anthropic's client as an agent makes it: only the base URL is the engine's."""
    headers = {MIND_HEADER: mind} if mind else {}
    client = anthropic.AsyncAnthropic(
        base_url=rig.url, api_key=api_key, default_headers=headers, max_retries=0
    )
    rig.clients.append(client)  # type: ignore[arg-type]  # closed as the rig ends, as openai's
    return client
