"""The gateway's request path: one path for every API (`_serve`: read, admit, `_checked`,
count, cap, pin, forward), each step said in the words of the dialect she spoke
(`engine.dialects`); every wait on llama-server raced against the cut (`_until_cut`); her
answer or its stream passed back with the gateway's note (`_annotate`), cut at a reclaim.
Neighbours: `engine.gateway_cuts` (below it: the slot's erase, the park's restore),
`engine.gateway` (the routes that call `door`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from continuum_operator.core.grants import GrantReason
from continuum_operator.door.body_limits import (
    BodyRefused,
)
from continuum_operator.engine.admission import (
    Admission,
    Answer,
    OverGrant,
    Refusal,
    TokenCap,
    admit_request,
    prompt_token_bound,
    token_cap,
)
from continuum_operator.engine.dialects import (
    Annotate,
    Bad,
    Counting,
    Dialect,
    Forward,
    Shaper,
)
from continuum_operator.engine.gateway_cuts import GatewayCuts
from continuum_operator.engine.gateway_state import (
    EXCEEDS_CONTEXT,
    STREAM_LINE_BYTES,
    Handler,
    _CutNow,
    _Flight,
)
from continuum_operator.engine.openai_api import prompt_bound
from continuum_operator.engine.request_cost import (
    costly_fields,
    request_cost_error,
)
from continuum_operator.engine.turn import TURN_HEADER
from continuum_operator.engine.upstream import BadUpstreamRequest, UpstreamDown
from continuum_operator.engine.watchdog import cut_message

__all__ = ["GatewayRequests"]

log = logging.getLogger(__name__)


class GatewayRequests(GatewayCuts):
    async def _count_tokens(self, flight: _Flight, content: Any) -> int:
        """The prompt's tokens as llama-server counts them: one `/tokenize` of the whole prompt
        (a string, or a list of token ids and strings, which it tokenizes as the completion
        will), raced against the cut, whatever the number of pieces."""
        tokens = await self._until_cut(flight, self._tokenize(content, add_special=True))
        return len(tokens)

    async def _post_json(self, path: str, body: Any) -> tuple[int, Any]:
        """POST `body` to llama-server's `path`: the status and the JSON it answered. Not
        reached, or an answer that is not JSON: `UpstreamDown`."""
        try:
            async with self.session.post(f"{self.settings.upstream}{path}", json=body) as resp:
                return resp.status, await resp.json(content_type=None)
        except (aiohttp.ClientError, ValueError) as err:
            raise UpstreamDown(str(err)) from err

    async def _tokenize(self, content: Any, add_special: bool) -> list[Any]:
        status, payload = await self._post_json(
            "/tokenize", {"content": content, "add_special": add_special}
        )
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if status != 200 or not isinstance(tokens, list):
            raise UpstreamDown(f"tokenize answered {status}: {payload}")
        return tokens

    async def _apply_template(self, body: dict[str, Any]) -> str:
        """The chat request's prompt after the model's chat template (llama-server's own)."""
        status, payload = await self._post_json("/apply-template", body)
        prompt = payload.get("prompt") if isinstance(payload, dict) else None
        if status != 200 or not isinstance(prompt, str):
            raise BadUpstreamRequest(status, payload)
        return prompt

    async def _until_cut(self, flight: _Flight, work: Coroutine[Any, Any, _T]) -> _T:
        """`work`, unless the flight is cut first: then `_CutNow`, and `work` is cancelled.

        Every wait of a request on llama-server goes through here (tokenize, template, the
        slot's erase, a stream's headers and lines), so a reclaim never waits on one. `work`
        runs in the request's own task, which the cut cancels while it waits (`_Flight.end`)
        and takes the cancel back from, as `asyncio.timeout` does: no task per wait, which
        cost a request a third of its Python calls. Her hanging up cancels the same task:
        that cancel is counted apart (`Task.cancelling`) and never taken for the cut.
        """
        if flight.cut.is_set():
            work.close()  # never started: nothing sent to llama-server
            raise _CutNow
        task = asyncio.current_task()
        assert task is not None and flight.waiting is None, "one wait at a time, in a task"
        cancels = task.cancelling()  # hers or the server's already, if any
        flight.waiting = task
        try:
            result = await work
        except (Exception, asyncio.CancelledError) as err:
            hers = flight.let_go(task) > cancels  # a cancel besides the cut's, if any
            if isinstance(err, asyncio.CancelledError) and hers:
                raise  # she hung up (or the server stops): not a cut
            if flight.cut.is_set():
                raise _CutNow from None
            raise
        flight.let_go(task)
        if flight.cut.is_set():
            if isinstance(result, aiohttp.ClientResponse):
                result.close()  # a stream opened as the cut came: llama-server drops it
            raise _CutNow
        return result

    def door(self, dialect: Dialect) -> Handler:
        """The handler of a generating route spoken in `dialect`."""

        async def serve(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, dialect)

        return serve

    def _admit(self, mind: str, tid: str) -> Admission:
        """Whether this request runs: inside her open turn, or as a turn of one request."""
        if self.park is not None:
            self.park.back(mind)  # she asks again: no longer parked idle
        if not tid:
            # No turn named: a turn of this one request, answered as opening a turn would be.
            # Her explicit turn, if any, is left as it is.
            adm = self._admit_turn(mind, None)
            if adm.answer is Answer.ADMIT:
                return Admission(Answer.ADMIT, 200, {}, slot=adm.slot, tokens=adm.tokens)
            return adm
        turn = self.turns.get(tid)
        cut_turn = self._cut_turns.get(tid)
        if turn is None and cut_turn is not None and cut_turn[0] == mind:
            # A turn the gateway cut: said so to whoever keeps using it.
            return Admission(
                Answer.REFUSE,
                409,
                {"error": Refusal.TURN_CUT.value, "reason": cut_turn[1], "by": cut_turn[2]},
                Refusal.TURN_CUT,
            )
        turn_slot = turn.slot if turn is not None and turn.mind == mind else None
        return admit_request(self.table, mind, turn_slot, engine_ready=self.engine_ready)

    def _checked(self, dialect: Dialect, body: Any, tokens: int) -> Forward:
        """The body as it goes to llama-server, once every check of its dialect passed: the
        one place a body is judged before it costs the engine anything (`Bad` if refused)."""
        dialect.check(body, tokens)
        if dialect.any_slot and self.slot_count != 1:
            raise Bad(
                "input",
                f"this engine runs {self.slot_count or 'several'} slots, and llama-server "
                "places an embedding on any idle slot, not hers (it would overwrite another "
                "mind's context): embed on an EmbedLane, or an engine of one slot",
            )
        fwd = dialect.forward(body)
        # What it may cost the shared loop, judged on what llama-server would be sent: a
        # Messages or Responses body is bounded as the chat it becomes.
        if (costly := request_cost_error(fwd.body, self.settings.cost_bounds)) is not None:
            raise Bad(costly.param, costly.message)
        return fwd

    async def _serve(self, request: web.Request, dialect: Dialect) -> web.StreamResponse:
        mind, refused = await self._who(request)
        if refused is not None:
            return self._answer(refused, dialect)
        # No body is read for whom the gateway cannot serve, and each under its limits.
        early = self._admit(mind, request.headers.get(TURN_HEADER, ""))
        if early.answer is not Answer.ADMIT:
            return self._answer(early, dialect)
        body = await self.bodies.read_json(request)
        if isinstance(body, BodyRefused):
            return self._body_refused(body, dialect)
        # Admitted again: the table may have changed while the body was read (an await), and
        # from this admission to the flight's registration nothing awaits.
        adm = self._admit(mind, request.headers.get(TURN_HEADER, ""))
        if adm.answer is not Answer.ADMIT:
            return self._answer(adm, dialect)
        assert adm.slot is not None
        tokens = min(adm.tokens, self.slot_ctx) if self.slot_ctx else adm.tokens
        try:
            fwd = self._checked(dialect, body, tokens)
        except Bad as bad:
            return self._bad_request(dialect, bad.param, bad.message)
        # Registered with no await since the admission: a reclaim from here on cuts it.
        flight = _Flight(mind, adm.slot, tokens)
        self.flights.setdefault(mind, set()).add(flight)
        self.watchdog.watch(flight, costly_fields(fwd.body))  # cut if its sampling stalls the loop
        self.metrics.slot_busy(adm.slot, 1)
        started = time.monotonic()
        try:
            return await self._forward(request, fwd, dialect, flight, tokens)
        except _CutNow:
            return self._cut_answer(flight, dialect)
        except BadUpstreamRequest as err:
            return self._reply(dialect.upstream_error(err.status, err.payload))
        except UpstreamDown as err:
            log.warning("llama-server failed %s's request: %s", mind, err)
            return self._refuse(
                Refusal.TURN_CUT, 409, {"reason": GrantReason.ENGINE_RELAUNCHING.value}, dialect
            )
        finally:
            self.metrics.slot_busy_for(adm.slot, time.monotonic() - started)
            await self._land(flight)

    async def _land(self, flight: _Flight) -> None:
        """The flight has left llama-server: the slot's release may go ahead. Idempotent."""
        flights = self.flights.get(flight.mind)
        if flights is None or flight not in flights:
            return
        self.watchdog.forget(flight)
        self.metrics.slot_busy(flight.slot, -1)
        flights.discard(flight)
        if flights:
            return  # her release, if any, waits for her last flight
        del self.flights[flight.mind]
        if self._releasing:  # a release may wait for this (none waits outside `_releasing`)
            async with self._flights_done:
                self._flights_done.notify_all()

    async def _prompt_cap(
        self, fwd: Forward, flight: _Flight, grant_tokens: int
    ) -> TokenCap | OverGrant:
        """The generation cap that keeps prompt and output in the grant, counting the prompt
        without llama-server where its size bounds it, else with one `/tokenize`."""
        body, asked = fwd.body, fwd.asked
        if fwd.counting is Counting.CHAT and self._slot_is_grant(grant_tokens):
            # llama-server refuses a prompt that fills her slot and ends a generation where
            # the slot is full: her grant is held without the template's round trip.
            return TokenCap(-1 if asked is None else asked, asked, capped=False)
        if fwd.counting is Counting.CHAT:
            templated: str = await self._until_cut(flight, self._apply_template(body))
            content: Any = templated
            bound = prompt_bound(templated)
        else:
            name = "input" if fwd.counting is Counting.EMBED else "prompt"
            content = body.get(name)
            listed = isinstance(content, list) and len(content) == 1
            if fwd.counting is not Counting.NATIVE and listed:
                content = content[0]  # one prompt, listed
            bound = prompt_token_bound(content) or 0
        if asked is not None and asked >= 0 and bound + asked <= grant_tokens:
            return TokenCap(asked, asked, capped=False)  # fits however it tokenizes
        counted = await self._count_tokens(flight, content)
        if fwd.counting is Counting.EMBED:
            if counted > grant_tokens:
                return OverGrant(counted, grant_tokens)
            return TokenCap(0, 0, capped=False)
        return token_cap(grant_tokens, counted, asked)

    def _slot_is_grant(self, grant_tokens: int) -> bool:
        """Whether llama-server's own bound of her slot is her grant: the slot holds no more
        than the grant (the runtime read its size) and a full slot ends the generation."""
        ctx = self.slot_ctx
        return ctx is not None and grant_tokens >= ctx and not self.settings.context_shift

    async def _forward(
        self,
        request: web.Request,
        fwd: Forward,
        dialect: Dialect,
        flight: _Flight,
        grant_tokens: int,
    ) -> web.StreamResponse:
        cap = await self._prompt_cap(fwd, flight, grant_tokens)
        if isinstance(cap, OverGrant):
            self.metrics.refused(Refusal.OVER_GRANT)
            return self._reply(dialect.over_grant(cap))
        body = dialect.pin(fwd, flight.slot, cap.n_predict)
        lock = self._slot_locks.setdefault(flight.slot, asyncio.Lock())
        await self._until_cut(flight, _passed(lock))  # an erase of this slot finishes first
        resumed = await self._until_cut(flight, self._ensure_clean(flight.slot, flight.mind))
        if flight.cut.is_set():
            raise _CutNow
        self.metrics.forwarded(flight.slot, capped=cap.capped)
        self.slot_tokens[flight.slot] = grant_tokens  # at most, until her reply says
        note: dict[str, Any] = {
            "slot": flight.slot,
            "grantTokens": grant_tokens,
            "nPredict": cap.n_predict,
            "nPredictAsked": cap.asked,
            "capped": cap.capped,
        }
        if resumed is not None:
            note["resumed"] = {"restoredTokens": resumed.tokens}

        def annotate(final: dict[str, Any]) -> dict[str, Any]:
            return _annotate(note, cap, final)

        if body.get("stream"):
            shaper = dialect.shaper(annotate)
            return await self._stream(request, fwd.path, body, flight, shaper, dialect)
        return await self._plain(fwd.path, body, flight, dialect, annotate)

    def _upstream_refused(
        self, dialect: Dialect, flight: _Flight, status: int, payload: Any
    ) -> web.Response:
        """llama-server's refusal, in the dialect's words: a prompt that fills her slot is her
        grant's over-grant (where the gateway left the count to llama-server)."""
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict) and error.get("type") == EXCEEDS_CONTEXT:
            self.metrics.refused(Refusal.OVER_GRANT)
            prompt = int(error.get("n_prompt_tokens") or flight.grant)
            return self._reply(dialect.over_grant(OverGrant(prompt, flight.grant)))
        return self._reply(dialect.upstream_error(status, payload))

    def _served(self, flight: _Flight, final: dict[str, Any]) -> None:
        """A reply finished: counted, and the tokens its slot now holds known."""
        prompt, predicted = _usage(final)
        self.metrics.slot_served(flight.slot, 0.0, prompt, predicted)
        if prompt + predicted > 0:
            self.slot_tokens[flight.slot] = prompt + predicted

    def _cut_answer(self, flight: _Flight, dialect: Dialect) -> web.Response:
        body = self._cut_body(flight)
        return self._answer(Admission(Answer.REFUSE, 409, body, Refusal.TURN_CUT), dialect)

    async def _plain(
        self,
        path: str,
        body: dict[str, Any],
        flight: _Flight,
        dialect: Dialect,
        annotate: Annotate,
    ) -> web.Response:
        # Cancelling the call on a cut closes its connection: llama-server drops the task.
        status, payload = await self._until_cut(flight, self._post_json(path, body))
        if status != 200:
            return self._upstream_refused(dialect, flight, status, payload)
        if isinstance(payload, dict):
            self._served(flight, payload)
        return web.json_response(dialect.answer(payload, annotate))

    async def _stream(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        flight: _Flight,
        shaper: Shaper,
        dialect: Dialect,
    ) -> web.StreamResponse:
        async def connect() -> aiohttp.ClientResponse:
            try:
                return await self.session.post(f"{self.settings.upstream}{path}", json=body)
            except aiohttp.ClientError as err:
                raise UpstreamDown(str(err)) from err

        # llama-server sends a stream's headers with its first token, after the whole prompt
        # is read: that wait is raced against the cut like every other.
        upstream = await self._until_cut(flight, connect())
        try:
            if upstream.status != 200:
                payload = await self._until_cut(flight, upstream.json(content_type=None))
                return self._upstream_refused(dialect, flight, upstream.status, payload)
            out = web.StreamResponse(
                status=200,
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            )
            await out.prepare(request)

            async def pump() -> None:
                content = upstream.content
                while line := await content.readuntil(b"\n", max_size=STREAM_LINE_BYTES):
                    said, final = shaper.feed(line)
                    if final is not None:
                        self._served(flight, final)
                    if said:
                        await out.write(said)
                if said := shaper.end():
                    await out.write(said)

            last = b""  # the stream's last words, if the gateway ends it
            try:
                await self._until_cut(flight, pump())
            except _CutNow:
                upstream.close()  # llama-server sees the stream closed and drops the task
                await self._land(flight)  # the slot's release need not wait for this client
                self.metrics.refused(Refusal.TURN_CUT)
                last = _cut_event(flight, dialect)
            except aiohttp.ClientError as err:
                raise UpstreamDown(str(err)) from err
            except LineTooLong:
                # Said, not cut off: her client would read a stream that stops without an end.
                log.warning("%s's stream: an event of llama-server's longer than %d bytes",
                            flight.mind, STREAM_LINE_BYTES)  # fmt: skip
                last = _too_long_event(dialect)
            except ConnectionError:
                pass  # the mind hung up
            with contextlib.suppress(ConnectionError, TimeoutError):
                async with asyncio.timeout(self.settings.write_seconds):
                    if last:
                        await out.write(last)
                    await out.write_eof()
            return out
        finally:
            if upstream.content.at_eof():
                upstream.release()
            else:
                upstream.close()  # a stream left unfinished: llama-server drops the task


