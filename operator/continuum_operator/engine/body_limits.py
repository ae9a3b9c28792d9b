"""What a connection may hold of the gateway: its body read under a time limit and a budget,
and connections bounded per source address and in all.

Found by an attacker: any token of the engine's audience, even an account's with no grant, had
its body read with no time limit (a byte every 3 s was still read after 40 s), and 200 bodies
of about 1 MiB pinned 226 MiB of the engine pod, whose limit is its host bytes plus 512 MiB.

What holds, together with the gateway's order (docs/gateway.md, "What a connection may hold"):

- a body is read only once its token is reviewed and its mind admitted (the gateway reads no
  body for a stranger or a mind without a grant); then within `BodyLimits.seconds` (10 s) from
  the first byte asked for, at most `max_bytes` (1 MiB), and only while the bodies being read
  together fit `budget_bytes` (64 MiB: each reserves its `Content-Length`, or `max_bytes` when
  it sends none). Past the time: `408`; past the size: `413`; past the budget: `503` with
  `Retry-After`.
- a source address holds at most `ConnectionLimits.per_source` (64) connections and the port
  `total` (1,024); a connection past either is closed as it opens, before a byte is read.
  What an unread connection holds is aiohttp's request head (8 KiB a line) and at most 128 KiB
  of a body it has not been asked to read (its reader stops reading the socket past that), for
  at most 10 s (`HEADERS_SECONDS`) without a whole head.

So what connections hold is bounded by design: `total` x (head + 128 KiB) + `budget_bytes`,
about 200 MiB at the defaults, whatever the clients do.
Neighbours: `engine.gateway` (calls `BodyReader.read_json` and serves through `LimitedSite`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

__all__ = [
    "DEFAULT_CONNECTIONS",
    "LINGER_SECONDS",
    "BodyLimits",
    "BodyReader",
    "BodyRefused",
    "ConnectionLimits",
    "LimitedSite",
]

log = logging.getLogger(__name__)

#: Seconds a body left unread (answered before it was read, or past its time) is still read
#: and dropped before its connection is closed: long enough for a client that sent it whole
#: to read the answer rather than a reset; a slow one is closed this long after its answer.
LINGER_SECONDS = 2.0

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
            return BodyRefused(400, "the body nests deeper than the gateway reads")

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
                "the gateway is reading as many bodies as it holds at once; send it again",
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


# --- connections -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """Connections the port holds at once: per source address, and in all."""

    per_source: int = 64
    total: int = 1024


DEFAULT_CONNECTIONS = ConnectionLimits()


@dataclass(eq=False)
class _Counts:
    limits: ConnectionLimits
    by_source: Counter[str] = field(default_factory=Counter)
    total: int = 0
    turned_away: int = 0

    def take(self, source: str) -> bool:
        if self.total >= self.limits.total or self.by_source[source] >= self.limits.per_source:
            self.turned_away += 1
            return False
        self.by_source[source] += 1
        self.total += 1
        return True

    def give(self, source: str) -> None:
        self.total -= 1
        self.by_source[source] -= 1
        if self.by_source[source] <= 0:
            del self.by_source[source]


class _Counted(asyncio.Protocol):
    """aiohttp's protocol of one connection, counted; closed at once when over a limit."""

    def __init__(self, inner: asyncio.Protocol, counts: _Counts) -> None:
        self.inner = inner
        self.counts = counts
        self.source: str | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self.counts.take(source):
            transport.close()  # before a byte is read: nothing of it is held
            return
        self.source = source
        self.inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.source is None:
            return
        self.counts.give(self.source)
        self.source = None
        self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.source is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.source is not None else None

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


class LimitedSite(web.TCPSite):
    """aiohttp's TCP site, with its connections bounded by `limits`."""

    def __init__(
        self, runner: web.AppRunner, host: str, port: int, limits: ConnectionLimits
    ) -> None:
        super().__init__(runner, host, port)
        self.counts = _Counts(limits)

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None

        def counted() -> asyncio.Protocol:
            return _Counted(server(), self.counts)

        self._server = await asyncio.get_running_loop().create_server(
            counted, self._host, self._port, backlog=self._backlog
        )
