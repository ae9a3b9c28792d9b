"""What the gateway decides, without doing any of it: pure, plain values in, typed answers out.

The engine gateway (`engine.gateway`) enforces the grant table the operator writes (the status
of the Engine's GrantLedger, docs/gateway.md). Everything it decides is here, so each rule can be
shown alone without a server:

- `admit_turn`: the answer to `POST /v1/turns` for a mind, from her entry in the table.
- `admit_request`: whether a request inside a turn may reach llama-server.
- `token_cap`: the `n_predict` that keeps prompt plus generation inside the grant's tokens.
- `reconcile`: what a new grant table asks of the gateway: whose turns to cut, which slots to
  erase and report released (docs/design.md rule 7: the reclaim never needs the turn's cooperation).

The gateway never grants on its own: a mind is served only while her entry says `Granted`.
No aiohttp, no Kubernetes here; the table's parser (`parse_table`) reads the documents both
grant sources produce, each entry through `model.grant` (the operator's reader's too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from continuum_operator.core import rfc3339
from continuum_operator.core.grants import EnginePhase, GrantReason
from continuum_operator.door.accounts import (
    REVIEW_RETRY_SECONDS,
    ReviewUnavailable,
    ServiceAccount,
    engine_audience,
    lane_audience,
    review_unavailable_message,
    service_account,
)
from continuum_operator.model.grant import GrantEntry, parse_entries
from continuum_operator.model.mind import GrantState

__all__ = [
    "Admission",
    "Answer",
    "Cut",
    "GrantTable",
    "GrantTableError",
    "OverGrant",
    "Reconciliation",
    "Refusal",
    "Release",
    "ReviewUnavailable",
    "ServiceAccount",
    "TableEntry",
    "TokenCap",
    "admit_request",
    "admit_turn",
    "engine_audience",
    "identify",
    "lane_audience",
    "parse_table",
    "prompt_token_bound",
    "reconcile",
    "review_unavailable",
    "service_account",
    "still_reported",
    "table_from_ledger",
    "token_cap",
]

#: Tokens a tokenizer may add to a prompt beyond one per UTF-8 byte: BOS, EOS, and the space a
#: SentencePiece tokenizer prepends. Every other token of a byte-fallback vocabulary covers at
#: least one byte, so bytes + this bounds the token count from above.
SPECIAL_TOKEN_MARGIN = 4


class GrantTableError(ValueError):
    """A grant table that cannot be read, with the field named."""


class Refusal(StrEnum):
    """Why the gateway refused: the metric label and the `error` of the answer's body."""

    QUEUED = "queued"
    RELAUNCHING = "relaunching"
    RECLAIMING = "reclaiming"
    CONTEXT_TOO_LARGE = "context_too_large"
    FORBIDDEN = "forbidden"
    OVER_GRANT = "over_grant"
    TURN_CUT = "turn_cut"
    NO_TURN = "no_turn"
    BAD_REQUEST = "bad_request"
    UNAUTHENTICATED = "unauthenticated"
    REVIEW_UNAVAILABLE = "review_unavailable"
    #: A llama-server route the gateway does not serve (docs/gateway.md, "Every route").
    NOT_SERVED = "not_served"
    #: A route that takes no slot, asked faster than its rate (tokenize, count tokens).
    RATE_LIMITED = "rate_limited"


#: The reason of a `429` to a mind the grant table does not list while it lists only the head
#: of its queue.
BEYOND_TABLE = "BeyondTable"


class Answer(StrEnum):
    ADMIT = "admit"
    REFUSE = "refuse"


@dataclass(frozen=True, slots=True)
class TableEntry:
    """One mind's line of the grant table, as the operator wrote it."""

    mind: str
    state: GrantState
    reason: str = ""
    slot: int | None = None
    tokens: int = 0
    by: str | None = None
    deadline: float | None = None  # Reclaiming: the grace deadline, Unix seconds
    since: str | None = None  # when this state began; names one reclaim episode
    asked_tokens: int | None = None
    position: int | None = None  # Queued: place in line, 1 first


