"""`continuum check-log`: docs/design.md rule 7's grant invariants, checked over a transition log.

The allocator (core/grants.py) and the simulator (core/simulate.py) write every change to an
engine's grant ledger as a JSON line (docs/transition-log.md). This module reads such a log back
and checks the seven invariants listed there. It exists so that the allocator is judged from
outside: it imports nothing from `continuum_operator.core` or `continuum_operator.model`, only
the standard library, and rebuilds the ledger from the log alone. A bug shared with the code
under test cannot hide here, and a broken policy (the old reclaim order, no protection window,
preemption that ignores minds already reclaiming) shows up as a named violation.

Lines with the same `t` and `engine` form one step. Checks that concern one line (the state a
transition starts from, a reclaim or a wait outliving its deadline, thrash) run as each line is
read; checks that concern the ledger as a whole (pool, queue order, needless preemption) run
once every line of the step has been applied, when the log's time moves on or ends.
"""

from __future__ import annotations

import heapq
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

INVARIANTS: Mapping[int, str] = {
    1: "granted-within-pool",
    2: "one-state-per-mind",
    3: "reclaim-within-grace",
    4: "no-wait-past-deadline",
    5: "no-thrash",
    6: "no-priority-inversion",
    7: "no-needless-reclaim",
}

QUEUED, GRANTED, RECLAIMING, RELEASED = "Queued", "Granted", "Reclaiming", "Released"
STATES = frozenset({QUEUED, GRANTED, RECLAIMING, RELEASED})
HOLDING = frozenset({GRANTED, RECLAIMING})
PHASES = frozenset({"Serving", "Draining", "Relaunching", "Starting", "Unschedulable"})
WAIT_OUTCOMES = frozenset({"granted", "deadline", "left"})
TURN_PHASES = frozenset({"start", "end", "cut"})
EVENTS = frozenset({"capacity", "transition", "wait", "waitEnd", "turn"})

# A mind leaving the queue without a slot: she left, or she is refused (docs/grants.md).
_REFUSED_OR_GONE = frozenset({"MindDeleted", "ContextTooLarge", "ClassLimit", "ClassNotAllowed"})
# Reclaims that are not a preemption: the engine's, or the mind's (she left, or is refused,
# or parked herself idle).
_FORCED = _REFUSED_OR_GONE | {"EngineShrunk", "EngineRelaunching", "Parked"}

# The table of docs/transition-log.md: (from, to) -> the reasons allowed.
ALLOWED: Mapping[tuple[str | None, str], frozenset[str]] = {
    (None, QUEUED): frozenset({"Arrived"}),
    (QUEUED, QUEUED): frozenset(
        {
            "PoolFull",
            "WaitingForReclaim",
            "EngineRelaunching",
            "EngineStarting",
            "EngineUnschedulable",
            "QuotaExceeded",
        }
    ),
    (QUEUED, GRANTED): frozenset({"SlotFree"}),
    (GRANTED, GRANTED): frozenset({"SlotMoved"}),
    (GRANTED, RECLAIMING): _FORCED | {"Preempted"},
    (RECLAIMING, RELEASED): frozenset({"SlotReleased", "GraceExpired"}),
    (RELEASED, QUEUED): frozenset({"Requeued", "Arrived"}),
    (QUEUED, RELEASED): _REFUSED_OR_GONE,
    (None, RELEASED): _REFUSED_OR_GONE,
}
# Times are floats written by another program: a preemption this close to the end of the
# victim's window counts as after it, so an allocator that computes `granted + window` rather
# than `now - granted` is not flagged as thrashing over one rounding step.
CLOCK_SLACK = 1e-6

# A second reclaim inside one protection window is allowed for these reasons (invariant 5).
FORCED_RECLAIMS = _FORCED
# A queued mind her namespace's token quota holds back (docs/tenancy.md): the log carries no
# quota, so she is not counted among those a free or reclaimed slot is owed to.
QUOTA_HELD = "QuotaExceeded"


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant: where (time, engine, mind) and what, in words."""

    invariant: int
    name: str
    t: float
    engine: str
    mind: str | None
    message: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        who = self.mind if self.mind is not None else "-"
        return (
            f"t={self.t:g} {self.engine} {who}: invariant {self.invariant} ({self.name}): "
            f"{self.message}"
        )


class LogFormatError(ValueError):
    """The log cannot be read as the contract says: names the line (1-based) and the fault."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message


