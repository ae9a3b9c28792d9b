"""A request's waits on llama-server end at a cut (`Gateway._until_cut`): the work is
cancelled and the request answered as cut; her own hanging up is never taken for a cut; and the
request's task, which the cut cancels while it waits, carries no cancel past the wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.gateway_state import _CutNow, _Flight

MIRA = "minds/mira"


def gateway() -> Gateway:
    return Gateway(GatewaySettings(upstream="http://127.0.0.1:9", watchdog=None))


async def _held(started: asyncio.Event, cancelled: list[bool]) -> str:
    started.set()
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        cancelled.append(True)
        raise
    return "never"


def test_a_cut_while_waiting_cancels_the_work_and_answers_cut() -> None:
    async def body() -> None:
        gw, flight = gateway(), _Flight(MIRA, 0)
        started, cancelled = asyncio.Event(), list[bool]()
        waiting = asyncio.create_task(gw._until_cut(flight, _held(started, cancelled)))
        await started.wait()
        flight.end("Preempted", "minds/vip")
        with pytest.raises(_CutNow):
            await waiting
        assert cancelled == [True]

    asyncio.run(body())


async def _cancels_left_after_a_cut(
    work: Callable[[asyncio.Event], Coroutine[Any, Any, str]],
) -> int:
    """A request waits on `work`, cut once the work has started: the cancels its task still
    carries after it was answered cut and went on (its answer, a stream's last event)."""
    gw, flight = gateway(), _Flight(MIRA, 0)
    started = asyncio.Event()

    async def request() -> int:
        with pytest.raises(_CutNow):
            await gw._until_cut(flight, work(started))
        await asyncio.sleep(0.01)  # the cut's last words: no cancel left to land here
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling()

    waiting = asyncio.create_task(request())
    await started.wait()
    flight.end("Preempted", None)
    return await waiting


def test_after_a_cut_the_request_goes_on_uncancelled() -> None:
    """The cut cancels the request's own task while it waits: once answered as cut, the task
    is not cancelling (a later `asyncio.timeout` would misread a cancel left over)."""
    assert asyncio.run(_cancels_left_after_a_cut(lambda started: _held(started, []))) == 0


def test_a_cut_the_work_swallows_is_still_answered_cut_and_taken_back() -> None:
    """A library that catches the cancel and returns (aiohttp's cleanup may): answered cut,
    and the cancel taken back all the same."""

    async def swallows(started: asyncio.Event) -> str:
        started.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(60)
        return "finished anyway"

    assert asyncio.run(_cancels_left_after_a_cut(swallows)) == 0


def test_a_flight_cut_before_its_wait_is_answered_cut_at_once() -> None:
    async def body() -> None:
        gw, flight = gateway(), _Flight(MIRA, 0)
        flight.end("Preempted", None)
        started, cancelled = asyncio.Event(), list[bool]()
        async with asyncio.timeout(5):  # not the work's 60 s
            with pytest.raises(_CutNow):
                await gw._until_cut(flight, _held(started, cancelled))
        assert not started.is_set()  # nothing of it sent to llama-server

    asyncio.run(body())


def test_her_hanging_up_is_not_taken_for_a_cut_even_when_both_come() -> None:
    async def body(cut_too: bool) -> None:
        gw, flight = gateway(), _Flight(MIRA, 0)
        started, cancelled = asyncio.Event(), list[bool]()
        waiting = asyncio.create_task(gw._until_cut(flight, _held(started, cancelled)))
        await started.wait()
        waiting.cancel()  # aiohttp's handler cancellation: she hung up
        if cut_too:
            flight.end("Preempted", None)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert cancelled == [True]

    asyncio.run(body(cut_too=False))
    asyncio.run(body(cut_too=True))


def test_a_wait_that_ends_of_itself_returns_its_result_or_raises_its_error() -> None:
    async def fails() -> None:
        raise ValueError("llama-server said no")

    async def fails_as_cut(flight: _Flight) -> None:
        flight.end("Preempted", None)
        raise ValueError("closed as the cut came")

    async def body() -> None:
        gw, flight = gateway(), _Flight(MIRA, 0)
        assert await gw._until_cut(flight, asyncio.sleep(0, "answer")) == "answer"
        with pytest.raises(ValueError, match="said no"):
            await gw._until_cut(flight, fails())
        with pytest.raises(_CutNow):  # failing because of the cut: answered as the cut
            await gw._until_cut(flight, fails_as_cut(flight))
        await asyncio.sleep(0)  # cut from inside its own wait: no cancel carried past it

    asyncio.run(body())