@dataclass(frozen=True, slots=True)
class GrantTable:
    """The grants of one engine: whose turns it serves, on which slot, with how many tokens."""

    slot_tokens: int
    phase: EnginePhase = EnginePhase.SERVING
    entries: Mapping[str, TableEntry] = field(default_factory=dict)
    # The GrantLedger lists only the head of a long queue (`status.grantQueue`, docs/grants.md
    # "Bounded"): a mind it does not list may be queued behind it.
    left_out: bool = False

    def entry(self, mind: str) -> TableEntry | None:
        return self.entries.get(mind)

    def position(self, mind: str) -> int:
        """Place in line of a queued mind: her entry's, else her order among the queued."""
        e = self.entries.get(mind)
        if e is not None and e.position is not None:
            return e.position
        queued = [m for m, x in self.entries.items() if x.state is GrantState.QUEUED]
        return queued.index(mind) + 1 if mind in queued else 0

    def holder(self, slot: int) -> TableEntry | None:
        for e in self.entries.values():
            if e.slot == slot and e.state in (GrantState.GRANTED, GrantState.RECLAIMING):
                return e
        return None


# --- reading the table -----------------------------------------------------------------------


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GrantTableError(f"{where}: expected a non-negative integer, got {value!r}")
    return value


#: What a table entry takes of the ledger's entry as it is: every field but the reason, which
#: the gateway keeps as text (a reason newer than it is relayed, not refused).
_AS_READ = {f.name for f in fields(TableEntry)} - {"reason"}


def _table_entry(e: GrantEntry, reason: str | None = None) -> TableEntry:
    if reason is None:
        reason = e.reason.value if e.reason is not None else ""
    return TableEntry(reason=reason, **e.model_dump(include=_AS_READ))


def _entries(grants: list[Any], where: str) -> list[TableEntry]:
    """The table's entries (`model.grant.parse_entries`). The gateway's policy on an entry it
    cannot read: the whole table is refused, never served in part (its source keeps the last
    good one). Except a reason it does not know, relayed as text: an operator newer than this
    gateway may write one, and the gateway decides by state, slot and tokens, so a new reason
    must not freeze its table while the operator reclaims slots."""
    parsed, unread = parse_entries(grants)
    if not unread:
        return [_table_entry(e) for e in parsed]
    reasons: dict[int, str] = {}
    for u in unread:
        reason = u.entry.get("reason") if isinstance(u.entry, Mapping) else None
        if u.fields != ("reason",) or not isinstance(reason, str):
            raise GrantTableError(f"{where}[{u.index}]: {u.why}")
        reasons[u.index] = reason
    read = iter(parsed)
    return [
        _table_entry(GrantEntry.model_validate({**item, "reason": None}), reasons[i])
        if i in reasons
        else _table_entry(next(read))
        for i, item in enumerate(grants)
    ]


def _slot_tokens(value: Any, where: str) -> int:
    slot_tokens = _int(value, where)
    if not slot_tokens:
        raise GrantTableError(f"{where}: must be a positive number of tokens")
    return slot_tokens


def parse_table(doc: Any, *, where: str = "grant table") -> GrantTable:
    """A grant table from its document: `{slotTokens, phase, grants: [...]}` (docs/gateway.md)."""
    if not isinstance(doc, Mapping):
        raise GrantTableError(f"{where}: expected a mapping, got {type(doc).__name__}")
    return _table(doc, _slot_tokens(doc.get("slotTokens"), f"{where}.slotTokens"), where=where)