@dataclass(slots=True)
class _Mind:
    state: str
    tokens: int = 0
    slot: int | None = None
    priority: float = 0.0
    window: float = 0.0
    deadline: float | None = None
    granted_at: float | None = None
    reclaimed_at: float | None = None
    queued_since: float = 0.0
    late: bool = False  # a reclaim past its deadline, already reported
    seq: int = 0  # numbers the reclaim, for the deadline queue
    reason: str = ""  # of her last transition


@dataclass(slots=True)
class _Wait:
    deadline: float
    seq: int
    late: bool = False


@dataclass(slots=True)
class _Engine:
    name: str
    ledger: str | None = None  # the GrantLedger its lines name (the operator's lines do)
    phase: str | None = None
    slots: int = 0
    tokens_per_slot: int = 0
    minds: dict[str, _Mind] = field(default_factory=dict)
    holders: dict[str, _Mind] = field(default_factory=dict)  # Granted or Reclaiming
    queued: dict[str, _Mind] = field(default_factory=dict)
    waits: dict[str, _Wait] = field(default_factory=dict)


# --- reading the lines -----------------------------------------------------------------------


def _field(
    line: Mapping[str, Any],
    key: str,
    n: int,
    *,
    null: bool,
    valid: Callable[[Any], bool],
    must_be: str,
) -> Any:
    """The line's `key`, checked by `valid`; None where it is missing or null and `null` allows
    that."""
    if key not in line:
        if null:
            return None
        raise LogFormatError(n, f"missing field `{key}`")
    v = line[key]
    if v is None and null:
        return None
    if not valid(v):
        raise LogFormatError(n, f"`{key}` must be {must_be}, not {json.dumps(v)}")
    return v


def _finite_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)


def _whole_number(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, int) and v >= 0


def _non_empty_string(v: Any) -> bool:
    return isinstance(v, str) and bool(v)


def _number(line: Mapping[str, Any], key: str, n: int, *, null: bool = False) -> float | None:
    v = _field(line, key, n, null=null, valid=_finite_number, must_be="a finite number")
    return None if v is None else float(v)


def _req_number(line: Mapping[str, Any], key: str, n: int) -> float:
    v = _number(line, key, n)
    assert v is not None
    return v


def _count(line: Mapping[str, Any], key: str, n: int, *, null: bool = False) -> int | None:
    v: int | None = _field(
        line, key, n, null=null, valid=_whole_number, must_be="a whole number >= 0"
    )
    return v


def _text(line: Mapping[str, Any], key: str, n: int, *, null: bool = False) -> str | None:
    v: str | None = _field(
        line, key, n, null=null, valid=_non_empty_string, must_be="a non-empty string"
    )
    return v


def _req_text(line: Mapping[str, Any], key: str, n: int) -> str:
    v = _text(line, key, n)
    assert v is not None
    return v


def _choice(line: Mapping[str, Any], key: str, n: int, choices: frozenset[str]) -> str:
    v = _req_text(line, key, n)
    if v not in choices:
        raise LogFormatError(n, f"`{key}` must be one of {', '.join(sorted(choices))}, not {v!r}")
    return v


# --- the checker -----------------------------------------------------------------------------


