"""A client that sends its request body slowly, as an attacker holding a door's connection does
(the engine's gateway, an embed lane: `door.body_limits` bounds how long a body is read)."""

from __future__ import annotations

import asyncio
import contextlib


def trickle(
    writer: asyncio.StreamWriter, every: float = 0.3, times: int = 100
) -> asyncio.Task[None]:
    """Send a byte of body every `every` seconds, `times` times, until the door hangs up (the
    task: cancel it when done)."""

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(times):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(every)

    return asyncio.create_task(drip())