def _table(doc: Mapping[str, Any], slot_tokens: int, *, where: str) -> GrantTable:
    """The table of a document's `phase`, `grants` and `queue`, its slot size already read (each
    source names the field it keeps it in)."""
    try:
        phase = EnginePhase(doc.get("phase") or EnginePhase.SERVING)
    except ValueError as err:
        phases = ", ".join(p.value for p in EnginePhase)
        raise GrantTableError(
            f"{where}.phase: {doc.get('phase')!r} is not one of {phases}"
        ) from err
    grants = doc.get("grants") or []
    if not isinstance(grants, list):
        raise GrantTableError(f"{where}.grants: expected a list")
    entries: dict[str, TableEntry] = {}
    for i, e in enumerate(_entries(grants, f"{where}.grants")):
        if e.mind in entries:
            raise GrantTableError(f"{where}.grants[{i}]: {e.mind} is listed twice")
        entries[e.mind] = e
    left_out = isinstance(doc.get("queue"), Mapping)
    return GrantTable(slot_tokens=slot_tokens, phase=phase, entries=entries, left_out=left_out)


def table_from_ledger(obj: Mapping[str, Any]) -> GrantTable:
    """The grant table of a GrantLedger object: its `status.grants`, and its slot size from
    `status.grantCapacity.tokensPerSlot`.

    The slot size is the one of the launch the ledger was made for, not the Engine's plan:
    while a changed launch drains, the minds still granted hold slots of the old process, the
    one this gateway runs in. A ledger that names no slot size gives no table: the gateway
    keeps refusing turns as it does before its first table.
    """
    meta = obj.get("metadata") or {}
    where = f"GrantLedger {meta.get('namespace')}/{meta.get('name')} status"
    status = obj.get("status") or {}
    capacity = status.get("grantCapacity")
    if not isinstance(capacity, Mapping) or capacity.get("tokensPerSlot") is None:
        raise GrantTableError(
            f"{where}.grantCapacity.tokensPerSlot: missing, so no slot size to cap turns by; "
            "turns are refused until the operator's next grant step writes the ledger's "
            "grantCapacity (its logs say why it has not)"
        )
    slot_tokens = _slot_tokens(capacity["tokensPerSlot"], f"{where}.grantCapacity.tokensPerSlot")
    doc = {
        # A draining or relaunching engine shows in its entries (EngineRelaunching reasons).
        "grants": status.get("grants") or [],
        "queue": status.get("grantQueue"),
    }
    return _table(doc, slot_tokens, where=where)


# --- admission -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Admission:
    """The gateway's answer: admitted to a slot, or refused with a status and a body."""

    answer: Answer
    status: int
    body: dict[str, Any]
    refusal: Refusal | None = None
    slot: int | None = None
    tokens: int = 0
    retry_after: int | None = None


def _refuse(
    refusal: Refusal, status: int, body: dict[str, Any], retry_after: int | None = None
) -> Admission:
    return Admission(
        Answer.REFUSE, status, {"error": refusal.value, **body}, refusal, retry_after=retry_after
    )


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return rfc3339.format_isoformat(t)


