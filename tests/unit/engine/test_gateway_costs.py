"""A request's cost to the engine's shared loop, at the gateway: a shape over its bound is
refused with the field named before llama-server sees it (`engine.request_cost`), on every
dialect (native, OpenAI's, Anthropic's Messages and OpenAI's Responses) in its own words; the
watchdog's cut is said in each dialect's words too. The stall itself, against the real
llama-server, is tests/e2e/test_gateway_costs_llama.py's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from continuum_operator.door.serving import serve_app
from continuum_operator.engine.admission import GrantTable
from continuum_operator.engine.dialects import CHAT, MESSAGES, NATIVE, RESPONSES
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.gateway_requests import _cut_event
from continuum_operator.engine.gateway_state import _Flight
from continuum_operator.engine.park import NotParked
from continuum_operator.engine.parking import ParkSettings, ParkStore
from continuum_operator.engine.request_cost import DEFAULT_BOUNDS
from continuum_operator.engine.turn import MIND_HEADER
from continuum_operator.engine.watchdog import STALL_REASON, WatchdogSettings
from tests.support.fake_llama import FakeLlama, serve
from tests.support.gateway import MIRA, VIP, Rig, granted, reclaiming, run, table
from tests.support.waiting import until

STALL = "root ::= (" + "|".join(['"a"'] * 50) + ")*"


def test_a_grammar_that_would_stall_every_slot_is_refused_before_llama_server() -> None:
    async def body(rig: Rig) -> None:
        status, payload, _ = await rig.post(
            "/completion", {"prompt": "hi", "grammar": STALL, "ignore_eos": True}
        )
        assert status == 400
        assert "grammar" in payload["message"] and "alternatives" in payload["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "grammar": STALL}
        status, payload, headers = await rig.post("/v1/chat/completions", chat)
        assert status == 400 and payload["error"]["param"] == "grammar"
        assert headers["x-should-retry"] == "false"
        schema = {"enum": [str(i) for i in range(DEFAULT_BOUNDS.fanout + 1)]}
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        status, payload, _ = await rig.post(
            "/v1/chat/completions", {**chat, "grammar": None, "response_format": fmt}
        )
        assert status == 400 and payload["error"]["param"] == "response_format"
        ok = {"prompt": "hi", "grammar": 'root ::= ("a"|"b")*', "n_predict": 4}
        status, _, _ = await rig.post("/completion", ok)
        assert status == 200
        assert [r.get("grammar") for r in rig.fake.requests] == [ok["grammar"]]

    run(table(granted()), body)


@dataclass(eq=False)
class StallingLlama(FakeLlama):
    """A stand-in whose loop stalls while a request (a completion or a chat) with a grammar
    samples: `/slots` and an erase are answered only between steps, as llama-server answers
    them, and a step takes `step_seconds`; the stall goes on `after_cut` seconds after the
    request is cancelled (the step it was inside)."""

    step_seconds: float = 1.0
    after_cut: float = 0.0
    stalled_until: float = 0.0
    sampling: int = 0

    def stalled(self) -> bool:
        return self.sampling > 0 or time.monotonic() < self.stalled_until

    async def completion(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("grammar"):
            return await super().completion(request)
        return await self.sample_until_cut(body)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("grammar"):
            return await super().chat(request)
        return await self.sample_until_cut(body)

    async def sample_until_cut(self, body: dict[str, Any]) -> web.StreamResponse:
        """A request with a grammar: it samples, stalling the loop, until it is cancelled."""
        self.requests.append(body)
        self.busy.add(body["id_slot"])
        self.n_past[body["id_slot"]] = 3
        self.sampling += 1
        try:
            await asyncio.sleep(3600)
            raise AssertionError("not cut")
        finally:
            self.sampling -= 1
            self.stalled_until = time.monotonic() + self.after_cut
            self.busy.discard(body["id_slot"])

    async def between_steps(self) -> None:
        while self.stalled():
            await asyncio.sleep(min(self.step_seconds, 0.05))

    async def list_slots(self, request: web.Request) -> web.Response:
        await self.between_steps()
        return await super().list_slots(request)

    async def slot_action(self, request: web.Request) -> web.Response:
        await self.between_steps()
        return await super().slot_action(request)


@dataclass
class Engine:
    url: str
    gateway: Gateway
    fake: StallingLlama
    http: aiohttp.ClientSession

    async def post(self, mind: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with self.http.post(
            f"{self.url}/completion", json=body, headers={MIND_HEADER: mind}
        ) as resp:
            return resp.status, await resp.json()


def engine(
    fake: StallingLlama,
    initial: GrantTable,
    body: Callable[[Engine], Awaitable[None]],
    **settings: Any,
) -> None:
    async def main() -> None:
        upstream_runner, upstream = await serve(fake.app())
        gateway = Gateway(GatewaySettings(upstream=upstream, health_seconds=0.05, **settings))
        await gateway.start()
        gateway.set_table(initial)
        runner, address = await serve_app(gateway.app(), "127.0.0.1", 0)
        try:
            async with aiohttp.ClientSession() as http:
                await body(Engine(f"http://{address}", gateway, fake, http))
        finally:
            await runner.cleanup()
            await gateway.close()
            await upstream_runner.cleanup()

    asyncio.run(main())


GRAMMAR = {"prompt": "hi", "grammar": 'root ::= ("a"|"b")*', "ignore_eos": True}
QUICK = WatchdogSettings(probe_seconds=0.05, floor_seconds=0.05, patience=2)


def test_the_watchdog_cuts_the_request_whose_sampling_stalls_the_loop_and_says_why() -> None:
    async def body(e: Engine) -> None:
        started = time.monotonic()
        status, reply = await e.post(MIRA, GRAMMAR)
        assert (status, reply["reason"]) == (409, STALL_REASON)
        assert "grammar or schema" in reply["message"]
        assert time.monotonic() - started < 10
        assert e.gateway.watchdog.cuts == 1
        # Her turn is not over: an ordinary request of hers runs, and is not cut.
        status, _ = await e.post(MIRA, {"prompt": "hi", "n_predict": 4})
        assert status == 200

    engine(StallingLlama(), table(granted(MIRA)), body, watchdog=QUICK)


def test_an_ordinary_request_beside_a_slow_loop_is_not_cut() -> None:
    fake = StallingLlama(token_seconds=0.05)

    async def body(e: Engine) -> None:
        status, _ = await e.post(MIRA, {"prompt": "hi", "n_predict": 40})
        assert status == 200
        assert e.gateway.watchdog.cuts == 0

    engine(fake, table(granted(MIRA)), body, watchdog=QUICK)


def test_a_reclaim_during_a_stalled_loop_is_released_by_its_deadline() -> None:
    # No watchdog: the loop stays stalled 5 s past her cut (the step it is inside).
    fake = StallingLlama(after_cut=5.0)

    async def body(e: Engine) -> None:
        asking = asyncio.create_task(e.post(MIRA, GRAMMAR))
        await until(lambda: fake.sampling == 1)
        reclaimed = time.monotonic()
        e.gateway.set_table(table(reclaiming(MIRA, seconds=1.0)))
        status, reply = await asking
        assert (status, reply["error"]) == (409, "turn_cut")
        await until(lambda: bool(e.gateway.releases()), timeout=5)
        assert time.monotonic() - reclaimed < 2.0  # by her 1 s deadline, not the stall's 5 s
        [release] = e.gateway.releases()
        assert release.erased_tokens is None and release.to_status()["erasedTokens"] is None
        # The next holder's first request erases the slot first: nothing of hers leaks.
        e.gateway.set_table(table(granted(VIP, 0)))
        status, _ = await e.post(VIP, {"prompt": "hi", "n_predict": 2})
        assert status == 200 and fake.erased == [0]

    engine(fake, table(granted(MIRA)), body, watchdog=None)


def test_a_costly_shape_is_refused_on_messages_and_responses_in_their_own_words() -> None:
    # Messages and Responses bodies are translated to a chat: its grammar, tools' schemas and
    # response format are bounded as a chat's, and the refusal is said in the API she spoke.
    wide = {"type": "object", "properties": {"x": {"enum": [str(i) for i in range(64)]}}}

    async def body(rig: Rig) -> None:
        said = {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        costly: tuple[tuple[dict[str, Any], str], ...] = (
            ({"grammar": STALL}, "grammar"),
            ({"tools": [{"name": "f", "input_schema": wide}]}, "tools[0].function.parameters"),
        )
        for extra, field in costly:
            status, payload, _ = await rig.post("/v1/messages", {**said, **extra})
            assert (status, payload["type"]) == (400, "error")
            assert payload["error"]["type"] == "invalid_request_error"
            assert field in payload["error"]["message"]
        asked = {"model": "any", "input": "hi"}
        fmt = {"format": {"type": "json_schema", "name": "x", "schema": wide}}
        tool = {"type": "function", "name": "f", "parameters": wide}
        costly = (
            ({"grammar": STALL}, "grammar"),
            ({"text": fmt}, "response_format"),
            ({"tools": [tool]}, "tools[0].function.parameters"),
        )
        for extra, param in costly:
            status, payload, _ = await rig.post("/v1/responses", {**asked, **extra})
            assert status == 400 and payload["error"]["param"] == param
            assert payload["error"]["type"] == "invalid_request_error"

    fake = run(table(granted()), body)
    assert fake.requests == []


def test_the_watchdog_cuts_a_message_and_a_response_and_says_why_in_their_words() -> None:
    async def body(e: Engine) -> None:
        headers = {MIND_HEADER: MIRA}
        said = {"model": "any", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        grammar = {"grammar": GRAMMAR["grammar"]}
        async with e.http.post(
            f"{e.url}/v1/messages", json={**said, **grammar}, headers=headers
        ) as resp:
            status, reply = resp.status, await resp.json()
        assert (status, reply["type"]) == (409, "error")
        assert "grammar or schema" in reply["error"]["message"]
        async with e.http.post(
            f"{e.url}/v1/responses",
            json={"model": "any", "input": "hi", **grammar},
            headers=headers,
        ) as resp:
            status, reply = resp.status, await resp.json()
        assert status == 409 and "grammar or schema" in reply["error"]["message"]
        assert e.gateway.watchdog.cuts == 2

    engine(StallingLlama(), table(granted(MIRA)), body, watchdog=QUICK)


def test_a_cut_stream_of_each_dialect_says_the_watchdogs_reason_and_what_to_change() -> None:
    flight = _Flight(MIRA, 0)
    flight.end(STALL_REASON, None)
    for dialect in (MESSAGES, RESPONSES, CHAT, NATIVE):
        event = _cut_event(flight, dialect).decode()
        assert STALL_REASON in event and "grammar or schema" in event, dialect.name


def test_a_reclaim_during_a_stalled_loop_parks_nothing_and_is_released_by_its_deadline(
    tmp_path: Path,
) -> None:
    # A park store: the save, asked behind the release, waits on the stalled loop; at the
    # deadline it is given up, and the release says so: not parked and not erased.
    fake = StallingLlama(after_cut=5.0)

    async def body(e: Engine) -> None:
        settings = ParkSettings(tmp_path, 10**9, "sha256:abc/512", bytes_per_token=100)
        e.gateway.park = ParkStore(settings, e.gateway._post_json, e.gateway.metrics)
        asking = asyncio.create_task(e.post(MIRA, GRAMMAR))
        await until(lambda: fake.sampling == 1)
        reclaimed = time.monotonic()
        e.gateway.set_table(table(reclaiming(MIRA, seconds=2.0)))
        assert (await asking)[0] == 409
        await until(lambda: bool(e.gateway.releases()), timeout=5)
        await until(lambda: e.gateway.releases()[0].parked_tokens is not None, timeout=5)
        assert time.monotonic() - reclaimed < 3.0  # by her 2 s deadline, not the stall's 5 s
        [release] = e.gateway.releases()
        status = release.to_status()
        assert (status["erasedTokens"], status["parkedTokens"]) == (None, 0)
        assert status["notParked"] == NotParked.NO_TIME.value
        assert not e.gateway.park.waiting(MIRA)

    engine(fake, table(granted(MIRA)), body, watchdog=None)