def _too_long_event(dialect: Dialect) -> bytes:
    """The stream's last event when llama-server's own was too long to read."""
    message = (
        f"llama-server sent an event longer than the gateway reads ({STREAM_LINE_BYTES} bytes; "
        "its last event repeats the prompt and settings): the generation's end was not read; "
        "send a shorter prompt, grammar or schema, or do not stream"
    )
    return dialect.stream_error("server_error", message, {"code": 502})


_T = TypeVar("_T")


async def _passed(lock: asyncio.Lock) -> None:
    async with lock:
        pass


def _cut_event(flight: _Flight, dialect: Dialect) -> bytes:
    """The last event of a stream the reclaim or the watchdog ended: says why (the clients
    raise it), and what to change where the watchdog cut it."""
    by = f" by {flight.by}" if flight.by else ""
    message = f"turn cut: the grant is being reclaimed ({flight.reason}{by})"
    extra: dict[str, Any] = {"reason": flight.reason, "by": flight.by}
    if (watchdog := cut_message(flight.reason)) is not None:
        message = extra["message"] = watchdog  # what to change, not a reclaim
    return dialect.stream_error(Refusal.TURN_CUT.value, message, extra)


def _usage(final: dict[str, Any]) -> tuple[int, int]:
    """(prompt tokens, generated tokens) of a finished reply, native or OpenAI."""
    usage = final.get("usage")
    if isinstance(usage, dict):
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    timings = final.get("timings")
    if "tokens_predicted" not in final and isinstance(timings, dict):
        return int(timings.get("prompt_n") or 0), int(timings.get("predicted_n") or 0)
    return int(final.get("tokens_evaluated") or 0), int(final.get("tokens_predicted") or 0)


def _hit_limit(final: dict[str, Any], cap: TokenCap) -> bool:
    """Whether the generation stopped at its length limit (native or OpenAI)."""
    choices = final.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("finish_reason") == "length"
    predicted = int(final.get("tokens_predicted") or 0)
    return final.get("stop_type") == "limit" and predicted >= cap.n_predict


def _annotate(note: dict[str, Any], cap: TokenCap, final: dict[str, Any]) -> dict[str, Any]:
    """The gateway's note on a finished completion: a cut-off at the grant is said plainly."""
    out = dict(note)
    prompt, predicted = _usage(final)
    # Where llama-server held the grant (her slot), the context full says the cut-off.
    filled = prompt + predicted + 1 >= note["grantTokens"]
    if _hit_limit(final, cap) and (cap.capped or cap.asked is None or cap.asked < 0 or filled):
        out["cutOff"] = "GrantTokens"
        out["message"] = (
            f"generation stopped at {predicted or cap.n_predict} tokens: prompt and generation "
            f"fill the grant of {note['grantTokens']} tokens"
        )
    return out
