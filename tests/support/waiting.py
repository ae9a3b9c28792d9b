"""Waiting in a test for what another task brings about: one poll loop for every test that
needs it, so each states only its condition and how long it may take."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `check` on the event loop until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def wait_for(
    what: str, probe: Callable[[], Any], timeout: float = 60, log: Path | None = None
) -> Any:
    """Poll until `probe` returns something truthy; fail with the operator's log tail."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.5)
    tail = "\n".join(log.read_text().splitlines()[-40:]) if log and log.exists() else ""
    pytest.fail(f"timed out waiting for {what}; last: {last!r}\noperator log:\n{tail}")
