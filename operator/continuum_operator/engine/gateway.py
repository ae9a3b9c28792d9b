"""The grant gateway: llama-server's slots served only to minds holding a `Granted` grant.

Implements docs/gateway.md in front of one `llama-server`: turns open only on a `Granted`
grant; each request is pinned to the mind's slot (`id_slot`) with `n_predict` capped so that
prompt and generation fit in the grant; a reclaim refuses her new requests, cuts the ones in
flight (closing the upstream connection, which makes llama-server drop the task), erases the
slot and records the release, which the runtime reports in the Engine's `status.runtime`
(docs/design.md: the gateway, not the mind, reports the slot released). A slot that held another
mind's context is erased before a new holder's first request, so nothing leaks between minds.

Every decision comes from `engine.admission` (pure); this module does the I/O. The grant table
is pushed in by a source (`engine.grants_source`) through `set_table`; the gateway never grants
on its own. `engine.runtime` runs it beside llama-server; tests and `bench/gateway.py` run it
in front of any llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from continuum_operator.core.grants import GrantReason
from continuum_operator.engine.admission import (
    Admission,
    Answer,
    Cut,
    GrantTable,
    OverGrant,
    Refusal,
    Release,
    TokenCap,
    admit_request,
    admit_turn,
    check_identity,
    prompt_token_bound,
    reconcile,
    still_reported,
    token_cap,
)
from continuum_operator.engine.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER
from continuum_operator.model.mind import GrantState

__all__ = ["Gateway", "GatewaySettings", "SlotRelease"]

log = logging.getLogger(__name__)

#: Cut turns remembered to answer their late requests with `turn_cut` (oldest forgotten first).
CUT_TURNS_KEPT = 1024


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """How the gateway talks to llama-server and answers minds."""

    #: llama-server's base URL, e.g. http://127.0.0.1:8081.
    upstream: str
    #: Seconds a reclaim has when its grant entry names no deadline (the allocator's default).
    grace_seconds: float = 30.0
    #: Seconds between tries to erase a slot llama-server did not erase (busy, restarting).
    erase_retry_seconds: float = 0.25
    #: Retry-After (whole seconds) for a queued mind, and while the engine relaunches.
    queued_retry_after: int = 2
    relaunch_retry_after: int = 5
    #: Seconds between probes of llama-server's /health.
    health_seconds: float = 1.0
    #: Reviews a bearer token: the namespace of the service account it belongs to, or None.
    #: None here: the X-Continuum-Mind header is trusted (docs/gateway.md, "Who is asking").
    review_token: Callable[[str], Awaitable[str | None]] | None = None


@dataclass(frozen=True, slots=True)
class SlotRelease:
    """A reclaimed slot the gateway cut, erased and reports released."""

    mind: str
    slot: int
    reason: str
    grant_since: str | None
    at: float
    erased_tokens: int

    def to_status(self) -> dict[str, Any]:
        return {
            "mind": self.mind,
            "slot": self.slot,
            "reason": self.reason,
            "grantSince": self.grant_since,
            "at": _iso(self.at),
            "erasedTokens": self.erased_tokens,
        }


def _iso(t: float) -> str:
    return (
        dt.datetime.fromtimestamp(t, dt.UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


@dataclass(eq=False, slots=True)
class _Flight:
    """A request on its way through llama-server; `cut` ends it."""

    mind: str
    slot: int
    cut: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    by: str | None = None

    def end(self, reason: str, by: str | None) -> None:
        if not self.cut.is_set():
            self.reason, self.by = reason, by
            self.cut.set()


@dataclass(frozen=True, slots=True)
class _Turn:
    mind: str
    slot: int
    opened: float


class _UpstreamDown(Exception):
    """llama-server did not answer (restarting, crashed)."""


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        *,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or EngineMetrics()
        self.clock = clock
        self.table: GrantTable | None = None
        self.engine_ready = False
        # The context of each llama-server slot, where known (the runtime reads /slots).
        # llama-server caps it at the model's training context, so it can be less than a
        # grant's tokens: requests are capped at the smaller of the two.
        self.slot_ctx: int | None = None
        self.turns: dict[str, _Turn] = {}
        self.flights: dict[str, set[_Flight]] = {}
        # The mind whose context a slot may still hold (not erased since she used it).
        self.slot_owner: dict[int, str] = {}
        self.released: dict[tuple[str, int, str | None], SlotRelease] = {}
        self._releasing: dict[tuple[str, int, str | None], asyncio.Task[None]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task[None] | None = None
        self._slot_locks: dict[int, asyncio.Lock] = {}
        self._flights_done = asyncio.Condition()
        # Turns cut lately (id -> mind, reason, by), to answer their late requests plainly.
        self._cut_turns: dict[str, tuple[str, str, str | None]] = {}

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
            connector=aiohttp.TCPConnector(limit=0),
        )
        await self.probe()
        self._health = asyncio.create_task(self._watch_health())

    async def close(self) -> None:
        tasks = [t for t in (self._health, *self._releasing.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def app(self) -> web.Application:
        """The gateway's routes. Serve them with `handler_cancellation=True` (aiohttp's
        `AppRunner` option), so that a mind hanging up cancels her request in llama-server."""
        app = web.Application()
        app.router.add_post("/v1/turns", self.open_turn)
        app.router.add_delete("/v1/turns/{turn}", self.end_turn)
        app.router.add_post("/completion", self.completion)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/health", self.readyz)  # llama-server's name, for probes
        app.router.add_get("/metrics", self.metrics_endpoint)
        app.router.add_get("/v1/releases", self.releases_endpoint)
        return app

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever the releases to report change (the runtime's status)."""
        self._listeners.append(listener)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Gateway.start() first"
        return self._session

    # --- the grant table ----------------------------------------------------------------------

    def set_table(self, table: GrantTable) -> None:
        """Take a new grant table and act on it at once: cut, erase, release."""
        self.table = table
        self._reconcile()
        kept = still_reported(table, self.released)
        if kept != set(self.released):
            self.released = {k: v for k, v in self.released.items() if k in kept}
            self._changed()

    def _serving(self) -> dict[str, int]:
        serving = {t.mind: t.slot for t in self.turns.values()}
        for mind, flights in self.flights.items():
            for f in flights:
                serving.setdefault(mind, f.slot)
        return serving

    def _reconcile(self) -> None:
        if self.table is None:
            return
        done = set(self.released) | set(self._releasing)
        plan = reconcile(self.table, self._serving(), done)
        for cut in plan.cuts:
            self._cut(cut)
        for rel in plan.releases:
            self._releasing[rel.key] = asyncio.create_task(self._release(rel))

    def _cut(self, cut: Cut) -> None:
        turns = [t for t, turn in self.turns.items() if turn.mind == cut.mind]
        flights = [f for f in self.flights.get(cut.mind, ()) if not f.cut.is_set()]
        if not turns and not flights:
            return  # already cut; her requests are on their way out
        for tid in turns:
            del self.turns[tid]
            self._cut_turns[tid] = (cut.mind, cut.reason, cut.by)
            while len(self._cut_turns) > CUT_TURNS_KEPT:
                del self._cut_turns[next(iter(self._cut_turns))]
        for f in flights:
            f.end(cut.reason, cut.by)
        self.metrics.turn_cut(cut.reason)
        log.info("cut the turn of %s (%s)", cut.mind, cut.reason)

    async def _release(self, rel: Release) -> None:
        deadline = (
            rel.deadline
            if rel.deadline is not None
            else (self.clock() + self.settings.grace_seconds)
        )
        try:
            # Her requests were cut; they end as soon as llama-server lets go of them.
            try:
                async with asyncio.timeout(max(0.0, deadline - self.clock())):
                    async with self._flights_done:
                        await self._flights_done.wait_for(lambda: not self.flights.get(rel.mind))
            except TimeoutError:
                log.warning("%s's requests outlived the reclaim's deadline", rel.mind)
                return
            while True:
                if not self._still_reclaiming(rel):
                    return  # the operator moved on (forced at the deadline): nothing to report
                try:
                    erased = await self._erase(rel.slot)
                    break
                except _UpstreamDown as err:
                    if self.clock() >= deadline:
                        log.warning(
                            "slot %d of %s not erased by its deadline (%s); it is erased before "
                            "its next holder's first request",
                            rel.slot,
                            rel.mind,
                            err,
                        )
                        return
                    await asyncio.sleep(self.settings.erase_retry_seconds)
            record = SlotRelease(rel.mind, rel.slot, rel.reason, rel.since, self.clock(), erased)
            self.released[rel.key] = record
            self.metrics.slot_released(rel.reason)
            log.info("released slot %d of %s (%s)", rel.slot, rel.mind, rel.reason)
            self._changed()
        finally:
            self._releasing.pop(rel.key, None)

    def _still_reclaiming(self, rel: Release) -> bool:
        e = self.table.entry(rel.mind) if self.table is not None else None
        return (
            e is not None
            and e.state is GrantState.RECLAIMING
            and e.slot == rel.slot
            and e.since == rel.since
        )

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

    def releases(self) -> list[SlotRelease]:
        return sorted(self.released.values(), key=lambda r: (r.at, r.mind))

    # --- llama-server -------------------------------------------------------------------------

    def engine_restarted(self) -> None:
        """llama-server started afresh: every slot is empty and every turn on it is over."""
        self.slot_owner.clear()
        for mind in list(self._serving()):
            self._cut(Cut(mind, GrantReason.ENGINE_RELAUNCHING.value))

    async def probe(self) -> None:
        try:
            async with self.session.get(
                f"{self.settings.upstream}/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as resp:
                ready = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ready = False
        if ready != self.engine_ready:
            log.info("llama-server %s", "ready" if ready else "not ready")
        self.engine_ready = ready
        self.metrics.engine_ready(ready)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.settings.health_seconds)
            await self.probe()

    async def _erase(self, slot: int) -> int:
        """Erase a slot's cache; the tokens it held. Serialised per slot."""
        lock = self._slot_locks.setdefault(slot, asyncio.Lock())
        async with lock:
            try:
                async with self.session.post(
                    f"{self.settings.upstream}/slots/{slot}?action=erase"
                ) as resp:
                    payload = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise _UpstreamDown(f"erase answered {resp.status}: {payload}")
            except (aiohttp.ClientError, TimeoutError, ValueError) as err:
                raise _UpstreamDown(str(err)) from err
            self.slot_owner.pop(slot, None)
            return int(payload.get("n_erased", 0)) if isinstance(payload, dict) else 0

    async def _ensure_clean(self, slot: int, mind: str) -> None:
        """Erase a slot that may still hold another mind's context, then mark it hers."""
        owner = self.slot_owner.get(slot)
        if owner is not None and owner != mind:
            await self._erase(slot)
        self.slot_owner[slot] = mind

    async def _count_tokens(self, prompt: Any) -> int:
        if isinstance(prompt, str):
            return len(await self._tokenize(prompt, add_special=True))
        total = 1  # the BOS a list prompt is given
        for piece in prompt:
            total += 1 if isinstance(piece, int) else len(await self._tokenize(piece, False))
        return total

    async def _tokenize(self, text: str, add_special: bool) -> list[Any]:
        try:
            async with self.session.post(
                f"{self.settings.upstream}/tokenize",
                json={"content": text, "add_special": add_special},
            ) as resp:
                payload = await resp.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as err:
            raise _UpstreamDown(str(err)) from err
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if resp.status != 200 or not isinstance(tokens, list):
            raise _UpstreamDown(f"tokenize answered {resp.status}: {payload}")
        return tokens

    # --- answers ------------------------------------------------------------------------------

    def _answer(self, adm: Admission) -> web.Response:
        assert adm.refusal is not None
        self.metrics.refused(adm.refusal)
        headers = {"Retry-After": str(adm.retry_after)} if adm.retry_after else None
        return web.json_response(adm.body, status=adm.status, headers=headers)

    def _refuse(self, refusal: Refusal, status: int, body: dict[str, Any]) -> web.Response:
        self.metrics.refused(refusal)
        return web.json_response({"error": refusal.value, **body}, status=status)

    def _cut_body(self, flight: _Flight) -> dict[str, Any]:
        return {"error": Refusal.TURN_CUT.value, "reason": flight.reason, "by": flight.by}

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

    async def _identity(self, request: web.Request, mind: str) -> web.Response | None:
        """A refusal if the request may not speak for `mind`; None if it may."""
        review = self.settings.review_token
        if review is None:
            return None
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        namespace = await review(token) if scheme.lower() == "bearer" and token else None
        refusal = check_identity(mind, namespace)
        return self._answer(refusal) if refusal is not None else None

    async def open_turn(self, request: web.Request) -> web.Response:
        mind = request.headers.get(MIND_HEADER, "")
        if (refused := await self._identity(request, mind)) is not None:
            return refused
        asked: int | None = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                return self._refuse(Refusal.BAD_REQUEST, 400, {"message": "body is not JSON"})
            raw = body.get("contextTokens") if isinstance(body, dict) else None
            if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int) or raw < 1):
                return self._refuse(
                    Refusal.BAD_REQUEST, 400, {"message": "contextTokens: a positive integer"}
                )
            asked = raw
        adm = admit_turn(
            self.table,
            mind,
            asked,
            engine_ready=self.engine_ready,
            queued_retry=self.settings.queued_retry_after,
            relaunch_retry=self.settings.relaunch_retry_after,
        )
        if adm.answer is not Answer.ADMIT:
            return self._answer(adm)
        assert adm.slot is not None
        for tid in [t for t, turn in self.turns.items() if turn.mind == mind]:
            del self.turns[tid]  # one turn per mind: a new one ends the old
        tid = "t-" + secrets.token_hex(8)
        self.turns[tid] = _Turn(mind, adm.slot, self.clock())
        return web.json_response({"turn": tid, **adm.body}, status=201)

    async def end_turn(self, request: web.Request) -> web.Response:
        mind = request.headers.get(MIND_HEADER, "")
        turn = self.turns.get(request.match_info["turn"])
        if turn is not None and turn.mind == mind:
            del self.turns[request.match_info["turn"]]
        return web.Response(status=204)

    async def completion(self, request: web.Request) -> web.StreamResponse:
        mind = request.headers.get(MIND_HEADER, "")
        if (refused := await self._identity(request, mind)) is not None:
            return refused
        tid = request.headers.get(TURN_HEADER, "")
        turn = self.turns.get(tid)
        cut_turn = self._cut_turns.get(tid)
        if turn is None and cut_turn is not None and cut_turn[0] == mind:
            # A turn the gateway cut: said so to whoever keeps using it.
            self.metrics.refused(Refusal.TURN_CUT)
            return web.json_response(
                {"error": Refusal.TURN_CUT.value, "reason": cut_turn[1], "by": cut_turn[2]},
                status=409,
            )
        turn_slot = turn.slot if turn is not None and turn.mind == mind else None
        adm = admit_request(self.table, mind, turn_slot, engine_ready=self.engine_ready)
        if adm.answer is not Answer.ADMIT:
            return self._answer(adm)
        assert adm.slot is not None
        # Registered before the first await: a reclaim from here on cuts this request.
        flight = _Flight(mind, adm.slot)
        self.flights.setdefault(mind, set()).add(flight)
        self.metrics.slot_busy(adm.slot, 1)
        started = time.monotonic()
        try:
            tokens = min(adm.tokens, self.slot_ctx) if self.slot_ctx else adm.tokens
            return await self._forward(request, flight, tokens)
        except _UpstreamDown as err:
            log.warning("llama-server failed %s's request: %s", mind, err)
            return self._refuse(
                Refusal.TURN_CUT, 409, {"reason": GrantReason.ENGINE_RELAUNCHING.value}
            )
        finally:
            self.metrics.slot_busy(adm.slot, -1)
            self.metrics.busy_seconds.labels(str(adm.slot)).inc(time.monotonic() - started)
            flights = self.flights.get(mind)
            if flights is not None:
                flights.discard(flight)
                if not flights:
                    del self.flights[mind]
            async with self._flights_done:
                self._flights_done.notify_all()

    async def _forward(
        self, request: web.Request, flight: _Flight, grant_tokens: int
    ) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return self._refuse(Refusal.BAD_REQUEST, 400, {"message": "body is not JSON"})
        if not isinstance(body, dict):
            return self._refuse(Refusal.BAD_REQUEST, 400, {"message": "body is not an object"})
        prompt = body.get("prompt")
        bound = prompt_token_bound(prompt)
        if bound is None:
            return self._refuse(
                Refusal.BAD_REQUEST,
                400,
                {"message": "prompt: one prompt (a string, or a list of tokens and strings)"},
            )
        raw = body.get("n_predict")
        if raw is not None and (isinstance(raw, bool) or not isinstance(raw, int)):
            return self._refuse(Refusal.BAD_REQUEST, 400, {"message": "n_predict: an integer"})
        asked: int | None = raw
        cap: TokenCap | OverGrant
        if asked is not None and asked >= 0 and bound + asked <= grant_tokens:
            cap = TokenCap(asked, asked, capped=False)  # fits however it tokenizes
        else:
            cap = token_cap(grant_tokens, await self._count_tokens(prompt), asked)
        if isinstance(cap, OverGrant):
            self.metrics.refused(Refusal.OVER_GRANT)
            return web.json_response(cap.body(), status=413)
        body["id_slot"] = flight.slot
        body["n_predict"] = cap.n_predict
        async with self._slot_locks.setdefault(flight.slot, asyncio.Lock()):
            pass  # an erase of this slot in progress finishes first
        await self._ensure_clean(flight.slot, flight.mind)
        if flight.cut.is_set():
            return self._cut_answer(flight)
        self.metrics.forwarded(flight.slot, capped=cap.capped)
        note = {
            "slot": flight.slot,
            "grantTokens": grant_tokens,
            "nPredict": cap.n_predict,
            "nPredictAsked": cap.asked,
            "capped": cap.capped,
        }
        if body.get("stream"):
            return await self._stream(request, body, flight, cap, note)
        return await self._plain(body, flight, cap, note)

    def _cut_answer(self, flight: _Flight) -> web.Response:
        self.metrics.refused(Refusal.TURN_CUT)
        return web.json_response(self._cut_body(flight), status=409)

    async def _plain(
        self, body: dict[str, Any], flight: _Flight, cap: TokenCap, note: dict[str, Any]
    ) -> web.Response:
        async def call() -> tuple[int, Any]:
            try:
                async with self.session.post(
                    f"{self.settings.upstream}/completion", json=body
                ) as resp:
                    return resp.status, await resp.json(content_type=None)
            except (aiohttp.ClientError, ValueError) as err:
                raise _UpstreamDown(str(err)) from err

        reply = asyncio.ensure_future(call())
        cut = asyncio.ensure_future(flight.cut.wait())
        try:
            await asyncio.wait({reply, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reply, cut):
                task.cancel()
            await asyncio.gather(reply, cut, return_exceptions=True)
        if not reply.done() or reply.cancelled() or flight.cut.is_set():
            # Cancelling the call closed its connection: llama-server drops the task.
            return self._cut_answer(flight)
        status, payload = reply.result()
        if isinstance(payload, dict) and status == 200:
            predicted = int(payload.get("tokens_predicted") or 0)
            self.metrics.slot_served(
                flight.slot, 0.0, int(payload.get("tokens_evaluated") or 0), predicted
            )
            payload["continuum"] = _annotate(note, cap, payload)
        return web.json_response(payload, status=status)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        flight: _Flight,
        cap: TokenCap,
        note: dict[str, Any],
    ) -> web.StreamResponse:
        try:
            upstream = await self.session.post(f"{self.settings.upstream}/completion", json=body)
        except aiohttp.ClientError as err:
            raise _UpstreamDown(str(err)) from err
        try:
            if upstream.status != 200:
                payload = await upstream.json(content_type=None)
                return web.json_response(payload, status=upstream.status)
            out = web.StreamResponse(
                status=200,
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
            await out.prepare(request)

            async def pump() -> None:
                async for line in upstream.content:
                    if line.startswith(b"data: ") and b'"stop":true' in line.replace(b" ", b""):
                        line, final = _annotate_event(line, note, cap)
                        self.metrics.slot_served(
                            flight.slot,
                            0.0,
                            int(final.get("tokens_evaluated") or 0),
                            int(final.get("tokens_predicted") or 0),
                        )
                    await out.write(line)

            pumping = asyncio.ensure_future(pump())
            cut = asyncio.ensure_future(flight.cut.wait())
            try:
                await asyncio.wait({pumping, cut}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (pumping, cut):
                    task.cancel()
                await asyncio.gather(pumping, cut, return_exceptions=True)
            if flight.cut.is_set():
                upstream.close()  # llama-server sees the stream closed and drops the task
                self.metrics.refused(Refusal.TURN_CUT)
                event = {"error": {"type": Refusal.TURN_CUT.value, "reason": flight.reason}}
                with contextlib.suppress(ConnectionError):
                    await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            elif (failure := pumping.exception()) is not None:
                if isinstance(failure, aiohttp.ClientError):
                    raise _UpstreamDown(str(failure)) from failure
                if not isinstance(failure, ConnectionError):
                    raise failure
            with contextlib.suppress(ConnectionError):
                await out.write_eof()
            return out
        finally:
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()  # a stream left unfinished: llama-server drops the task


def _annotate(note: dict[str, Any], cap: TokenCap, final: dict[str, Any]) -> dict[str, Any]:
    """The gateway's note on a finished completion: a cut-off at the grant is said plainly."""
    predicted = int(final.get("tokens_predicted") or 0)
    hit_cap = final.get("stop_type") == "limit" and predicted >= cap.n_predict
    out = dict(note)
    if hit_cap and (cap.capped or cap.asked is None or cap.asked < 0):
        out["cutOff"] = "GrantTokens"
        out["message"] = (
            f"generation stopped at {predicted} tokens: prompt and generation fill the grant "
            f"of {note['grantTokens']} tokens"
        )
    return out


def _annotate_event(
    line: bytes, note: dict[str, Any], cap: TokenCap
) -> tuple[bytes, dict[str, Any]]:
    """The last event of a stream, with the gateway's note; and the event itself."""
    try:
        event = json.loads(line[len(b"data: ") :])
    except ValueError:
        return line, {}
    if not isinstance(event, dict):
        return line, {}
    event["continuum"] = _annotate(note, cap, event)
    return b"data: " + json.dumps(event).encode() + b"\n", event
