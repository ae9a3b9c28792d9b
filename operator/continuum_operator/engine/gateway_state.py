"""What the grant gateway holds, and how it says no (`engine.gateway` is the whole of it).

Its settings (`GatewaySettings`), what it reports (`SlotRelease`), a request on its way through
llama-server (`_Flight`) and an open turn (`_Turn`); `GatewayState` holds the tables the
request path (`engine.gateway_requests`) and the cut path (`engine.gateway_cuts`) share, says
who a request speaks for (`_who`), whether a turn may open (`_admit_turn`), and each refusal
in the words of the API she spoke (`_answer`, `_refuse`, `_bad_request`, `_body_refused`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from aiohttp import web

from continuum_operator.core import rfc3339
from continuum_operator.door.body_limits import (
    BodyLimits,
    BodyReader,
    BodyRefused,
)
from continuum_operator.door.token_review import Caller, caller_of
from continuum_operator.engine.admission import (
    Admission,
    Answer,
    GrantTable,
    Refusal,
    ReviewUnavailable,
    ServiceAccount,
    admit_turn,
    identify,
    review_unavailable,
)
from continuum_operator.engine.dialects import (
    NATIVE,
    Dialect,
    Reply,
)
from continuum_operator.engine.metrics import EngineMetrics
from continuum_operator.engine.park import PARKING, NotParked, Parked, Parking
from continuum_operator.engine.parking import ParkStore
from continuum_operator.engine.request_cost import (
    DEFAULT_BOUNDS,
    CostBounds,
)
from continuum_operator.engine.turn import MIND_HEADER
from continuum_operator.engine.watchdog import Watchdog, WatchdogSettings, cut_message

__all__ = ["GatewaySettings", "GatewayState", "SlotRelease"]

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
    #: A line per request on aiohttp's access log (`aiohttp.access`, at INFO). Off: the
    #: metrics count every request and refusal; the line cost each request a tenth of its
    #: Python calls.
    access_log: bool = False


@dataclass(frozen=True, slots=True)
class SlotRelease:
    """A reclaimed slot the gateway cut, erased and reports released."""

    mind: str
    slot: int
    reason: str
    grant_since: str | None
    at: float
    #: None: not erased when released (a park's save runs behind the release, or llama-server
    #: had not erased it by the deadline): erased before the next holder's first request.
    erased_tokens: int | None
    #: Her context parked before the erase (its tokens), or why it was not; None with no
    #: reason: the save runs behind the release (filled in when it ends).
    parked_tokens: int | None = 0
    not_parked: str | None = None

    def as_parked(self, parked: Parked | NotParked | Parking, erased: int | None) -> SlotRelease:
        """This release as her park went: its tokens, why not, or (PARKING) not known yet."""
        if parked is PARKING:
            return replace(self, erased_tokens=None, parked_tokens=None, not_parked=None)
        tokens, why = (parked.tokens, None) if isinstance(parked, Parked) else (0, parked.value)
        return replace(self, erased_tokens=erased, parked_tokens=tokens, not_parked=why)

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
    #: The request's task while it waits on llama-server (`Gateway._until_cut`): `end`
    #: cancels it there, and `let_go` takes that cancel back once the wait is over.
    waiting: asyncio.Task[Any] | None = None
    cancelled_wait: bool = False

    def end(self, reason: str, by: str | None) -> None:
        if not self.cut.is_set():
            self.reason, self.by = reason, by
            self.cut.set()
            waiting = self.waiting
            # Cut from inside its own wait (the wait's work called this): it sees the cut as
            # the work returns; a task cancelling itself would carry the cancel past the wait.
            if waiting is not None and waiting is not asyncio.current_task():
                self.cancelled_wait = waiting.cancel()

    def let_go(self, task: asyncio.Task[Any]) -> int:
        """The wait of `task` is over: the cut's cancel of it, if any, taken back. The
        cancels of the task still requested (her hanging up, the server's shutdown)."""
        self.waiting = None
        if self.cancelled_wait:
            self.cancelled_wait = False
            return task.uncancel()
        return task.cancelling()


@dataclass(frozen=True, slots=True)
class _Turn:
    mind: str
    slot: int
    opened: float


#: An aiohttp request handler.
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _CutNow(Exception):
    """The flight was cut while it waited on llama-server."""


def _token(request: web.Request) -> str:
    """Her token: `Authorization: Bearer` (OpenAI's clients), else `x-api-key` (Anthropic's)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key", "").strip()


class GatewayState:
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
        # Saves of reclaimed slots running behind their releases (each then erases its slot).
        self._parking: set[asyncio.Task[None]] = set()
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

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever the releases to report change (the runtime's status)."""
        self._listeners.append(listener)

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Gateway.start() first"
        return self._session

    def _changed(self) -> None:
        for listener in self._listeners:
            listener()

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
        # Minds' tokens are reviewed in a lane of their own (door.token_review).
        caller = caller_of(token, request.remote or "", self._in_table)
        try:
            account = await review(token, caller) if token else None
        except ReviewUnavailable as err:
            return asked, review_unavailable(str(err))
        return identify(asked, account)

    def _in_table(self, account: ServiceAccount) -> bool:
        """Whether the account's Mind has an entry in the grant table (a lane, not access)."""
        return self.table is not None and self.table.entry(account.mind) is not None

    def _admit_turn(self, mind: str, asked: int | None) -> Admission:
        if self.park is not None:
            self.park.back(mind)  # she asks again: no longer parked idle
        return admit_turn(
            self.table,
            mind,
            asked,
            engine_ready=self.engine_ready,
            queued_retry=self.settings.queued_retry_after,
            relaunch_retry=self.settings.relaunch_retry_after,
        )
