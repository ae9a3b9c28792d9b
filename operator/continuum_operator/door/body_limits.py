"""How a runtime's door reads a request's body (the engine's gateway, an embed lane): under a
time limit, a size bound and a budget of all the bodies it reads at once.

Found by an attacker on the gateway: any token of the engine's audience, even an account's with
no grant, had its body read with no time limit (a byte every 3 s was still read after 40 s), and
200 bodies of about 1 MiB pinned 226 MiB of the engine pod, whose limit is its host bytes plus
512 MiB. The embed lane read its bodies with aiohttp's `request.json()`: 1 MiB at most, but with
no time limit, so a caller of the lane's namespace that trickled a body held a connection (and
one of `door.serving`'s connection slots) as long as she liked.

What holds, together with each door's order (docs/gateway.md, "What a connection may hold";
docs/embedlanes.md, "The door"):

- a body is read only once its caller's token is reviewed (and, at the gateway, her mind
  admitted: it reads no body for a stranger or a mind without a grant); then within
  `BodyLimits.seconds` (10 s) from the first byte asked for, at most `max_bytes` (1 MiB), and only
  while the bodies being read together fit `budget_bytes` (64 MiB at the gateway, 16 MiB at a
  lane: each reserves its `Content-Length`, or `max_bytes` when it sends none). Past the time:
  `408`; past the size: `413`; past the budget: `503` with `Retry-After`; each door answers in
  its own error shape.
- connections are bounded per source address and in all, and a whole request head must come
  within 10 s (`door.serving`, which both runtimes' doors are served through).

So what connections hold is bounded by design: `total` x (head + 128 KiB) + `budget_bytes`,
about 200 MiB at the gateway's defaults, whatever the clients do.
Neighbours: `engine.gateway` and `embed.runtime` (call `BodyReader.read_json`), `door.serving`.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = [
    "BodyLimits",
    "BodyReader",
    "BodyRefused",
]

#: Bytes asked of the connection at a time.
_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class BodyLimits:
    """How a request body is read (see the module's docstring)."""

    seconds: float = 10.0
    max_bytes: int = 2**20
    budget_bytes: int = 64 * 2**20
    #: Retry-After (seconds) when the budget is spent.
    retry_after: int = 1


@dataclass(frozen=True, slots=True)
class BodyRefused:
    """A body not read: the status, and what the client should do."""

    status: int
    message: str
    retry_after: int | None = None
    #: The connection is not kept alive after the answer (its body is left unread).
    close: bool = False


@dataclass(eq=False)
class BodyReader:
    """Reads request bodies under `limits`; `reserved` is what the bodies being read hold."""

    limits: BodyLimits = field(default_factory=BodyLimits)
    reserved: int = 0

    async def read_json(self, request: web.Request, most: int | None = None) -> Any:
        """The body as JSON, or a `BodyRefused`. `most`: a smaller size bound than the limits'."""
        raw = await self.read(request, most)
        if isinstance(raw, BodyRefused):
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            return BodyRefused(400, "the body is not JSON")
        except RecursionError:
            return BodyRefused(400, "the body nests deeper than this server reads")

    async def read(self, request: web.Request, most: int | None = None) -> bytes | BodyRefused:
        """The body's bytes, or a `BodyRefused`. `most`: a smaller size bound than the limits'."""
        most = min(most or self.limits.max_bytes, self.limits.max_bytes)
        declared = request.content_length
        if declared is not None and declared > most:
            return BodyRefused(
                413, f"the body is {declared} bytes; at most {most} are read", close=True
            )
        share = most if declared is None else declared
        if self.reserved + share > self.limits.budget_bytes:
            return BodyRefused(
                503,
                "this server is reading as many bodies as it holds at once; send it again",
                self.limits.retry_after,
            )
        self.reserved += share
        try:
            async with asyncio.timeout(self.limits.seconds):
                raw = await _read(request, most)
        except TimeoutError:
            return BodyRefused(
                408,
                f"the body did not arrive within {self.limits.seconds:g} s; send it at once",
                close=True,  # nothing more is read from this connection
            )
        finally:
            self.reserved -= share
        if raw is None:
            return BodyRefused(
                413, f"the body is over {most} bytes; at most {most} are read", close=True
            )
        return raw


async def _read(request: web.Request, most: int) -> bytes | None:
    """At most `most` bytes of the body; None if it holds more."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await request.content.read(_CHUNK):
        size += len(chunk)
        if size > most:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
