"""llama-server's routes besides the generating ones, at the gateway (docs/gateway.md, "Every
route"): `/tokenize`, `/detokenize`, `/apply-template` and `/v1/messages/count_tokens` served
to a mind of this engine, bounded in size and rate; `/props` and `/slots` filtered to what
concerns her; every other route refused, named where `dialects.routes` names it and by
default where it does not. The decisions are `dialects.routes`' (pure); this module does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from continuum_operator.core.grants import GrantReason
from continuum_operator.door.body_limits import BodyRefused
from continuum_operator.engine.admission import Admission, Refusal
from continuum_operator.engine.dialects import MESSAGES, NATIVE, RESPONSES, Bad, Dialect
from continuum_operator.engine.dialects.anthropic import check_count as messages_count
from continuum_operator.engine.dialects.responses import check_count as responses_count
from continuum_operator.engine.dialects.routes import (
    RateBucket,
    her_props,
    her_slots,
    not_served,
    rate_limited,
    shape_for,
)
from continuum_operator.engine.upstream import BadUpstreamRequest, UpstreamDown
from continuum_operator.model.mind import GrantState

if TYPE_CHECKING:
    from continuum_operator.engine.gateway import Gateway

#: The largest body a route that takes no slot reads: tokenizing is CPU of the engine's, paid
#: per byte, before any grant is spent.
UTILITY_BODY_BYTES = 256 * 1024

#: The routes that take no slot, forwarded as they are once she is known and within her rate.
FORWARDED = (
    "/tokenize",
    "/detokenize",
    "/apply-template",
    "/chat/completions/input_tokens",
    "/v1/chat/completions/input_tokens",
)


class LlamaRoutes:
    """The handlers; `add_to(app)` registers them."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        s = gateway.settings
        self.bucket = RateBucket(s.utility_per_second, s.utility_burst, gateway.clock)

    def add_to(self, app: web.Application) -> None:
        for path in FORWARDED:
            app.router.add_post(path, self.forwarded)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        app.router.add_post("/v1/responses/input_tokens", self.input_tokens)
        app.router.add_post("/responses/input_tokens", self.input_tokens)
        app.router.add_get("/props", self.props)
        app.router.add_get("/slots", self.slots)
        app.router.add_get("/models", self.gateway.models)
        app.router.add_get("/v1/health", self.gateway.readyz)
        # Last: every other method and path, refused (named where the table names it).
        app.router.add_route("*", "/{tail:.*}", self.refused)

    def _refuse(self, adm: Admission, dialect: Dialect) -> web.Response:
        return self.gateway._answer(adm, dialect)

    async def _admitted(self, request: web.Request, dialect: Dialect) -> web.Response | str:
        """Her name if she is a mind of this engine within her rate; else the refusal."""
        gateway = self.gateway
        mind, refused = await gateway.of_this_engine(request)
        if refused is not None:
            return self._refuse(refused, dialect)
        wait = self.bucket.wait(mind)
        if wait:
            return self._refuse(rate_limited(wait), dialect)
        return mind

    async def _body(self, request: web.Request, dialect: Dialect) -> bytes | web.Response:
        """Her body, read under the gateway's body limits (its time, the budget of all bodies
        being read) and this route's own bound, the smaller."""
        raw = await self.gateway.bodies.read(request, most=UTILITY_BODY_BYTES)
        if isinstance(raw, BodyRefused):
            return self.gateway._body_refused(raw, dialect)
        return raw

    def _down(self, dialect: Dialect) -> web.Response:
        return self.gateway._refuse(
            Refusal.RELAUNCHING, 503, {"reason": GrantReason.ENGINE_RELAUNCHING.value}, dialect
        )

    async def forwarded(self, request: web.Request) -> web.Response:
        """`/tokenize`, `/detokenize`, `/apply-template`: llama-server's answer, as it is."""
        who = await self._admitted(request, NATIVE)
        if isinstance(who, web.Response):
            return who
        raw = await self._body(request, NATIVE)
        if isinstance(raw, web.Response):
            return raw
        gateway = self.gateway
        headers = {"Content-Type": "application/json"}
        try:
            async with gateway.session.post(
                f"{gateway.settings.upstream}{request.path}", data=raw, headers=headers
            ) as resp:
                return web.Response(
                    body=await resp.read(), status=resp.status, content_type="application/json"
                )
        except aiohttp.ClientError:
            return self._down(NATIVE)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count: `{"input_tokens": n}`."""
        return await self._count(request, MESSAGES, messages_count, lambda n: {"input_tokens": n})

    async def input_tokens(self, request: web.Request) -> web.Response:
        """Responses' count: `{"object": "response.input_tokens", "input_tokens": n}`."""
        return await self._count(
            request,
            RESPONSES,
            responses_count,
            lambda n: {"object": "response.input_tokens", "input_tokens": n},
        )

    async def _count(
        self,
        request: web.Request,
        dialect: Dialect,
        to_chat: Callable[[Any, int], dict[str, Any]],
        answer: Callable[[int], dict[str, Any]],
    ) -> web.Response:
        """The prompt of the chat the gateway would send for this body, as llama-server
        tokenizes it after the template: the count the grant is held to."""
        who = await self._admitted(request, dialect)
        if isinstance(who, web.Response):
            return who
        raw = await self._body(request, dialect)
        if isinstance(raw, web.Response):
            return raw
        gateway = self.gateway
        try:
            chat = to_chat(_json(raw), UTILITY_BODY_BYTES)
        except Bad as bad:
            return gateway._bad_request(dialect, bad.param, bad.message)
        try:
            prompt = await gateway._apply_template(chat)
            tokens = await gateway._tokenize(prompt, add_special=True)
        except BadUpstreamRequest as err:  # llama-server refused the chat itself
            return gateway._reply(dialect.upstream_error(err.status, err.payload))
        except UpstreamDown:
            return self._down(dialect)
        return web.json_response(answer(len(tokens)))

    def _her(self, mind: str) -> tuple[int | None, int | None]:
        """Her slot and grant tokens, where she holds a grant."""
        table = self.gateway.table
        entry = table.entry(mind) if table is not None else None
        if entry is None or entry.state is not GrantState.GRANTED:
            return None, None
        return entry.slot, entry.tokens

    async def _get(self, path: str) -> Any:
        gateway = self.gateway
        async with gateway.session.get(f"{gateway.settings.upstream}{path}") as resp:
            return await resp.json(content_type=None)

    async def props(self, request: web.Request) -> web.Response:
        who = await self._admitted(request, NATIVE)
        if isinstance(who, web.Response):
            return who
        slot, tokens = self._her(who)
        try:
            props = await self._get("/props")
        except (aiohttp.ClientError, ValueError):
            return self._down(NATIVE)
        return web.json_response(her_props(props, tokens, slot))

    async def slots(self, request: web.Request) -> web.Response:
        who = await self._admitted(request, NATIVE)
        if isinstance(who, web.Response):
            return who
        slot, _ = self._her(who)
        try:
            slots = await self._get("/slots")
        except (aiohttp.ClientError, ValueError):
            return self._down(NATIVE)
        hers = slot is not None and self.gateway.slot_owner.get(slot) in (None, who)
        return web.json_response(her_slots(slots, slot, hers))

    async def refused(self, request: web.Request) -> web.Response:
        return self._refuse(not_served(request.method, request.path), shape_for(request.path))


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise Bad("", "the body is not JSON") from None
