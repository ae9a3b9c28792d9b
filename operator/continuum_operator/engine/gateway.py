"""The grant gateway: llama-server's slots served only to minds holding a `Granted` grant.

Implements docs/gateway.md in front of one `llama-server`: turns open only on a `Granted`
grant; each request is pinned to the mind's slot (`id_slot`) with `n_predict` capped so that
prompt and generation fit in the grant; a reclaim refuses her new requests, cuts the ones in
flight (closing the upstream connection, which makes llama-server drop the task), erases the
slot and records the release, which the runtime reports in the Engine's `status.runtime`
(docs/design.md: the gateway, not the mind, reports the slot released). A slot that held another
mind's context is erased before a new holder's first request, so nothing leaks between minds.

Every decision comes from `engine.admission` (pure); these modules do the I/O. Each API it
speaks (llama-server's `/completion`, OpenAI's Chat Completions, Completions, Embeddings and
Responses, Anthropic's Messages) is a dialect (`engine.dialects`): one request path
(`engine.gateway_requests`: read, admit, check, count, cap, pin, forward) says each step in the
words of the API she spoke. The cut path (reclaim, park, erase, release) is
`engine.gateway_cuts`; what both hold and how a refusal is said, `engine.gateway_state`; this
module wires the routes, the lifecycle and the probes. llama-server's other routes are
`engine.llama_routes`'. The grant table is pushed in by a source (`engine.grants_source`)
through `set_table`; the gateway never grants on its own. `engine.runtime` runs it beside
llama-server; tests and `bench/gateway.py` run it in front of any llama-server.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web

from continuum_operator.core.grants import GrantReason
from continuum_operator.door.body_limits import BodyRefused
from continuum_operator.door.serving import admin_application
from continuum_operator.engine.admission import (
    Admission,
    Answer,
    Refusal,
    admit_turn,
)
from continuum_operator.engine.dialects import (
    CHAT,
    DOORS,
)
from continuum_operator.engine.gateway_requests import GatewayRequests
from continuum_operator.engine.gateway_state import (
    OPEN_TURN_BYTES,
    GatewaySettings,
    SlotRelease,
    _Turn,
)
from continuum_operator.engine.llama_routes import LlamaRoutes
from continuum_operator.engine.metrics import CONTENT_TYPE_LATEST

__all__ = ["Gateway", "GatewaySettings", "SlotRelease"]

log = logging.getLogger(__name__)

#: aiohttp's request handler without its access log (`web.Application`'s `handler_args`).
NO_ACCESS_LOG: Mapping[str, Any] = {"access_log": None}


class Gateway(GatewayRequests):
    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            connector=aiohttp.TCPConnector(limit=0),
        )
        await self.probe()
        self._health = asyncio.create_task(self._watch_health())
        if self.settings.watchdog is not None:
            self._watching = asyncio.create_task(self.watchdog.run())

    async def close(self) -> None:
        tasks = [
            t
            for t in (self._health, self._watching, *self._releasing.values(), *self._parking)
            if t is not None
        ]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        """The gateway's routes. Serve them with `handler_cancellation=True` (aiohttp's
        `AppRunner` option), so that a mind hanging up cancels her request in llama-server.
        aiohttp's access log only where the settings ask for it (`access_log`)."""
        app = web.Application(handler_args=None if self.settings.access_log else NO_ACCESS_LOG)
        app.router.add_post("/v1/turns", self.open_turn)
        app.router.add_delete("/v1/turns/{turn}", self.end_turn)
        app.router.add_post("/v1/park", self.park_now)
        for path, dialect in DOORS.items():
            app.router.add_post(path, self.door(dialect))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/health", self.readyz)  # llama-server's name, for probes
        LlamaRoutes(self).add_to(app)  # the rest of llama-server's routes; last, a catch-all
        return app

    def admin_app(self) -> web.Application:
        """What is served to the cluster's operators, not to minds, on a port of its own:
        `/metrics`, `/v1/releases` (and the runtime's `/v1/runtime`), and the probes."""
        return admin_application(
            self.metrics_endpoint,
            self.healthz,
            self.readyz,
            {"/v1/releases": self.releases_endpoint},
        )

    async def probe(self) -> None:
        try:
            async with self.session.get(
                f"{self.settings.upstream}/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                ready = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ready = False
        flipped = ready != self.engine_ready
        self.engine_ready = ready
        self.metrics.engine_ready(ready)
        if flipped:
            log.info("llama-server %s", "ready" if ready else "not ready")
            self._changed()  # status.runtime.ready follows (a hung server answers no /health)
        if ready and self.slot_count is None:
            self.slot_count = await self._count_slots()

    async def _count_slots(self) -> int | None:
        try:
            async with self.session.get(
                f"{self.settings.upstream}/slots", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                slots = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        return len(slots) if isinstance(slots, list) else None

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_seconds)
            await self.probe()

    # --- routes -------------------------------------------------------------------------------

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def readyz(self, request: web.Request) -> web.Response:
        if self.table is None:
            return web.json_response({"ready": False, "reason": "NoGrantTable"}, status=503)
        if not self.engine_ready:
            return web.json_response({"ready": False, "reason": "EngineNotReady"}, status=503)
        return web.json_response({"ready": True})

    async def metrics_endpoint(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def releases_endpoint(self, request: web.Request) -> web.Response:
        return web.json_response([r.to_status() for r in self.releases()])

    async def open_turn(self, request: web.Request) -> web.Response:
        mind, refused = await self._who(request)
        if refused is not None:
            return self._answer(refused)
        asked: int | None = None
        if request.can_read_body:
            early = self._admit_turn(mind, None)  # no body is read for whom it cannot serve
            if early.answer is not Answer.ADMIT:
                return self._answer(early)
            body = await self.bodies.read_json(request, most=OPEN_TURN_BYTES)
            if isinstance(body, BodyRefused):
                return self._body_refused(body)
            raw = body.get("contextTokens") if isinstance(body, dict) else None
            if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 1):
                return self._refuse(
                    Refusal.BAD_REQUEST, 400, {"message": "contextTokens: a positive integer"}
                )
            asked = raw
        adm = self._admit_turn(mind, asked)
        if adm.answer is not Answer.ADMIT:
            return self._answer(adm)
        assert adm.slot is not None
        for tid in [t for t, turn in self.turns.items() if turn.mind == mind]:
            del self.turns[tid]  # one turn per mind: a new one ends the old
        tid = "t-" + secrets.token_hex(8)
        self.turns[tid] = _Turn(mind, adm.slot, self.clock())
        return web.json_response({"turn": tid, **adm.body}, status=201)

    async def end_turn(self, request: web.Request) -> web.Response:
        mind, refused = await self._who(request)
        if refused is not None:
            return self._answer(refused)
        turn = self.turns.get(request.match_info["turn"])
        if turn is not None and turn.mind == mind:
            del self.turns[request.match_info["turn"]]
        return web.Response(status=204)

    async def models(self, request: web.Request) -> web.Response:
        """`GET /v1/models`: llama-server's answer (the one model), to a mind of this engine."""
        _, refused = await self.of_this_engine(request)
        if refused is not None:
            return self._answer(refused, CHAT)
        try:
            async with self.session.get(f"{self.settings.upstream}/v1/models") as resp:
                return web.json_response(await resp.json(content_type=None), status=resp.status)
        except (aiohttp.ClientError, ValueError):
            return self._refuse(
                Refusal.RELAUNCHING, 503, {"reason": GrantReason.ENGINE_RELAUNCHING.value}, CHAT
            )

    async def of_this_engine(self, request: web.Request) -> tuple[str, Admission | None]:
        """The mind the request speaks for, and None if she is in this engine's table (any
        state: what she asks takes no slot); else why she may not ask."""
        mind, refused = await self._who(request)
        if refused is None and (self.table is None or self.table.entry(mind) is None):
            refused = admit_turn(self.table, mind)
        if refused is not None and refused.answer is not Answer.ADMIT:
            return mind, refused
        return mind, None
