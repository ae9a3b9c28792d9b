"""What strangers can do to the gateway's door (no grant, often no credential at all), through
HTTP in front of the stand-in llama-server: lock a mind out through token review, hold the
gateway's memory with slow bodies, open connections without bound.

Found by an attacker against main: 100 connections sending random bearer tokens kept the
reviewer's 64 pending reviews full (a mind whose token was not cached was answered 503
`review_unavailable` 13 to 17 times in 20); any token of the engine's audience had its body read
with no time limit (a byte every 3 s, still open after 40 s; 200 bodies of 1 MiB pinned 226 MiB).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from continuum_operator.engine.gateway import Gateway, GatewaySettings, serve_app
from continuum_operator.engine.token_review import TokenReviewer
from tests.unit.fake_llama import FakeLlama, serve
from tests.unit.test_gateway_openai import MIRA, granted, table
from tests.unit.test_token_review_lanes import AUDIENCE, MIRA_SUB, Api, jwt


@dataclass
class Door:
    url: str
    gateway: Gateway
    api: Api


def run(api: Api, body: Callable[[Door], Awaitable[None]], **settings: Any) -> None:
    async def main() -> None:
        upstream_runner, upstream = await serve(FakeLlama().app())
        reviewer = TokenReviewer(AUDIENCE, api=api)
        gateway = Gateway(
            GatewaySettings(
                upstream=upstream, health_seconds=0.05, review_token=reviewer, **settings
            )
        )
        await gateway.start()
        gateway.set_table(table(granted(MIRA)))
        runner, address = await serve_app(gateway.app(), "127.0.0.1", 0)
        try:
            await body(Door(f"http://{address}", gateway, api))
        finally:
            await runner.cleanup()
            await gateway.close()
            await upstream_runner.cleanup()

    asyncio.run(main())


COMPLETION = {"prompt": "hi", "n_predict": 2}


def test_a_minds_uncached_token_is_served_while_strangers_flood_the_review() -> None:
    mira = jwt(MIRA_SUB, nonce="fresh")
    answers: list[int] = []

    async def body(door: Door) -> None:
        done = asyncio.Event()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:

            async def stranger(i: int) -> None:
                j = 0
                while not done.is_set():
                    j += 1
                    headers = {"Authorization": f"Bearer random-{i}-{j}"}
                    try:
                        async with http.post(
                            f"{door.url}/completion", json=COMPLETION, headers=headers
                        ) as resp:
                            await resp.read()
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.01)

            flood = [asyncio.create_task(stranger(i)) for i in range(100)]
            await asyncio.sleep(0.5)
            for _ in range(10):
                door.gateway.settings.review_token._accepted.clear()  # type: ignore[union-attr]
                headers = {"Authorization": f"Bearer {mira}"}
                async with http.post(
                    f"{door.url}/completion", json=COMPLETION, headers=headers
                ) as resp:
                    await resp.read()
                    answers.append(resp.status)
            done.set()
            await asyncio.gather(*flood)

    run(Api(mira, stranger_seconds=0.2), body)
    assert answers == [200] * 10
