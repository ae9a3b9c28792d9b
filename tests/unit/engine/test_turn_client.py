"""The turn client against a gateway that answers as docs/gateway.md says.

The gateway here is a scripted stand-in served by aiohttp on loopback: it plays the contract's
answers in order so each client behaviour can be shown alone. The real gateway is tested
against the same contract with llama-server in the engine runtime's tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from continuum_operator.engine.turn import (
    MIND_HEADER,
    TURN_HEADER,
    ContextTooLarge,
    TurnCut,
    TurnDeadline,
    TurnRefused,
    turn,
)

Answer = tuple[int, dict[str, Any], dict[str, str]]
GRANTED: Answer = (201, {"turn": "t-1", "slot": 1, "tokens": 4096, "reason": "SlotFree"}, {})


def queued(reason: str = "PoolFull") -> Answer:
    return (429, {"error": "queued", "reason": reason, "position": 1}, {"Retry-After": "1"})


RELAUNCHING: Answer = (503, {"error": "relaunching", "reason": "EngineRelaunching"}, {})
RECLAIMING: Answer = (409, {"error": "reclaiming", "reason": "Preempted", "by": "minds/vip"}, {})


async def with_gateway(
    answers: list[Answer],
    body: Callable[[str, dict[str, Any]], Awaitable[None]],
    completion: Answer = (200, {"content": "hi"}, {}),
) -> dict[str, Any]:
    seen: dict[str, Any] = {"opens": 0, "deleted": [], "completions": []}

    async def open_turn(request: web.Request) -> web.Response:
        assert request.headers[MIND_HEADER] == "minds/mira"
        seen["opens"] += 1
        status, payload, headers = answers.pop(0) if len(answers) > 1 else answers[0]
        return web.json_response(payload, status=status, headers=headers)

    async def complete(request: web.Request) -> web.Response:
        seen["completions"].append((request.headers.get(TURN_HEADER), await request.json()))
        status, payload, headers = completion
        return web.json_response(payload, status=status, headers=headers)

    async def end_turn(request: web.Request) -> web.Response:
        seen["deleted"].append(request.match_info["turn"])
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/v1/turns", open_turn)
    app.router.add_delete("/v1/turns/{turn}", end_turn)
    app.router.add_post("/completion", complete)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        await body(f"http://127.0.0.1:{port}", seen)
    finally:
        await runner.cleanup()
    return seen


def test_a_granted_turn_runs_completions_under_its_turn_and_ends_it() -> None:
    async def body(url: str, seen: dict[str, Any]) -> None:
        async with turn(url, "minds/mira") as t:
            assert (t.slot, t.tokens, t.waits) == (1, 4096, [])
            assert await t.complete({"prompt": "hello"}) == {"content": "hi"}

    seen = asyncio.run(with_gateway([GRANTED], body))
    assert seen["completions"] == [("t-1", {"prompt": "hello"})]
    assert seen["deleted"] == ["t-1"]


def test_a_queued_mind_waits_with_its_reasons_then_takes_her_turn() -> None:
    async def body(url: str, seen: dict[str, Any]) -> None:
        async with turn(url, "minds/mira", poll_seconds=0.01) as t:
            assert [w.reason for w in t.waits] == ["PoolFull", "EngineRelaunching"]
            assert all(w.seconds >= 0 for w in t.waits)

    answers = [queued(), queued(), RELAUNCHING, GRANTED]
    seen = asyncio.run(with_gateway(answers, body))
    assert seen["opens"] == 4


def test_a_reclaiming_grant_ends_the_turn_at_once_without_waiting() -> None:
    async def body(url: str, seen: dict[str, Any]) -> None:
        started = time.monotonic()
        with pytest.raises(TurnCut) as cut:
            async with turn(url, "minds/mira", deadline_seconds=1500, poll_seconds=0.01):
                pytest.fail("a reclaiming grant must not open a turn")
        assert time.monotonic() - started < 5  # not the 1,500 s deadline
        assert cut.value.reason == "Preempted"
        assert "minds/vip" in str(cut.value)

    seen = asyncio.run(with_gateway([RECLAIMING], body))
    assert seen["opens"] == 1


def test_a_turn_cut_mid_completion_raises_and_still_ends_the_turn() -> None:
    cut: Answer = (409, {"error": "turn_cut", "reason": "EngineShrunk"}, {})

    async def body(url: str, seen: dict[str, Any]) -> None:
        with pytest.raises(TurnCut) as err:
            async with turn(url, "minds/mira") as t:
                await t.complete({"prompt": "long"})
        assert err.value.reason == "EngineShrunk"

    seen = asyncio.run(with_gateway([GRANTED], body, completion=cut))
    assert seen["deleted"] == ["t-1"]


def test_waiting_stops_at_the_turn_deadline_and_says_what_it_waited_for() -> None:
    async def body(url: str, seen: dict[str, Any]) -> None:
        with pytest.raises(TurnDeadline) as err:
            async with turn(url, "minds/mira", deadline_seconds=0.2, poll_seconds=0.02):
                pass
        assert err.value.reason == "WaitingForReclaim"
        assert "0 s" in str(err.value) or "deadline" in str(err.value)

    seen = asyncio.run(with_gateway([queued("WaitingForReclaim")], body))
    assert seen["opens"] >= 2


def test_a_context_too_large_fails_at_once_with_what_to_change() -> None:
    too_large: Answer = (
        413,
        {"error": "context_too_large", "slotTokens": 4096, "askedTokens": 9000},
        {},
    )

    async def body(url: str, seen: dict[str, Any]) -> None:
        with pytest.raises(ContextTooLarge, match="contextTokensPerMind"):
            async with turn(url, "minds/mira", poll_seconds=0.01):
                pass

    seen = asyncio.run(with_gateway([too_large], body))
    assert seen["opens"] == 1


def test_a_mind_the_engine_does_not_serve_is_refused() -> None:
    forbidden: Answer = (403, {"error": "forbidden", "message": "not a mind of this engine"}, {})

    async def body(url: str, seen: dict[str, Any]) -> None:
        with pytest.raises(TurnRefused):
            async with turn(url, "minds/mira"):
                pass

    asyncio.run(with_gateway([forbidden], body))


# --- `continuum turn`: a person's client, against the real gateway and the stand-in llama ----


def _cli(
    table_entries: list[Any],
    argv: list[str],
    mind_doc: dict[str, Any] | None = None,
    *,
    during: Callable[[Any], Awaitable[None]] | None = None,
    fake_args: dict[str, Any] | None = None,
    monkeypatch: pytest.MonkeyPatch,
) -> int:
    """Run `continuum turn` (its parser and its command) against a gateway on loopback."""
    import threading

    from continuum_operator.cli import build_parser
    from continuum_operator.cli import turn as turn_module
    from continuum_operator.door.serving import serve_app
    from continuum_operator.engine.admission import GrantTable
    from continuum_operator.engine.gateway import Gateway, GatewaySettings
    from tests.support.fake_llama import FakeLlama, serve

    ready = threading.Event()
    done = threading.Event()
    state: dict[str, Any] = {}

    async def serve_all() -> None:
        upstream_runner, upstream = await serve(FakeLlama(**(fake_args or {})).app())
        gateway = Gateway(GatewaySettings(upstream=upstream, health_seconds=0.05))
        await gateway.start()
        gateway.set_table(GrantTable(512, entries={e.mind: e for e in table_entries}))
        runner, address = await serve_app(gateway.app(), "127.0.0.1", 0)
        state["url"], state["gateway"] = f"http://{address}", gateway
        ready.set()
        if during is not None:
            await during(gateway)
        while not done.is_set():
            await asyncio.sleep(0.02)
        await runner.cleanup()
        await gateway.close()
        await upstream_runner.cleanup()

    thread = threading.Thread(target=lambda: asyncio.run(serve_all()))
    thread.start()
    try:
        assert ready.wait(10)
        doc = mind_doc or {}
        doc.setdefault("status", {})["endpoint"] = state["url"]
        monkeypatch.setattr(turn_module, "read_mind", lambda ns, name: doc)
        args = build_parser().parse_args(["turn", *argv])
        rc: int = args.func(args)
        return rc
    finally:
        done.set()
        thread.join(10)


def _granted(tokens: int = 512) -> Any:
    from continuum_operator.engine.admission import TableEntry
    from continuum_operator.model.mind import GrantState

    return TableEntry("minds/mira", GrantState.GRANTED, "SlotFree", slot=1, tokens=tokens)


def test_continuum_turn_streams_the_reply_and_says_the_grant_slot_and_cut_off(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    rc = _cli([_granted()], ["minds/mira", "hello there"], monkeypatch=monkeypatch)
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out.startswith(" tok tok")  # the tokens, as they came
    assert "slot 1, grant 512 tokens" in err
    assert "cut off (GrantTokens)" in err and "fill the grant of 512 tokens" in err


def test_continuum_turn_says_when_her_grant_is_reclaimed_mid_reply(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from continuum_operator.engine.admission import GrantTable, TableEntry
    from continuum_operator.model.mind import GrantState

    async def reclaim_soon(gateway: Any) -> None:
        while not gateway.flights:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        reclaim = TableEntry(
            "minds/mira",
            GrantState.RECLAIMING,
            "Preempted",
            slot=1,
            tokens=512,
            by="minds/vip",
            deadline=time.time() + 30,
            since="r",
        )
        gateway.set_table(GrantTable(512, entries={reclaim.mind: reclaim}))

    rc = _cli(
        [_granted()],
        ["minds/mira", "hello"],
        during=reclaim_soon,
        fake_args={"token_seconds": 0.01},
        monkeypatch=monkeypatch,
    )
    _, err = capsys.readouterr()
    assert rc == 3, err
    assert "reclaimed (Preempted by minds/vip)" in err


def test_continuum_turn_waits_no_longer_than_her_minds_turn_deadline(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from continuum_operator.engine.admission import TableEntry
    from continuum_operator.model.mind import GrantState

    queued = TableEntry("minds/mira", GrantState.QUEUED, "PoolFull")
    mind = {"spec": {"turnDeadlineSeconds": 1}}
    started = time.monotonic()
    rc = _cli([queued], ["minds/mira", "hello"], mind, monkeypatch=monkeypatch)
    waited = time.monotonic() - started
    _, err = capsys.readouterr()
    assert rc == 1
    assert "turn deadline of 1 s (waiting: PoolFull)" in err
    assert 0.9 < waited < 5


async def _serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_the_turn_deadline_bounds_a_gateway_that_never_answers() -> None:
    # It accepts the connection and never answers: the mind waited aiohttp's 300 s and got a
    # bare TimeoutError, whatever her deadline.
    async def main() -> None:
        release = asyncio.Event()

        async def hang(request: web.Request) -> web.Response:
            await release.wait()
            return web.Response(status=500)

        app = web.Application()
        app.router.add_post("/v1/turns", hang)
        runner, base = await _serve_app(app)
        try:

            async def take() -> None:
                async with turn(base, "minds/mira", deadline_seconds=1.0, poll_seconds=0.1):
                    pass

            started = time.monotonic()
            with pytest.raises(TurnDeadline, match="did not answer within the turn deadline"):
                await asyncio.wait_for(take(), 6.0)
            assert time.monotonic() - started < 3.0
        finally:
            release.set()
            await runner.cleanup()

    asyncio.run(main())


def test_a_reply_streamed_past_aiohttps_default_timeout_is_read_to_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # aiohttp's default session ends a request at 300 s, the whole stream included: a long
    # reply from a slow engine died with a traceback. The default scaled to 1 s here.
    import json

    import aiohttp

    from continuum_operator.cli import turn as turn_module
    from continuum_operator.cli.errors import EXIT_OK

    monkeypatch.setattr(aiohttp.client, "DEFAULT_TIMEOUT", aiohttp.ClientTimeout(total=1))

    async def open_turn(request: web.Request) -> web.Response:
        return web.json_response({"turn": "t-1", "slot": 0, "tokens": 4096}, status=201)

    async def end_turn(request: web.Request) -> web.Response:
        return web.Response(status=204)

    async def chat(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(8):
            chunk = {"choices": [{"delta": {"content": f"w{i} "}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.25)
        note = {"choices": [], "continuum": {"slot": 0, "nPredict": 8, "grantTokens": 4096}}
        await resp.write(f"data: {json.dumps(note)}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def main() -> int:
        app = web.Application()
        app.router.add_post("/v1/turns", open_turn)
        app.router.add_delete("/v1/turns/{turn}", end_turn)
        app.router.add_post("/v1/chat/completions", chat)
        runner, base = await _serve_app(app)
        try:
            return await turn_module.take_turn("minds/mira", "hi", None, base, 30.0, None)
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == EXIT_OK


def test_a_token_file_that_cannot_be_read_is_a_bad_argument_named(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from continuum_operator.cli import turn as turn_module
    from continuum_operator.cli.errors import EXIT_INVALID

    args = argparse.Namespace(
        mind="minds/mira", prompt="hi", gateway="http://127.0.0.1:9", deadline=1.0,
        token_file=tmp_path / "no-such-token", max_tokens=None,
    )  # fmt: skip
    assert turn_module.cmd_turn(args) == EXIT_INVALID
    assert "--token-file" in capsys.readouterr().err
