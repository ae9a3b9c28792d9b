"""How an embed lane reads a caller's body (docs/embedlanes.md, "The door"; `door.body_limits`,
as the engine's gateway reads its own): within its time, within its size, within the budget of
bodies read at once, each refusal in the lane's error shape (OpenAI's, with the lane's reason).

The finding this guards: the lane read bodies with aiohttp's `request.json()`, 1 MiB at most but
with no time limit, so a caller that trickled her body held a connection, and one of the port's
connection slots (`door.serving.ConnectionLimits`), as long as she liked; an oversize body was
answered in aiohttp's plain text, not in the lane's error shape.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from continuum_operator.door.body_limits import BodyLimits, BodyReader
from continuum_operator.door.serving import LINGER_SECONDS, LimitedSite, serve_app
from continuum_operator.embed import runtime as lane_runtime
from continuum_operator.embed.runtime import LANE_BODY_LIMITS, LaneRuntime, LaneState
from tests.support.embed import WordModel
from tests.support.slow_client import trickle
from tests.support.waiting import until

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class Lane:
    host: str
    port: int
    runtime: LaneRuntime
    site: LimitedSite

    async def head(self, framing: str) -> Stream:
        """A POST of /v1/embeddings whose head is sent whole and its body not yet."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        writer.write(
            f"POST /v1/embeddings HTTP/1.1\r\nHost: lane\r\n"
            f"Content-Type: application/json\r\n{framing}\r\n\r\n".encode()
        )
        await writer.drain()
        return reader, writer


def run(body: Callable[[Lane], Awaitable[None]], limits: BodyLimits | None = None) -> None:
    """`body` against a lane served as `continuum embed` serves it; `limits`: its bodies' own
    (a shorter time than the lane's), else the lane's (`LANE_BODY_LIMITS`)."""

    async def scenario() -> None:
        rt = LaneRuntime(
            WordModel(),  # type: ignore[arg-type]
            LaneState(max_context_tokens=1024, leased_context_tokens=512),
        )
        assert rt.bodies.limits == LANE_BODY_LIMITS
        if limits is not None:
            rt.bodies = BodyReader(limits)
        await rt.calibrate()
        runner, address = await serve_app(rt.app(), "127.0.0.1", 0)
        (site,) = runner.sites
        assert isinstance(site, LimitedSite)
        host, port = address.split(":")
        try:
            await body(Lane(host, int(port), rt, site))
        finally:
            await runner.cleanup()

    asyncio.run(scenario())


@pytest.fixture(autouse=True)
def no_llama(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lane_runtime, "gpu_offload_supported", lambda: False)
    monkeypatch.setattr(lane_runtime, "llama_build", lambda: "test")


async def answer(reader: asyncio.StreamReader, seconds: float) -> tuple[int, dict[str, str]]:
    """The status and headers of the answer (its body is left to `error_of`)."""
    status = int((await asyncio.wait_for(reader.readline(), seconds)).split()[1])
    headers: dict[str, str] = {}
    while (line := await asyncio.wait_for(reader.readline(), seconds)) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def error_of(reader: asyncio.StreamReader, headers: dict[str, str]) -> dict[str, Any]:
    """The answer's error, checked to be the lane's shape: OpenAI's fields and the reason."""
    doc = json.loads(await reader.readexactly(int(headers["content-length"])))
    error: dict[str, Any] = doc["error"]
    assert {"message", "type", "param", "code", "reason", "tokens"} <= set(error), error
    return error


def test_a_body_trickled_past_its_time_is_answered_408_and_its_connection_freed() -> None:
    limits = BodyLimits(seconds=1.0)

    async def body(lane: Lane) -> None:
        reader, writer = await lane.head("Content-Length: 1000")
        started = time.monotonic()

        dripping = trickle(writer)
        assert lane.site.counts.total == 1
        status, headers = await answer(reader, limits.seconds + 4.0)
        assert status == 408
        assert time.monotonic() - started < limits.seconds + 1.0
        error = await error_of(reader, headers)
        assert (error["reason"], error["code"]) == ("BodyTimeout", "body_timeout"), error
        assert "did not arrive within 1 s; send it at once" in error["message"]
        # Not kept alive: the lane closes it, and its slot of the port is free again.
        assert await asyncio.wait_for(reader.read(), LINGER_SECONDS + 2.0) == b""
        await until(lambda: lane.site.counts.total == 0)
        assert time.monotonic() - started < limits.seconds + LINGER_SECONDS + 1.0
        assert lane.runtime.bodies.reserved == 0
        dripping.cancel()
        writer.close()

    run(body, limits)


@pytest.mark.parametrize(
    "framing",
    [
        f"Content-Length: {2**20 + 1}",  # refused by what it declares, before a byte is read
        "Transfer-Encoding: chunked",  # refused by the bytes read
    ],
)
def test_a_body_over_a_mebibyte_is_answered_413_in_the_lanes_shape(framing: str) -> None:
    async def body(lane: Lane) -> None:
        reader, writer = await lane.head(framing)
        if framing.startswith("Transfer-Encoding"):
            chunk = b"[" * (2**20 + 1)
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
        status, headers = await answer(reader, 5.0)
        assert status == 413
        error = await error_of(reader, headers)
        assert (error["reason"], error["code"]) == ("BodyTooLarge", "body_too_large"), error
        assert error["type"] == "invalid_request_error"
        assert f"at most {2**20} are read" in error["message"]
        assert await asyncio.wait_for(reader.read(), LINGER_SECONDS + 2.0) == b""
        writer.close()
        await until(lambda: lane.site.counts.total == 0)

    run(body)


def test_bodies_past_the_budget_are_answered_503_with_when_to_send_again() -> None:
    limits = BodyLimits(seconds=3.0, max_bytes=2**20, budget_bytes=2 * 2**20)

    async def body(lane: Lane) -> None:
        held = [await lane.head(f"Content-Length: {2**20}") for _ in range(2)]
        await until(lambda: lane.runtime.bodies.reserved == 2 * 2**20)
        reader, writer = await lane.head("Content-Length: 10")
        status, headers = await answer(reader, 3.0)
        assert (status, headers.get("retry-after")) == (503, "1")
        error = await error_of(reader, headers)
        assert (error["reason"], error["type"]) == ("BodiesBusy", "server_error"), error
        for _, w in [*held, (reader, writer)]:
            w.close()
        await until(lambda: lane.runtime.bodies.reserved == 0)

    run(body, limits)


def test_a_body_read_within_its_limits_is_embedded() -> None:
    async def body(lane: Lane) -> None:
        sent = json.dumps({"input": ["a b c", "d"]}).encode()
        reader, writer = await lane.head(f"Content-Length: {len(sent)}")
        writer.write(sent)
        await writer.drain()
        status, headers = await answer(reader, 5.0)
        assert status == 200
        doc = json.loads(await reader.readexactly(int(headers["content-length"])))
        assert [d["index"] for d in doc["data"]] == [0, 1]
        assert doc["usage"]["prompt_tokens"] == 6
        writer.close()

    run(body)