def _not_granted(
    table: GrantTable, entry: TableEntry, *, queued_retry: int, relaunch_retry: int, cut: bool
) -> Admission:
    """The answer for a mind whose grant is not `Granted` (entry.state is not GRANTED)."""
    if entry.state is GrantState.RECLAIMING:
        refusal = Refusal.TURN_CUT if cut else Refusal.RECLAIMING
        return _refuse(
            refusal,
            409,
            {"reason": entry.reason, "by": entry.by, "deadline": _iso(entry.deadline)},
            # The turn ends now; a next turn is worth asking for once the release is recorded.
            None if cut else 1,
        )
    if entry.state is GrantState.RELEASED and entry.reason == GrantReason.CONTEXT_TOO_LARGE:
        return _refuse(
            Refusal.CONTEXT_TOO_LARGE,
            413,
            {"slotTokens": table.slot_tokens, "askedTokens": entry.asked_tokens},
        )
    if entry.state is GrantState.RELEASED and entry.reason == GrantReason.CLASS_LIMIT:
        # Her class allows fewer tokens than she asks (docs/tenancy.md): not a wait in line.
        return _refuse(
            Refusal.CONTEXT_TOO_LARGE,
            413,
            {"reason": entry.reason, "askedTokens": entry.asked_tokens},
        )
    if entry.state is GrantState.RELEASED and entry.reason == GrantReason.CLASS_NOT_ALLOWED:
        # Her class does not allow her namespace (docs/tenancy.md): not a wait in line either.
        return _refuse(
            Refusal.FORBIDDEN,
            403,
            {"reason": entry.reason, "message": f"{entry.mind}: her MindClass does not allow "
             "her namespace; see her Mind's status.grant for the class and what to do"},
        )  # fmt: skip
    if cut:
        # A request inside a turn whose grant is no longer held: the turn is over.
        return _refuse(Refusal.TURN_CUT, 409, {"reason": entry.reason or entry.state.value})
    relaunching = (
        table.phase is not EnginePhase.SERVING or entry.reason == GrantReason.ENGINE_RELAUNCHING
    )
    if relaunching:
        return _refuse(
            Refusal.RELAUNCHING,
            503,
            {"reason": GrantReason.ENGINE_RELAUNCHING.value},
            relaunch_retry,
        )
    # Queued, or Released for a moment before she is requeued.
    return _refuse(
        Refusal.QUEUED,
        429,
        {
            "reason": entry.reason or GrantReason.ARRIVED.value,
            "position": table.position(entry.mind),
        },
        queued_retry,
    )


def admit_turn(
    table: GrantTable | None,
    mind: str,
    asked_tokens: int | None = None,
    *,
    engine_ready: bool = True,
    queued_retry: int = 2,
    relaunch_retry: int = 5,
) -> Admission:
    """The answer to `POST /v1/turns` (docs/gateway.md, "Opening a turn")."""
    if table is None:
        # No table read yet: nobody is granted anything; wait as for a relaunch.
        return _refuse(
            Refusal.RELAUNCHING,
            503,
            {"reason": GrantReason.ENGINE_RELAUNCHING.value},
            relaunch_retry,
        )
    entry = table.entry(mind)
    if entry is None and table.left_out:
        # Not in the head of the queue the ledger lists: queued behind it, as far as the
        # gateway can tell (her Mind's status.grant says her place).
        return _refuse(
            Refusal.QUEUED,
            429,
            {
                "reason": BEYOND_TABLE,
                "position": None,
                "message": f"{mind} is not among the minds this engine's grant table lists; "
                "a long queue is listed only from its head: her Mind's status.grant says her "
                "place (kubectl get mind -o wide)",
            },
            queued_retry,
        )
    if entry is None:
        return _refuse(
            Refusal.FORBIDDEN,
            403,
            {"message": f"{mind} is not in this engine's grant table; is spec.engine right?"},
        )
    if asked_tokens is not None and asked_tokens > table.slot_tokens:
        return _refuse(
            Refusal.CONTEXT_TOO_LARGE,
            413,
            {"slotTokens": table.slot_tokens, "askedTokens": asked_tokens},
        )
    if entry.state is not GrantState.GRANTED:
        return _not_granted(
            table, entry, queued_retry=queued_retry, relaunch_retry=relaunch_retry, cut=False
        )
    if entry.slot is None:
        raise GrantTableError(f"{mind}: Granted without a slot")
    if not engine_ready:
        return _refuse(
            Refusal.RELAUNCHING,
            503,
            {"reason": GrantReason.ENGINE_RELAUNCHING.value},
            relaunch_retry,
        )
    if asked_tokens is not None and asked_tokens > entry.tokens:
        return _refuse(
            Refusal.CONTEXT_TOO_LARGE,
            413,
            {"slotTokens": entry.tokens, "askedTokens": asked_tokens},
        )
    return Admission(
        Answer.ADMIT,
        201,
        {"slot": entry.slot, "tokens": entry.tokens, "reason": entry.reason},
        slot=entry.slot,
        tokens=entry.tokens,
    )