class _Checker:
    def __init__(self) -> None:
        self.engines: dict[str, _Engine] = {}
        self.violations: list[Violation] = []
        self.now: float | None = None
        self.stepped: dict[str, _Engine] = {}  # engines with lines at `now`
        # Deadlines of open reclaims and waits: (deadline, seq, engine, mind); stale entries
        # (the reclaim or wait ended, or the wait's deadline moved earlier) are skipped.
        self.reclaims_due: list[tuple[float, int, str, str]] = []
        self.waits_due: list[tuple[float, int, str, str]] = []
        self.seq = 0

    def flag(
        self, inv: int, e: _Engine, mind: str | None, msg: str, t: float | None = None
    ) -> None:
        when = self.now if t is None else t
        assert when is not None
        self.violations.append(Violation(inv, INVARIANTS[inv], when, e.name, mind, msg))

    # time

    def line(self, n: int, raw: object) -> None:
        if not isinstance(raw, dict | Mapping):
            raise LogFormatError(n, f"a line must be a JSON object, not {type(raw).__name__}")
        t = _req_number(raw, "t", n)
        name = _req_text(raw, "engine", n)
        event = _choice(raw, "event", n, EVENTS)
        if self.now is not None and t < self.now:
            raise LogFormatError(n, f"`t` goes backwards: {t:g} after {self.now:g}")
        if self.now is None or t > self.now:
            self.end_steps()
            self.now = t
            self.overdue(t)
        ledger = _field(raw, "ledger", n, null=True, valid=_non_empty_string,
                        must_be="a non-empty string")  # fmt: skip
        e = self.engines.get(name)
        if e is None or (ledger is not None and e.ledger not in (None, ledger)):
            # An Engine made again under its name: a ledger of its own, holding nothing yet.
            e = self.engines[name] = _Engine(name)
        if ledger is not None:
            e.ledger = ledger
        self.stepped[name] = e
        _EVENTS[event](self, e, raw, n)

    def overdue(self, t: float) -> None:
        """Invariants 3 and 4 for reclaims and waits that time has passed by without an end."""
        while self.reclaims_due and self.reclaims_due[0][0] < t:
            deadline, seq, engine, name = heapq.heappop(self.reclaims_due)
            e = self.engines[engine]
            m = e.minds.get(name)  # None: a ledger since replaced
            if m is not None and m.state == RECLAIMING and m.seq == seq and not m.late:
                m.late = True
                self.flag(3, e, name, f"still Reclaiming at t={t:g}, past its grace "
                          f"deadline {deadline:g}")  # fmt: skip
        while self.waits_due and self.waits_due[0][0] < t:
            deadline, seq, engine, name = heapq.heappop(self.waits_due)
            e = self.engines[engine]
            w = e.waits.get(name)
            if w is not None and w.seq == seq and w.deadline == deadline and not w.late:
                w.late = True
                self.flag(4, e, name, f"still waiting at t={t:g}, past its deadline "
                          f"{deadline:g}")  # fmt: skip

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def end_steps(self) -> None:
        for e in self.stepped.values():
            self.pool(e)
            self.queue(e)
        self.stepped = {}

    # events

    def capacity(self, e: _Engine, line: Mapping[str, Any], n: int) -> None:
        e.phase = _choice(line, "phase", n, PHASES)
        e.slots = _count(line, "slots", n) or 0
        e.tokens_per_slot = _count(line, "tokensPerSlot", n) or 0

    def transition(self, e: _Engine, line: Mapping[str, Any], n: int) -> None:
        t = self.now
        assert t is not None
        name = _req_text(line, "mind", n)
        if "from" not in line:
            raise LogFormatError(n, "missing field `from`")
        src = line["from"]
        if src is not None and src not in STATES:
            raise LogFormatError(n, f"`from` must be null or one of {', '.join(sorted(STATES))}, "
                                 f"not {json.dumps(src)}")  # fmt: skip
        dst = _choice(line, "to", n, STATES)
        reason = _req_text(line, "reason", n)
        tokens = _count(line, "tokens", n) or 0
        slot = _count(line, "slot", n, null=True)
        priority = _req_number(line, "priority", n)
        window = _req_number(line, "protectionWindow", n)
        deadline = _number(line, "deadline", n, null=True)
        by = _text(line, "by", n, null=True)

        m = e.minds.get(name)
        cur = m.state if m is not None else None
        # Invariant 2: the state the line starts from is the mind's; the move is in the table.
        if src != cur and not (src is None and cur == RELEASED):
            self.flag(2, e, name, f"transition from {src} but the mind is "
                      f"{cur if cur is not None else 'not in the ledger'}")  # fmt: skip
        allowed = ALLOWED.get((src, dst))
        if allowed is None:
            self.flag(2, e, name, f"{src} -> {dst} is not a transition of the grant states")
        elif reason not in allowed:
            self.flag(2, e, name, f"{src} -> {dst} with reason {reason!r}; allowed: "
                      f"{', '.join(sorted(allowed))}")  # fmt: skip
        if reason == "Preempted" and by is None:
            self.flag(2, e, name, "Preempted without `by` naming the preemptor")

        # Invariant 1 (per line): what each state holds.
        if dst in HOLDING and slot is None:
            self.flag(1, e, name, f"{dst} but holds no slot")
        if dst not in HOLDING and (tokens != 0 or slot is not None):
            self.flag(1, e, name, f"{dst} but holds {tokens} tokens and slot {slot}")

        if m is None:
            m = e.minds[name] = _Mind(state=dst, queued_since=t)

        # Invariant 3: a reclaim leaves by its deadline; a reclaim has a deadline.
        left = cur == RECLAIMING and dst != RECLAIMING
        if left and m.deadline is not None and t > m.deadline and not m.late:
            m.late = True
            self.flag(3, e, name, f"left Reclaiming at t={t:g}, after its grace deadline "
                      f"{m.deadline:g}")  # fmt: skip
        if dst == RECLAIMING and cur != RECLAIMING:
            m.late = False
            m.seq = self.next_seq()
            if deadline is None:
                self.flag(3, e, name, "Reclaiming without a grace deadline")
            else:
                heapq.heappush(self.reclaims_due, (deadline, m.seq, e.name, name))

        # Invariant 5: thrash, and preempting a young grant.
        if dst == RECLAIMING and cur == GRANTED:
            self.thrash(e, name, m, reason, window, by)

        if dst == QUEUED and cur != QUEUED:
            m.queued_since = t
        if dst == GRANTED and cur != GRANTED:
            m.granted_at = t
        if dst == RECLAIMING and cur != RECLAIMING:
            m.reclaimed_at = t
        m.state, m.tokens, m.slot, m.reason = dst, tokens, slot, reason
        e.holders.pop(name, None)
        e.queued.pop(name, None)
        if dst in HOLDING:
            e.holders[name] = m
        elif dst == QUEUED:
            e.queued[name] = m
        m.priority, m.window = priority, window
        m.deadline = deadline if dst == RECLAIMING else None
        # Invariant 7, judged on the ledger as it stands when the preemption is made: a mind
        # that arrives and leaves within one instant still justified it when it was made.
        if dst == RECLAIMING and cur == GRANTED and reason == "Preempted":
            self.needless(e, name, by)

    def thrash(
        self, e: _Engine, name: str, m: _Mind, reason: str, window: float, by: str | None
    ) -> None:
        t = self.now
        assert t is not None
        young = m.granted_at is not None and t - m.granted_at < window - CLOCK_SLACK
        if young and reason == "Preempted":
            assert m.granted_at is not None
            self.flag(5, e, name, f"Preempted {t - m.granted_at:g} s after its grant, inside "
                      f"its protection window of {window:g} s")  # fmt: skip
            return
        if (
            m.reclaimed_at is not None
            and reason not in FORCED_RECLAIMS
            and t - m.reclaimed_at < window - CLOCK_SLACK
        ):
            since = t - m.reclaimed_at
            self.flag(5, e, name, f"reclaimed ({reason}) {since:g} s after its previous "
                      f"reclaim, inside its protection window of {window:g} s")  # fmt: skip

    def wait(self, e: _Engine, line: Mapping[str, Any], n: int) -> None:
        name = _req_text(line, "mind", n)
        _req_text(line, "reason", n)
        deadline = _req_number(line, "deadline", n)
        w = e.waits.get(name)
        if w is None:
            w = e.waits[name] = _Wait(deadline, self.next_seq())
        elif deadline < w.deadline:
            w.deadline = deadline
        else:
            # The wait restated (its reason changed): the turn's deadline does not move later.
            return
        heapq.heappush(self.waits_due, (deadline, w.seq, e.name, name))

    def wait_end(self, e: _Engine, line: Mapping[str, Any], n: int) -> None:
        t = self.now
        assert t is not None
        name = _req_text(line, "mind", n)
        _choice(line, "outcome", n, WAIT_OUTCOMES)
        w = e.waits.pop(name, None)
        if w is None:
            self.flag(4, e, name, "waitEnd without a wait")
        elif t > w.deadline and not w.late:
            self.flag(4, e, name, f"wait ended at t={t:g}, after its deadline {w.deadline:g}")

    def turn(self, e: _Engine, line: Mapping[str, Any], n: int) -> None:
        _req_text(line, "mind", n)
        _choice(line, "phase", n, TURN_PHASES)

    # step-level invariants

    def pool(self, e: _Engine) -> None:
        holders = sorted(e.holders.items())
        if not holders:
            return
        limit = e.slots * e.tokens_per_slot
        held = sum(m.tokens for _, m in holders)
        if e.phase is None:
            self.flag(1, e, None, f"{held} tokens granted before any capacity line")
        elif held > limit:
            self.flag(1, e, None, f"{held} tokens granted or reclaiming, over the pool of "
                      f"{e.slots} x {e.tokens_per_slot} = {limit}")  # fmt: skip
        by_slot: dict[int, list[str]] = {}
        for name, m in holders:
            if m.slot is not None:
                by_slot.setdefault(m.slot, []).append(name)
                if e.phase is not None and m.slot >= e.slots:
                    self.flag(1, e, name, f"holds slot {m.slot}, outside the engine's "
                              f"{e.slots} slots (0 to {e.slots - 1})")  # fmt: skip
        for slot, names in sorted(by_slot.items()):
            if len(names) > 1:
                self.flag(1, e, names[1], f"slot {slot} held by {', '.join(sorted(names))}")

    def _counts(self, e: _Engine) -> tuple[int, int, list[tuple[str, _Mind]]]:
        reclaiming = sum(1 for m in e.holders.values() if m.state == RECLAIMING)
        queued = [(n, m) for n, m in e.queued.items() if m.reason != QUOTA_HELD]
        return max(0, e.slots - len(e.holders)), reclaiming, queued

    def queue(self, e: _Engine) -> None:
        if e.phase != "Serving":
            return
        free, reclaiming, queued = self._counts(e)
        if not queued:
            return
        t = self.now
        assert t is not None

        # Queued minds ranked: priority (highest first), then arrival. Ties do not change the
        # verdict, since only a strictly lower grant can be preempted.
        def rank(q: tuple[str, _Mind]) -> tuple[float, float, str]:
            return (-q[1].priority, q[1].queued_since, q[0])

        if free:
            self.flag(6, e, min(queued, key=rank)[0], f"queued while {free} slot(s) stay free")
            return
        covered = free + reclaiming
        if covered >= len(queued):
            return
        first_uncovered, q = heapq.nsmallest(covered + 1, queued, key=rank)[-1]
        victims = [
            (m.priority, name)
            for name, m in e.holders.items()
            if m.state == GRANTED
            and m.priority < q.priority
            and m.granted_at is not None
            and t - m.granted_at >= m.window
            and (m.reclaimed_at is None or t - m.reclaimed_at >= m.window)
        ]
        if victims:
            prio, victim = heapq.nsmallest(1, victims)[0]
            self.flag(6, e, first_uncovered, f"queued at priority {q.priority:g} behind "
                      f"{victim} (priority {prio:g}, unprotected), with {covered} slot(s) free "
                      f"or reclaiming for {len(queued)} queued")  # fmt: skip

    def needless(self, e: _Engine, victim: str, by: str | None) -> None:
        free, reclaiming, queued = self._counts(e)
        vm = e.minds[victim]
        # Only queued minds above the victim can be what the preemption was for; a slot free
        # or already reclaiming for each of them makes this reclaim needless.
        above = sum(1 for _, m in queued if m.priority > vm.priority)
        if free + reclaiming > above:
            self.flag(7, e, victim, f"preempted with {free} slot(s) free and {reclaiming} "
                      f"reclaiming (this one included) for {above} queued above priority "
                      f"{vm.priority:g}")  # fmt: skip
        if by is None:
            return
        pm = e.minds.get(by)
        if pm is None:
            self.flag(7, e, victim, f"preempted by {by}, who is not on this engine")
        elif pm.priority <= vm.priority:
            self.flag(7, e, victim, f"preempted (priority {vm.priority:g}) by {by}, whose "
                      f"priority {pm.priority:g} is not higher")  # fmt: skip

    def finish(self) -> list[Violation]:
        self.end_steps()
        return self.violations


