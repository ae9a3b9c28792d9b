"""`continuum engine` and `continuum embed` run on uvloop's event loop (`cli.process.run_process`),
and on asyncio's where uvloop cannot be imported; the log says which, once."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest
import uvloop

from continuum_operator.cli.process import run_process


def loop_of_a_process() -> type[asyncio.AbstractEventLoop]:
    ran: list[type[asyncio.AbstractEventLoop]] = []

    async def main() -> None:
        ran.append(type(asyncio.get_running_loop()))

    assert run_process(None, main, ()) == 0
    return ran[0]


def test_a_process_runs_on_uvloop_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="continuum_operator.cli.process")
    assert issubclass(loop_of_a_process(), uvloop.Loop)
    said = [r.getMessage() for r in caplog.records if "event loop" in r.getMessage()]
    assert said == ["event loop: uvloop's"]


def test_without_uvloop_a_process_runs_on_asyncios_loop_and_says_why(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    caplog.set_level(logging.INFO, logger="continuum_operator.cli.process")
    loop = loop_of_a_process()
    assert not issubclass(loop, uvloop.Loop)
    assert issubclass(loop, asyncio.SelectorEventLoop)
    said = [r.getMessage() for r in caplog.records if "event loop" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("event loop: asyncio's (uvloop cannot be imported")


def test_an_invalid_error_of_the_process_still_exits_2_with_its_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def main() -> None:
        raise ValueError("the plan file names no model: give --plan a plan")

    assert run_process(None, main, (ValueError,)) == 2
    assert "the plan file names no model" in capsys.readouterr().err