def admit_request(
    table: GrantTable | None,
    mind: str,
    turn_slot: int | None,
    *,
    engine_ready: bool = True,
) -> Admission:
    """Whether a request inside a turn (opened on `turn_slot`; None: no such open turn) runs.

    The grant is checked first: a turn whose grant is being reclaimed is cut (`409`), whatever
    the mind thinks of her turn.
    """
    entry = table.entry(mind) if table is not None else None
    if table is None or entry is None:
        return _refuse(
            Refusal.FORBIDDEN, 403, {"message": f"{mind} is not in this engine's grant table"}
        )
    if entry.state is not GrantState.GRANTED:
        # With a turn open, the turn is cut; without one, she hears what opening one would say.
        return _not_granted(
            table, entry, queued_retry=2, relaunch_retry=5, cut=turn_slot is not None
        )
    if turn_slot is None:
        return _refuse(
            Refusal.NO_TURN,
            404,
            {"message": f"{mind} has no open turn by that id; open one with POST /v1/turns"},
        )
    if entry.slot != turn_slot:
        # The grant moved to another slot (a relaunched engine renumbered them): a new turn.
        return _refuse(Refusal.TURN_CUT, 409, {"reason": GrantReason.SLOT_MOVED.value})
    if not engine_ready:
        return _refuse(Refusal.TURN_CUT, 409, {"reason": GrantReason.ENGINE_RELAUNCHING.value})
    return Admission(Answer.ADMIT, 200, {}, slot=entry.slot, tokens=entry.tokens)


# --- who is asking --------------------------------------------------------------------------


def review_unavailable(why: str) -> Admission:
    """The answer when her token could not be reviewed (the API server did not answer, or too
    many reviews wait): not judged, so not a `401`; her client may send it again."""
    return _refuse(
        Refusal.REVIEW_UNAVAILABLE,
        503,
        {"message": review_unavailable_message(why)},
        REVIEW_RETRY_SECONDS,
    )


def identify(asked_mind: str, account: ServiceAccount | None) -> tuple[str, Admission | None]:
    """The mind a reviewed token speaks for, or the refusal.

    A token speaks for one Mind: the one named as its service account, in its namespace, so
    no other service account of her namespace, nor a child pod of hers running as another
    account, can spend her grant (a pod running as her own account can: docs/gateway.md).
    `asked_mind` (the `X-Continuum-Mind` header) is optional; given, it must be that Mind.
    """
    if account is None:
        return asked_mind, _refuse(
            Refusal.UNAUTHENTICATED,
            401,
            {
                "message": "send the mind's service account token, projected with this "
                "engine's audience, as Authorization: Bearer (the OpenAI client's API key) "
                "or x-api-key (the Anthropic client's)"
            },
        )
    if asked_mind and asked_mind != account.mind:
        return asked_mind, _refuse(
            Refusal.FORBIDDEN,
            403,
            {
                "message": f"the token of service account {account.mind} speaks only for "
                f"Mind {account.mind}, not {asked_mind}"
            },
        )
    return account.mind, None


# --- tokens ----------------------------------------------------------------------------------


def prompt_token_bound(prompt: Any) -> int | None:
    """An upper bound of a `/completion` prompt's tokens without tokenizing; None if not one
    prompt (a list of prompts, or something else)."""
    if isinstance(prompt, str):
        return len(prompt.encode()) + SPECIAL_TOKEN_MARGIN
    if isinstance(prompt, list):
        if len(prompt) > 1 and all(isinstance(p, str) for p in prompt):
            return None  # llama-server reads a list of strings as several prompts
        total = SPECIAL_TOKEN_MARGIN
        for piece in prompt:
            if isinstance(piece, bool):
                return None
            if isinstance(piece, int):
                total += 1
            elif isinstance(piece, str):
                total += len(piece.encode()) + SPECIAL_TOKEN_MARGIN
            else:
                return None
        return total
    return None