_EVENTS = {
    "capacity": _Checker.capacity,
    "transition": _Checker.transition,
    "wait": _Checker.wait,
    "waitEnd": _Checker.wait_end,
    "turn": _Checker.turn,
}


def check(lines: Iterable[Mapping[str, Any]]) -> list[Violation]:
    """The violations of the log's lines, in the order found.

    Raises `LogFormatError` (numbering the lines from 1) for a line that breaks the format.
    """
    c = _Checker()
    for n, raw in enumerate(lines, start=1):
        c.line(n, raw)
    return c.finish()


def _read(path: Path) -> Iterator[tuple[int, object]]:
    with path.open(encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
                continue
            try:
                yield n, json.loads(text)
            except json.JSONDecodeError as err:
                if not text.endswith("\n"):
                    # Every writer ends a line with a newline: this one stopped part-way.
                    raise LogFormatError(
                        n,
                        f"the last line is cut short (not JSON: {err.msg} at column "
                        f"{err.colno}, and no newline): the log is truncated; check a "
                        "complete copy, or drop the partial line to check the rest",
                    ) from None
                raise LogFormatError(n, f"not JSON: {err.msg} at column {err.colno}") from None


def check_file(path: Path | str) -> list[Violation]:
    """`check` over a JSON-lines file; blank lines are skipped but still counted.

    Raises `LogFormatError` for a malformed or cut-short line, or a log with no line at all
    (an empty log proves nothing: it must not read as every invariant holding), and `OSError`
    for an unreadable file.
    """
    c = _Checker()
    lines = 0
    try:
        for n, raw in _read(Path(path)):
            c.line(n, raw)
            lines += 1
    except UnicodeDecodeError as err:
        raise LogFormatError(0, f"not UTF-8 text: {err.reason}") from None
    if lines == 0:
        raise LogFormatError(
            0,
            "the log is empty: no line to check, so nothing is shown to hold; is it the "
            "operator's --transition-log file, and has a grant changed since it started?",
        )
    return c.finish()


# --- the command -----------------------------------------------------------------------------
