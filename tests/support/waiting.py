"""Waiting in a test for what another task brings about: one poll loop for every test that
needs it, so each states only its condition and how long it may take."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll `check` on the event loop until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
