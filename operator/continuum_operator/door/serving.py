"""How a runtime's door is served (the engine's gateway, an embed lane): the aiohttp app behind
bounded connections (`serve_app`), and the admin app served to the cluster's operators on a port
of its own (`admin_application`).

Found by an attacker on the gateway: connections were bounded by nothing, and a client that
opened one and never finished its headers held it. What holds (docs/gateway.md, "What a
connection may hold"):

- a source address holds at most `ConnectionLimits.per_source` (64) connections and the port
  `total` (1,024); a connection past either is closed as it opens, before a byte is read.
  What an unread connection holds is aiohttp's request head (8 KiB a line) and at most 128 KiB
  of a body it has not been asked to read (its reader stops reading the socket past that), for
  at most 10 s (`HEADERS_SECONDS`) without a whole head.
- a body left unread is drained `LINGER_SECONDS`, no longer, before its connection is closed.

How a body is read once a request is admitted (time, size, budget) is `door.body_limits`'s, for
both doors. Neighbours: `engine.gateway` and `embed.runtime`, which serve through
`serve_app`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

__all__ = [
    "DEFAULT_CONNECTIONS",
    "HEADERS_SECONDS",
    "LINGER_SECONDS",
    "ConnectionLimits",
    "Handler",
    "LimitedSite",
    "admin_application",
    "serve_app",
]

#: An aiohttp request handler.
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Seconds a connection may take to send a whole request head, and stay idle between requests:
#: a client that opens a connection and never finishes its headers is dropped after it
#: (aiohttp's keep-alive timer runs from the connection's start until a request is read).
HEADERS_SECONDS = 10.0

#: Seconds a body left unread (answered before it was read, or past its time) is still read
#: and dropped before its connection is closed: long enough for a client that sent it whole
#: to read the answer rather than a reset; a slow one is closed this long after its answer.
LINGER_SECONDS = 2.0


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


def admin_application(
    metrics: Handler, healthz: Handler, readyz: Handler, reports: Mapping[str, Handler]
) -> web.Application:
    """The admin port's application of a runtime (the engine's gateway, an embed lane): what is
    served to the cluster's operators and never to the runtime's callers. `/metrics`, the
    runtime's own `reports` (a path each), and the probes `/healthz` and `/readyz`."""
    app = web.Application()
    app.router.add_get("/metrics", metrics)
    for path, handler in reports.items():
        app.router.add_get(path, handler)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    headers_seconds: float = HEADERS_SECONDS,
    connections: ConnectionLimits = DEFAULT_CONNECTIONS,
) -> tuple[web.AppRunner, str]:
    """Serve `app` as a runtime's door must be served: a caller hanging up cancels her request
    (`handler_cancellation`: in llama-server too, behind the gateway), a connection that sends
    no whole request head within `headers_seconds` is closed, and connections are bounded per
    source address and in all (`connections`). Returns the runner and the bound address."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        keepalive_timeout=headers_seconds,
        lingering_time=LINGER_SECONDS,  # a body left unread is drained this long, no longer
    )
    await runner.setup()
    site = LimitedSite(runner, host, port, connections)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname() if sockets else (host, port)
    return runner, f"{bound[0]}:{bound[1]}"