@dataclass(frozen=True, slots=True)
class TokenCap:
    """The `n_predict` to forward, and whether it is less than the mind asked for."""

    n_predict: int
    asked: int | None
    capped: bool


@dataclass(frozen=True, slots=True)
class OverGrant:
    """The prompt alone fills the grant: nothing can be generated."""

    prompt_tokens: int
    grant_tokens: int

    def body(self) -> dict[str, Any]:
        return {
            "error": Refusal.OVER_GRANT.value,
            "reason": "GrantTokens",
            "promptTokens": self.prompt_tokens,
            "grantTokens": self.grant_tokens,
            "message": f"the prompt takes {self.prompt_tokens} tokens of a grant of "
            f"{self.grant_tokens}; shorten it",
        }


def token_cap(grant_tokens: int, prompt_tokens: int, asked: int | None) -> TokenCap | OverGrant:
    """`n_predict` so that prompt plus generated tokens fit in the grant.

    `asked` is the request's `n_predict` (None or negative: as many as fit).
    """
    room = grant_tokens - prompt_tokens
    if room <= 0:
        return OverGrant(prompt_tokens, grant_tokens)
    if asked is None or asked < 0:
        return TokenCap(room, asked, capped=False)
    if asked > room:
        return TokenCap(room, asked, capped=True)
    return TokenCap(asked, asked, capped=False)


# --- table changes ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cut:
    """End every request and open turn of a mind: her grant is no longer held."""

    mind: str
    reason: str
    by: str | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """Erase a reclaimed slot and report it released (its one reporter is the gateway)."""

    mind: str
    slot: int
    reason: str
    since: str | None
    deadline: float | None

    @property
    def key(self) -> tuple[str, int, str | None]:
        return (self.mind, self.slot, self.since)


@dataclass(frozen=True, slots=True)
class Reconciliation:
    cuts: tuple[Cut, ...] = ()
    releases: tuple[Release, ...] = ()


def reconcile(
    table: GrantTable, serving: Mapping[str, int], done: Iterable[tuple[str, int, str | None]] = ()
) -> Reconciliation:
    """What the gateway must do under `table`.

    `serving` maps each mind with an open turn or a request in flight to the slot it runs on;
    `done` holds the keys of releases already made (a release is made once per reclaim).
    Pure and idempotent: the gateway calls it on every table it reads.
    """
    cuts: list[Cut] = []
    for mind, slot in sorted(serving.items()):
        e = table.entry(mind)
        if e is None:
            cuts.append(Cut(mind, GrantReason.MIND_DELETED.value))
        elif e.state is not GrantState.GRANTED:
            cuts.append(Cut(mind, e.reason or e.state.value, e.by))
        elif e.slot != slot:
            cuts.append(Cut(mind, GrantReason.SLOT_MOVED.value))
    finished = set(done)
    releases = [
        Release(e.mind, e.slot, e.reason, e.since, e.deadline)
        for e in sorted(table.entries.values(), key=lambda x: x.mind)
        if e.state is GrantState.RECLAIMING
        and e.slot is not None
        and (e.mind, e.slot, e.since) not in finished
    ]
    return Reconciliation(tuple(cuts), tuple(releases))


def still_reported(
    table: GrantTable, reported: Iterable[tuple[str, int, str | None]]
) -> set[tuple[str, int, str | None]]:
    """Releases still worth reporting: the table still shows that reclaim (not yet recorded).

    Once the operator has moved the grant on (Released, requeued, granted again), the report
    has done its work and leaves the runtime status, so the list stays as short as the
    reclaims in progress.
    """
    keep = set()
    for key in reported:
        mind, slot, since = key
        e = table.entry(mind)
        if (
            e is not None
            and e.state is GrantState.RECLAIMING
            and e.slot == slot
            and e.since == since
        ):
            keep.add(key)
    return keep
