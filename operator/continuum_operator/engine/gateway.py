"""The grant gateway: llama-server's slots served only to minds holding a `Granted` grant.

Implements docs/gateway.md in front of one `llama-server`: turns open only on a `Granted`
grant; each request is pinned to the mind's slot (`id_slot`) with `n_predict` capped so that
prompt and generation fit in the grant; a reclaim refuses her new requests, cuts the ones in
flight (closing the upstream connection, which makes llama-server drop the task), erases the
slot and records the release, which the runtime reports in the Engine's `status.runtime`
(docs/design.md: the gateway, not the mind, reports the slot released). A slot that held another
mind's context is erased before a new holder's first request, so nothing leaks between minds.

Every decision comes from `engine.admission` (pure); this module does the I/O. Each API it
speaks (llama-server's `/completion`, OpenAI's Chat Completions, Completions, Embeddings and
Responses, Anthropic's Messages) is a dialect (`engine.dialects`): one request path
(`_serve`: read, admit, `_checked`, count, cap, pin, forward) says each step in the words of the
API she spoke. llama-server's other routes are `engine.llama_routes`'. The grant table
is pushed in by a source (`engine.grants_source`) through `set_table`; the gateway never grants
on its own. `engine.runtime` runs it beside llama-server; tests and `bench/gateway.py` run it
in front of any llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from aiohttp import web
from aiohttp.http_exceptions import LineTooLong

from continuum_operator.core import rfc3339
from continuum_operator.core.grants import GrantReason
from continuum_operator.engine.admission import (
    Admission,
    Answer,
    Cut,
    GrantTable,
    OverGrant,
    Refusal,
    Release,
    ReviewUnavailable,
    ServiceAccount,
    TokenCap,
    admit_request,
    admit_turn,
    identify,
    prompt_token_bound,
    reconcile,
    review_unavailable,
    still_reported,
    token_cap,
)
from continuum_operator.engine.body_limits import (
    DEFAULT_CONNECTIONS,
    LINGER_SECONDS,
    BodyLimits,
    BodyReader,
    BodyRefused,
    ConnectionLimits,
    LimitedSite,
)
from continuum_operator.engine.dialects import (
    CHAT,
    DOORS,
    NATIVE,
    Annotate,
    Bad,
    Counting,
    Dialect,
    Forward,
    Reply,
    Shaper,
)
from continuum_operator.engine.llama_routes import LlamaRoutes
from continuum_operator.engine.metrics import CONTENT_TYPE_LATEST, EngineMetrics
from continuum_operator.engine.openai_api import prompt_bound
from continuum_operator.engine.park import NotParked, Parked
from continuum_operator.engine.parking import ParkStore, Resumed
from continuum_operator.engine.request_cost import (
    DEFAULT_BOUNDS,
    CostBounds,
    costly_fields,
    request_cost_error,
)
from continuum_operator.engine.token_review import Caller, caller_of
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER
from continuum_operator.engine.upstream import BadUpstreamRequest, UpstreamDown
from continuum_operator.engine.watchdog import Watchdog, WatchdogSettings, cut_message
from continuum_operator.model.mind import GrantState

__all__ = ["Gateway", "GatewaySettings", "SlotRelease", "admin_application", "serve_app"]

log = logging.getLogger(__name__)

#: Seconds a connection may take to send a whole request head, and stay idle between requests:
#: a client that opens a connection and never finishes its headers is dropped after it
#: (aiohttp's keep-alive timer runs from the connection's start until a request is read).
HEADERS_SECONDS = 10.0

#: llama-server's error type for a prompt its slot cannot hold.
EXCEEDS_CONTEXT = "exceed_context_size_error"

#: The most bytes of a turn's opening body (`{"contextTokens": N}`).
OPEN_TURN_BYTES = 4096

#: Cut turns remembered to answer their late requests with `turn_cut` (oldest forgotten first).
CUT_TURNS_KEPT = 1024

#: The longest line of llama-server's stream read: its last event repeats the prompt and the
#: generation settings (grammar, schema) of a request body of at most 1 MiB, which JSON's
#: escapes may widen six times. aiohttp's own line limit (128 KiB) cut such a stream short.
STREAM_LINE_BYTES = 8 * 2**20


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
    #: Reviews a bearer token: the service account it belongs to, or None. None here: the
    #: X-Continuum-Mind header is believed, which only the unsafe local flag asks for
    #: (docs/gateway.md, "Who is asking").
    review_token: Callable[[str, Caller], Awaitable[ServiceAccount | None]] | None = None
    #: Seconds the gateway waits on a mind's connection to take a stream's last words (the
    #: cut event): a client that stops reading holds nothing of the engine past it.
    write_seconds: float = 2.0
    #: The rate of each mind's requests to the routes that take no slot (tokenize, count
    #: tokens, apply-template, props, slots): per second, and the burst.
    utility_per_second: float = 20.0
    utility_burst: int = 40
    #: llama-server runs with `--context-shift`: a full slot shifts its context out instead of
    #: ending the generation, so the slot no longer bounds what she generates.
    context_shift: bool = False
    #: How a body is read: its time, its size, what all bodies being read may hold.
    body_limits: BodyLimits = field(default_factory=BodyLimits)
    #: What one request's fields may cost the shared loop (engine.request_cost).
    cost_bounds: CostBounds = DEFAULT_BOUNDS
    #: The decode watchdog (engine.watchdog); None: off.
    watchdog: WatchdogSettings | None = field(default_factory=WatchdogSettings)


@dataclass(frozen=True, slots=True)
class SlotRelease:
    """A reclaimed slot the gateway cut, erased and reports released."""

    mind: str
    slot: int
    reason: str
    grant_since: str | None
    at: float
    #: None: llama-server had not erased it by the reclaim's deadline (erased before the next
    #: holder's first request).
    erased_tokens: int | None
    #: Her context parked before the erase (its tokens), or why it was not.
    parked_tokens: int = 0
    not_parked: str | None = None

    def to_status(self) -> dict[str, Any]:
        return {
            "mind": self.mind,
            "slot": self.slot,
            "reason": self.reason,
            "grantSince": self.grant_since,
            "at": rfc3339.format_milli(self.at),
            "erasedTokens": self.erased_tokens,
            "parkedTokens": self.parked_tokens,
            "notParked": self.not_parked,
        }


@dataclass(eq=False, slots=True)
class _Flight:
    """A request on its way through llama-server; `cut` ends it."""

    mind: str
    slot: int
    #: Her grant's tokens (at most the slot's): an over-grant llama-server finds is said as hers.
    grant: int = 0
    cut: asyncio.Event = field(default_factory=asyncio.Event)
    reason: str = ""
    by: str | None = None
    #: What it waits on llama-server for now (`Gateway._until_cut`): cancelled by `end`.
    waits: set[asyncio.Future[Any]] = field(default_factory=set)

    def end(self, reason: str, by: str | None) -> None:
        if not self.cut.is_set():
            self.reason, self.by = reason, by
            self.cut.set()
            for wait in self.waits:
                wait.cancel()


@dataclass(frozen=True, slots=True)
class _Turn:
    mind: str
    slot: int
    opened: float


class Gateway:
    def __init__(
        self,
        settings: GatewaySettings,
        *,
        metrics: EngineMetrics | None = None,
        clock: Callable[[], float] = time.time,
        park: ParkStore | None = None,
    ) -> None:
        self.settings = settings
        # The engine's park store (docs/gateway.md, "A turn cut off"); None: erased, not parked.
        self.park = park
        # The most tokens each slot may hold: her grant while a request runs, what the last
        # finished reply left after it (a park's size is reckoned from it).
        self.slot_tokens: dict[int, int] = {}
        self.metrics = metrics or EngineMetrics()
        self.clock = clock
        self.table: GrantTable | None = None
        self.engine_ready = False
        # The context of each llama-server slot, where known (the runtime reads /slots).
        # llama-server caps it at the model's training context, so it can be less than a
        # grant's tokens: requests are capped at the smaller of the two.
        self.slot_ctx: int | None = None
        # llama-server's slots, read once it is ready: an embedding is served only by an
        # engine of one slot, as llama-server runs embeddings on any idle slot (it does not
        # read id_slot for them), which would overwrite another mind's context.
        self.slot_count: int | None = None
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
        self.bodies = BodyReader(settings.body_limits)
        self.watchdog = Watchdog(
            lambda: self.settings.upstream,
            settings.watchdog or WatchdogSettings(),
            on_cut=self.metrics.turn_cut,
        )
        self._watching: asyncio.Task[None] | None = None

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
            t for t in (self._health, self._watching, *self._releasing.values()) if t is not None
        ]
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

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever the releases to report change (the runtime's status)."""
        self._listeners.append(listener)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Gateway.start() first"
        return self._session

    # --- the grant table ----------------------------------------------------------------------

    def set_table(self, table: GrantTable | None) -> None:
        """Take a new grant table and act on it at once: cut, erase, release. None: the table
        is withdrawn (its ledger deleted): every turn and request is refused until the next,
        and nothing is cut or released meanwhile (the next table decides)."""
        self.table = table
        if table is None:
            self._changed()
            return
        self._reconcile()
        if self.park is not None:
            self.park.forget(table)  # her Mind deleted or her grant refused: her park goes
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
            # Her requests were cut; each lands as soon as the gateway has let go of it. Her
            # context is parked between the cut and the erase where the save can finish
            # before the deadline (the park store's rule).
            parked: Parked | NotParked = NotParked.NO_TIME
            erased: int | None = None
            try:
                async with asyncio.timeout(max(0.0, deadline - self.clock())):
                    async with self._flights_done:
                        await self._flights_done.wait_for(lambda: not self.flights.get(rel.mind))
                    if self._still_reclaiming(rel):
                        parked = await self._park(rel, deadline)
                    erased = await self._erase_while_reclaiming(rel)
            except TimeoutError:
                # llama-server did not save or erase by the deadline (stalled, restarting): the
                # release is recorded on time all the same, parked or not as the save went; the
                # slot stays marked as holding her context, so it is erased before its next
                # holder's first request.
                log.warning(
                    "slot %d of %s not erased by its deadline; released now, erased before its "
                    "next holder's first request",
                    rel.slot,
                    rel.mind,
                )
            if not self._still_reclaiming(rel):
                return  # the operator moved on (forced at the deadline): nothing to report
            record = SlotRelease(
                rel.mind,
                rel.slot,
                rel.reason,
                rel.since,
                self.clock(),
                erased,
                parked.tokens if isinstance(parked, Parked) else 0,
                None if isinstance(parked, Parked) else parked,
            )
            self.released[rel.key] = record
            self.metrics.slot_released(rel.reason)
            log.info("released slot %d of %s (%s)", rel.slot, rel.mind, rel.reason)
            self._changed()
        finally:
            self._releasing.pop(rel.key, None)

    async def _park(self, rel: Release, deadline: float) -> Parked | NotParked:
        """Save her slot to the park store, between the cut and the erase, if the save can
        finish before the reclaim's deadline; else why not (the slot is erased as without)."""
        if self.park is None:
            return NotParked.NO_STORE
        if self.slot_owner.get(rel.slot) != rel.mind:
            return NotParked.EMPTY  # erased already, or another's: nothing of hers to save
        async with self._slot_locks.setdefault(rel.slot, asyncio.Lock()):
            return await self._save(rel.mind, rel.slot, deadline)

    async def _save(self, mind: str, slot: int, deadline: float) -> Parked | NotParked:
        """Her slot saved to the park store (the slot's lock held)."""
        assert self.park is not None
        try:
            return await self.park.park(mind, slot, self.slot_tokens.get(slot, 0), deadline)
        except UpstreamDown as err:
            log.warning("slot %d of %s not parked: %s", slot, mind, err)
            return NotParked.SAVE_FAILED

    async def _erase_while_reclaiming(self, rel: Release) -> int | None:
        """Erase her slot, again while llama-server is down; None if the reclaim moved on."""
        while self._still_reclaiming(rel):
            try:
                return await self._erase(rel.slot)
            except UpstreamDown as err:
                log.info("erase of slot %d failed (%s); trying again", rel.slot, err)
                await asyncio.sleep(self.settings.erase_retry_seconds)
        return None

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
        self.slot_count = None
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

    async def _erase(self, slot: int) -> int:
        """Erase a slot's cache; the tokens it held. Serialised per slot."""
        async with self._slot_locks.setdefault(slot, asyncio.Lock()):
            return await self._erase_held(slot)

    async def _erase_held(self, slot: int) -> int:
        """`_erase`, the slot's lock already held."""
        try:
            async with self.session.post(
                f"{self.settings.upstream}/slots/{slot}?action=erase"
            ) as resp:
                payload = await resp.json(content_type=None)
                if resp.status != 200:
                    raise UpstreamDown(f"erase answered {resp.status}: {payload}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            raise UpstreamDown(str(err)) from err
        self.slot_owner.pop(slot, None)
        self.slot_tokens.pop(slot, None)
        return int(payload.get("n_erased", 0)) if isinstance(payload, dict) else 0

    async def park_now(self, request: web.Request) -> web.Response:
        """`POST /v1/park`: she goes idle; her context is saved to the park store and her
        slot erased, and her next request restores it (docs/gateway.md, "Parked contexts")."""
        mind, refused = await self._who(request)
        if refused is not None:
            return self._answer(refused)
        adm = self._admit_turn(mind, None)
        if adm.answer is not Answer.ADMIT:
            return self._answer(adm)
        assert adm.slot is not None
        if self.park is None:
            message = "this engine parks nothing (its Engine has no spec.park): keep your slot"
            return self._refuse(Refusal.BAD_REQUEST, 400, {"message": message})
        if self.flights.get(mind):
            message = "requests of yours are in flight: park once they are answered"
            return self._refuse(Refusal.BAD_REQUEST, 409, {"message": message})
        deadline = self.clock() + self.settings.grace_seconds
        # Held through the save and the erase: a request of hers waits, then restores.
        async with self._slot_locks.setdefault(adm.slot, asyncio.Lock()):
            if self.slot_owner.get(adm.slot) != mind:
                return web.json_response({"parked": False, "reason": NotParked.EMPTY.value})
            parked = await self._save(mind, adm.slot, deadline)
            if isinstance(parked, NotParked):
                return web.json_response({"parked": False, "reason": parked.value})
            with contextlib.suppress(UpstreamDown):  # still hers: restored on another slot only
                await self._erase_held(adm.slot)
        return web.json_response({"parked": True, "tokens": parked.tokens, "slot": adm.slot})

    async def _ensure_clean(self, slot: int, mind: str) -> Resumed | None:
        """Erase a slot that may still hold another mind's context, then mark it hers; where
        it does not hold hers and she has a parked context, restore it into the slot first
        (her first request of a new grant): what was restored."""
        owner = self.slot_owner.get(slot)
        if owner is not None and owner != mind:
            await self._erase(slot)
        if owner == mind or self.park is None or not self.park.waiting(mind):
            self.slot_owner[slot] = mind
            return None
        lock = self._slot_locks.setdefault(slot, asyncio.Lock())
        async with lock:
            self.slot_owner[slot] = mind  # from here the slot may hold hers
            resumed = await self.park.resume(mind, slot)
        if resumed is not None:
            self.slot_tokens[slot] = resumed.tokens
        return resumed

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

    async def _until_cut(self, flight: _Flight, work: Awaitable[_T]) -> _T:
        """`work`, unless the flight is cut first: then `_CutNow`, and `work` is cancelled.

        Every wait of a request on llama-server goes through here (tokenize, template, the
        slot's erase, a stream's headers), so a reclaim never waits on one.
        """
        task = asyncio.ensure_future(work)
        if flight.cut.is_set():
            task.cancel()
        # The cut cancels `work` itself (`_Flight.end`): no second task waits on the cut, so a
        # request pays one task per wait (a task and a wait of two cost it 0.1 ms a request).
        flight.waits.add(task)
        try:
            result = await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if flight.cut.is_set() and (current is None or not current.cancelling()):
                raise _CutNow from None  # cut, not her hanging up
            raise
        except Exception:
            if flight.cut.is_set():
                raise _CutNow from None
            raise
        finally:
            flight.waits.discard(task)
        if flight.cut.is_set():
            if isinstance(result, aiohttp.ClientResponse):
                result.close()  # a stream opened as the cut came: llama-server drops it
            raise _CutNow
        return result

    # --- answers ------------------------------------------------------------------------------

    def _reply(self, reply: Reply) -> web.Response:
        return web.json_response(reply.body, status=reply.status, headers=reply.headers or None)

    def _answer(self, adm: Admission, dialect: Dialect = NATIVE) -> web.Response:
        """A refusal of the grant protocol, in the words of the API she spoke."""
        assert adm.refusal is not None
        self.metrics.refused(adm.refusal)
        return self._reply(dialect.refusal(adm))

    def _refuse(
        self, refusal: Refusal, status: int, body: dict[str, Any], dialect: Dialect = NATIVE
    ) -> web.Response:
        return self._answer(
            Admission(Answer.REFUSE, status, {"error": refusal.value, **body}, refusal), dialect
        )

    def _bad_request(self, dialect: Dialect, param: str, message: str) -> web.Response:
        self.metrics.refused(Refusal.BAD_REQUEST)
        return self._reply(dialect.bad_request(param, message))

    def _body_refused(self, refused: BodyRefused, dialect: Dialect = NATIVE) -> web.Response:
        """A body the gateway would not read (`engine.body_limits`), in her API's words."""
        if refused.status == 400:
            return self._bad_request(dialect, "", refused.message)
        adm = Admission(
            Answer.REFUSE,
            refused.status,
            {"error": Refusal.BAD_REQUEST.value, "message": refused.message},
            Refusal.BAD_REQUEST,
            retry_after=refused.retry_after,
        )
        answer = self._answer(adm, dialect)
        if refused.close:
            answer.force_close()
        return answer

    def _cut_body(self, flight: _Flight) -> dict[str, Any]:
        body = {"error": Refusal.TURN_CUT.value, "reason": flight.reason, "by": flight.by}
        if (message := cut_message(flight.reason)) is not None:
            body["message"] = message  # the watchdog's cut: what to change
        return body

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

    async def _who(self, request: web.Request) -> tuple[str, Admission | None]:
        """The mind a request speaks for, or why it may not speak at all.

        With token review (every cluster install) the token (`Authorization: Bearer`, or
        `x-api-key` as Anthropic's clients send it) says who she is and the
        `X-Continuum-Mind` header, if sent, must agree; without it (the unsafe local flag)
        the header is believed.
        """
        asked = request.headers.get(MIND_HEADER, "")
        review = self.settings.review_token
        if review is None:
            return asked, None
        token = _token(request)
        # Minds' tokens are reviewed in a lane of their own (engine.token_review).
        caller = caller_of(token, request.remote or "", self._in_table)
        try:
            account = await review(token, caller) if token else None
        except ReviewUnavailable as err:
            return asked, review_unavailable(str(err))
        return identify(asked, account)

    def _in_table(self, account: ServiceAccount) -> bool:
        """Whether the account's Mind has an entry in the grant table (a lane, not access)."""
        return self.table is not None and self.table.entry(account.mind) is not None

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

    def _admit_turn(self, mind: str, asked: int | None) -> Admission:
        return admit_turn(
            self.table,
            mind,
            asked,
            engine_ready=self.engine_ready,
            queued_retry=self.settings.queued_retry_after,
            relaunch_retry=self.settings.relaunch_retry_after,
        )

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

    def door(self, dialect: Dialect) -> Handler:
        """The handler of a generating route spoken in `dialect`."""

        async def serve(request: web.Request) -> web.StreamResponse:
            return await self._serve(request, dialect)

        return serve

    def _admit(self, mind: str, tid: str) -> Admission:
        """Whether this request runs: inside her open turn, or as a turn of one request."""
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
        if not flights:
            del self.flights[flight.mind]
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

#: An aiohttp request handler.
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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
    """Serve `app` as the gateway must be served: a mind hanging up cancels her request in
    llama-server (`handler_cancellation`), a connection that sends no whole request head
    within `headers_seconds` is closed, and connections are bounded per source address and in
    all (`connections`). Returns the runner and the bound address."""
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


class _CutNow(Exception):
    """The flight was cut while it waited on llama-server."""


def _token(request: web.Request) -> str:
    """Her token: `Authorization: Bearer` (OpenAI's clients), else `x-api-key` (Anthropic's)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


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
