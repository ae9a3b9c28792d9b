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
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from continuum_operator.door.body_limits import BodyLimits
from continuum_operator.door.serving import LINGER_SECONDS, ConnectionLimits, serve_app
from continuum_operator.door.token_review import TokenReviewer
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from tests.support.fake_llama import FakeLlama, serve
from tests.support.gateway import MIRA, granted, table
from tests.support.slow_client import trickle
from tests.support.token_review import AUDIENCE, MIRA_SUB, Api, jwt
from tests.support.waiting import until


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
            # Her pod's address is not theirs.
            own = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(connector=own) as hers:
                for _ in range(10):
                    reviewer = door.gateway.settings.review_token
                    reviewer._accepted.clear()  # type: ignore[union-attr]  # a fresh review
                    headers = {"Authorization": f"Bearer {mira}"}
                    async with hers.post(
                        f"{door.url}/completion", json=COMPLETION, headers=headers
                    ) as resp:
                        await resp.read()
                        answers.append(resp.status)
            done.set()
            await asyncio.gather(*flood)

    run(Api(mira, stranger_seconds=0.2), body)
    assert answers == [200] * 10


#: Each route that reads a body (a generating route of each dialect, a route that takes no
#: slot, a turn's opening), and how its clients send her token.
BODY_ROUTES = (
    ("/completion", "Authorization: Bearer"),
    ("/v1/chat/completions", "Authorization: Bearer"),
    ("/v1/messages", "x-api-key:"),
    ("/v1/responses", "Authorization: Bearer"),
    ("/tokenize", "Authorization: Bearer"),
    ("/v1/messages/count_tokens", "x-api-key:"),
    ("/v1/turns", "Authorization: Bearer"),
)


async def send_head(
    door: Door,
    token: str,
    length: int,
    path: str = "/completion",
    auth: str = "Authorization: Bearer",
) -> tuple[Any, Any]:
    """A POST whose head says `length` body bytes, none sent yet: (reader, writer)."""
    host, port = door.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth} {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()
    )
    await writer.drain()
    return reader, writer


async def status_of(reader: asyncio.StreamReader, seconds: float) -> int:
    line = await asyncio.wait_for(reader.readline(), seconds)
    return int(line.split()[1])


def test_a_slow_body_is_answered_408_and_closed_at_the_limit() -> None:
    mira = jwt(MIRA_SUB, nonce="slow")
    limits = BodyLimits(seconds=1.0)

    async def body(door: Door) -> None:
        # Every route at once (each is timed from its own start): 7 in a row took 21 s.
        await asyncio.gather(*(slow(door, path, auth) for path, auth in BODY_ROUTES))

    async def slow(door: Door, path: str, auth: str) -> None:
        reader, writer = await send_head(door, mira, 1000, path, auth)
        started = time.monotonic()

        dripping = trickle(writer)
        assert await status_of(reader, 5.0) == 408, path
        assert time.monotonic() - started < limits.seconds + 1.0
        await asyncio.wait_for(reader.read(), 5.0)  # closed: read to its end
        assert time.monotonic() - started < limits.seconds + LINGER_SECONDS + 1.0
        dripping.cancel()
        writer.close()

    run(Api(mira), body, body_limits=limits)


def test_no_body_is_read_for_an_accepted_token_without_a_grant() -> None:
    bob = jwt("system:serviceaccount:minds/bob".replace("/", ":"), nonce="b")

    async def body(door: Door) -> None:
        for path, auth in BODY_ROUTES:
            reader, writer = await send_head(door, bob, 2**20, path, auth)
            assert await status_of(reader, 3.0) == 403, path  # before a byte of the body
            writer.close()

    run(Api(bob), body)


def test_the_bodies_being_read_together_hold_at_most_the_budget() -> None:
    mira = jwt(MIRA_SUB, nonce="m")
    limits = BodyLimits(seconds=3.0, budget_bytes=4 * 2**20)

    async def body(door: Door) -> None:
        heads = [await send_head(door, mira, 2**20) for _ in range(4)]
        await until(lambda: door.gateway.bodies.reserved == 4 * 2**20)
        reader, writer = await send_head(door, mira, 2**20)
        assert await status_of(reader, 3.0) == 503  # over the budget: not read
        assert door.gateway.bodies.reserved <= limits.budget_bytes
        for _, w in [*heads, (reader, writer)]:
            w.close()
        await until(lambda: door.gateway.bodies.reserved == 0)

    run(Api(mira), body, body_limits=limits)


def test_connections_past_the_limit_of_one_source_are_closed_as_they_open() -> None:
    async def main() -> None:
        app = web.Application()
        limits = ConnectionLimits(per_source=3, total=10)
        runner, address = await serve_app(app, "127.0.0.1", 0, connections=limits)
        host, port = address.split(":")
        try:
            held = [await asyncio.open_connection(host, int(port)) for _ in range(3)]
            reader, writer = await asyncio.open_connection(host, int(port))
            assert await asyncio.wait_for(reader.read(), 3.0) == b""  # closed at once
            writer.close()
            held[0][1].close()
            await asyncio.sleep(0.1)
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await status_of(reader, 3.0) == 404  # one left: served again
            for _, w in [*held[1:], (reader, writer)]:
                w.close()
        finally:
            await runner.cleanup()

    asyncio.run(main())
