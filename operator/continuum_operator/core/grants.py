"""Grants of one engine's KV pool: the allocator, pure and with the clock injected.

A mind takes turns on an engine only while it holds a grant, one slot of the pool in tokens
(slots are uniform: docs/design.md). `allocate` takes the ledger as it stands, the minds that want
grants, the engine's phase and capacity, the slot releases the engine gateway reported and the
time, and returns the ledger that should hold with every transition that gets there, each with
its reason. The operator writes the result to the Engine's GrantLedger (`status.grants`); the
simulator replays it in virtual time; `continuum check-log` checks its log from outside.

Rule 7 in code:
- A reclaim is two-phase: `Granted -> Reclaiming` with a grace deadline, then `Released` when
  the gateway reports the slot erased (`SlotReleased`) or at the deadline (`GraceExpired`). Only
  a released slot is reused. The mind is requeued at once, keeping her place.
- Higher priority preempts lower; minds already reclaiming count toward what preemptors need,
  so no slot is reclaimed that nobody is waiting for. A grant younger than its mind's
  protection window is not preempted, nor a mind reclaimed within that window. These are the
  decisions of `PriorityPolicy`, the operator's `GrantPolicy`: another policy (an order, a
  choice of victims) is another implementation of that protocol, passed to `allocate`.
- A mind the gateway parked idle at her own ask (`idle`) gives her slot to a mind waiting,
  before anyone is preempted and whatever her protection window (`Parked`); queued and still
  idle, she is served after everyone else and preempts nobody.
- An engine changing size or relaunching drains: every grant is reclaimed (the lowest ranked
  beyond the new size with `EngineShrunk`, the rest `EngineRelaunching`), protection windows
  notwithstanding, because llama.cpp cannot resize a KV buffer in place. Queued minds wait
  with the engine's reason: `EngineRelaunching` (it served before), `EngineStarting` (it never
  has yet), `EngineUnschedulable` (no node takes it).
- A mind asking more than a slot holds is refused with `ContextTooLarge`, never squeezed; one
  asking more than her class allows (`MindClass.maxTokens`) with `ClassLimit`. A grant holds
  the slot's tokens, or her class's limit where that is smaller.
- A mind of a namespace her class (named, or the default) does not allow
  (`MindClass.allowedNamespaces`) is refused with `ClassNotAllowed`, whatever admission let
  through: a class made after her, or narrowed since, is checked at every step, and a grant
  she holds is reclaimed.

Tenancy (docs/tenancy.md): `quota_left` is what each namespace's minds may hold on this engine
(its TokenQuota less what it holds on other engines). A queued mind whose grant would take her
namespace past it stays `Queued` with `QuotaExceeded`: she is not granted, preempts nobody and
blocks nobody behind her. Tokens held are those of `Granted` and `Reclaiming` grants; a quota
lowered below use reclaims nothing (only new grants are held back).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from enum import StrEnum
from typing import Protocol, cast

from continuum_operator.model.mind import GrantState


class GrantReason(StrEnum):
    ARRIVED = "Arrived"
    POOL_FULL = "PoolFull"
    WAITING_FOR_RECLAIM = "WaitingForReclaim"
    ENGINE_RELAUNCHING = "EngineRelaunching"
    # Queued while the engine has never served: placed, its pod not ready yet; or no node
    # takes it (its Ready condition says why).
    ENGINE_STARTING = "EngineStarting"
    ENGINE_UNSCHEDULABLE = "EngineUnschedulable"
    SLOT_FREE = "SlotFree"
    SLOT_MOVED = "SlotMoved"
    PREEMPTED = "Preempted"
    ENGINE_SHRUNK = "EngineShrunk"
    MIND_DELETED = "MindDeleted"
    CONTEXT_TOO_LARGE = "ContextTooLarge"
    CLASS_LIMIT = "ClassLimit"
    CLASS_NOT_ALLOWED = "ClassNotAllowed"
    QUOTA_EXCEEDED = "QuotaExceeded"
    SLOT_RELEASED = "SlotReleased"
    GRACE_EXPIRED = "GraceExpired"
    REQUEUED = "Requeued"
    # Reclaimed from a mind whose context the gateway parked when she went idle (her own ask),
    # for a mind waiting: her slot holds nothing of hers, so a long pause costs her no slot.
    PARKED = "Parked"


# Refusals: the mind holds nothing until her spec (or her class, or the engine) changes.
REFUSALS = frozenset(
    {GrantReason.CONTEXT_TOO_LARGE, GrantReason.CLASS_LIMIT, GrantReason.CLASS_NOT_ALLOWED}
)

# Reclaims the engine forces on everyone; they ignore protection windows.
ENGINE_REASONS = frozenset({GrantReason.ENGINE_SHRUNK, GrantReason.ENGINE_RELAUNCHING})


class EnginePhase(StrEnum):
    SERVING = "Serving"
    DRAINING = "Draining"
    RELAUNCHING = "Relaunching"  # served before; its process is coming back
    STARTING = "Starting"  # never served yet: placed (or about to be), pod not ready
    UNSCHEDULABLE = "Unschedulable"  # no node takes it as it is (its Ready condition says why)


# Why a queued mind waits on an engine that is not serving, by the engine's phase.
_WAIT_REASONS: Mapping[EnginePhase, GrantReason] = {
    EnginePhase.STARTING: GrantReason.ENGINE_STARTING,
    EnginePhase.UNSCHEDULABLE: GrantReason.ENGINE_UNSCHEDULABLE,
}


@dataclass(frozen=True, slots=True)
class Capacity:
    """The engine's pool as the allocator sees it.

    `slots` is what the running engine has; while `Draining`, `target_slots` is what its
    successor will have (the minds ranked beyond it are the ones `EngineShrunk`).
    """

    phase: EnginePhase
    slots: int
    tokens_per_slot: int
    target_slots: int | None = None


@dataclass(frozen=True, slots=True)
class MindDemand:
    """A mind that wants a grant: its class's priority, window, token limit and namespaces, and
    her place in line. `name` is "namespace/name" (her namespace is what a token quota counts,
    and what her class's `class_namespaces` must hold)."""

    name: str
    priority: int
    arrival: float
    context_tokens: int
    protection_window: float = 300.0
    max_tokens: int | None = None  # her class's limit; None: the slot's size
    # The namespaces her class allows (MindClass.allowedNamespaces); None: every namespace.
    class_namespaces: frozenset[str] | None = None

    @property
    def namespace(self) -> str:
        return self.name.partition("/")[0]

    def grant_tokens(self, tokens_per_slot: int) -> int:
        """The tokens a grant of hers holds: the slot's, or her class's limit if smaller."""
        if self.max_tokens is None:
            return tokens_per_slot
        return min(tokens_per_slot, self.max_tokens)

    def refusal(self, tokens_per_slot: int) -> GrantReason | None:
        """Why she can never be granted on this pool as she asks, or None."""
        if self.class_namespaces is not None and self.namespace not in self.class_namespaces:
            return GrantReason.CLASS_NOT_ALLOWED
        if self.max_tokens is not None and self.context_tokens > self.max_tokens:
            return GrantReason.CLASS_LIMIT
        if self.context_tokens > tokens_per_slot:
            return GrantReason.CONTEXT_TOO_LARGE
        return None

    def rank(self) -> tuple[int, float, str]:
        """Sort key: higher priority first, then who came first (then name, for determinism)."""
        return (-self.priority, self.arrival, self.name)


@dataclass(frozen=True, slots=True)
class Grant:
    """One mind's entry in the ledger."""

    mind: str
    state: GrantState
    reason: GrantReason
    since: float
    tokens: int = 0
    slot: int | None = None
    by: str | None = None
    deadline: float | None = None  # Reclaiming: the grace deadline
    granted_at: float | None = None
    reclaimed_at: float | None = None  # when its last reclaim began
    # The mind's class when last seen: a mind that left keeps them in its last transitions.
    priority: int = 0
    protection_window: float = 0.0


@dataclass(frozen=True, slots=True)
class Transition:
    at: float
    mind: str
    from_state: GrantState | None
    to_state: GrantState
    reason: GrantReason
    tokens: int
    slot: int | None
    priority: int
    protection_window: float
    by: str | None = None
    deadline: float | None = None


@dataclass(frozen=True, slots=True)
class Allocation:
    grants: dict[str, Grant]
    transitions: tuple[Transition, ...]
    # When the answer changes with no event: a grace deadline falls due, or a protection window
    # ends under a grant that a queued mind of higher priority could then preempt. The caller
    # must run `allocate` again by then (a timer in the operator, an event in the simulator).
    review_at: float | None = None

    def holders(self) -> list[Grant]:
        return [g for g in self.grants.values() if g.state in _HOLDING]


# A mind's place in line: minds are served in ascending order of it.
RankKey = tuple[float | str, ...]


class GrantPolicy(Protocol):
    """What an allocation policy decides: the order the queue is served in, who preempts whom, how
    many of the queue wait for slots already being reclaimed, and a reclaim's grace deadline.
    The allocator keeps the rest of rule 7 (refusals, quotas, slots, drains, two-phase reclaims).

    The allocator calls `rank` once a mind and the others once a step, never once a comparison.
    """

    def rank(self, mind: MindDemand) -> RankKey:
        """Her sort key, best first. Unique to her (ending with her name, say): the step sorts
        the minds once and takes every ordered subset it needs as a filter of that order."""
        ...

    def reclaim_deadline(self, now: float) -> float | None:
        """When a reclaim begun at `now` is forced (`GraceExpired`); None: never, only the
        gateway's report of the slot released ends it."""
        ...

    def served_by_reclaims(self, reclaiming: int) -> int:
        """How many of the queue, first first, wait for the `reclaiming` slots already being
        reclaimed (`WaitingForReclaim`) instead of preempting."""
        ...

    def preemptions(
        self, queue: Sequence[MindDemand], granted: Sequence[tuple[MindDemand, Grant]], now: float
    ) -> list[tuple[MindDemand, Grant]]:
        """Which of `queue` (no free slot for them, best ranked first) preempt which of
        `granted` (the Granted grants with their minds, best ranked first): pairs of preemptor
        and victim, each victim once, in the order the reclaims are made. The rest of the queue
        waits with `PoolFull`."""
        ...

    def preemptible_at(
        self,
        queued: Sequence[MindDemand],
        ledger: Iterable[Grant],
        minds: Mapping[str, MindDemand],
        now: float,
    ) -> float | None:
        """The earliest instant after `now` at which, nothing else changing, a Granted grant of
        the `ledger` becomes one that `preemptions` would take for a mind of `queued` (not
        empty), or None. The allocator asks to run again then (`Allocation.review_at`). Both in
        no particular order; `minds`: every mind of the step by name. (The ledger as it is, not
        pairs as `preemptions` has: this runs on every step with a queue.)"""
        ...


@dataclass(frozen=True, slots=True)
class PriorityPolicy:
    """The operator's policy (rule 7): higher priority first, then who came first; a preemptor
    takes the lowest-ranked grant of strictly lower priority that is outside its mind's
    protection window; the slots already being reclaimed are counted toward the first of the
    queue, so no slot is reclaimed that nobody is waiting for; a reclaim is forced after
    `grace_seconds`."""

    grace_seconds: float = 30.0

    # The mind's own sort key, called directly (the step sorts every mind by it, and a wrapper
    # would be a second call each); typed as any policy's rank, so a subclass may rank by another.
    rank = staticmethod(cast("Callable[[MindDemand], RankKey]", MindDemand.rank))

    def reclaim_deadline(self, now: float) -> float:
        return now + self.grace_seconds

    def served_by_reclaims(self, reclaiming: int) -> int:
        return reclaiming

    def protected_until(self, g: Grant, m: MindDemand, now: float) -> float | None:
        """While her grant is too young to preempt, or she was reclaimed too recently: when that
        protection ends (the later of the windows still running). None: she may be preempted
        at `now`. The one place protection is decided: `protected` (which `preemptions` asks)
        and `preemptible_at` both read it, so they agree to the bit, and a policy with other
        windows overrides only this."""
        window = m.protection_window
        until: float | None = None
        for start in (g.granted_at, g.reclaimed_at):
            if start is not None:
                end = start + window
                if end > now and (until is None or end > until):
                    until = end
        return until

    def protected(self, g: Grant, m: MindDemand, now: float) -> bool:
        """Whether her grant is too young to preempt, or she was reclaimed too recently."""
        return self.protected_until(g, m, now) is not None

    def preemptions(
        self, queue: Sequence[MindDemand], granted: Sequence[tuple[MindDemand, Grant]], now: float
    ) -> list[tuple[MindDemand, Grant]]:
        # `queue` is in this policy's rank order, so each preemptor's priority is at most the
        # one before's: a grant passed over (priority too high, or protected) is passed over by
        # all that follow, and one cursor walks the victims, lowest ranked first, once for the
        # queue. (A subclass ranking by anything else than priority first needs its own walk.)
        victims = granted[::-1]
        protected = self.protected
        pairs: list[tuple[MindDemand, Grant]] = []
        at, end = 0, len(victims)
        for m in queue:
            while at < end:
                vm, vg = victims[at]
                if vm.priority < m.priority and not protected(vg, vm, now):
                    break
                at += 1
            if at == end:
                break
            pairs.append((m, victims[at][1]))
            at += 1
        return pairs

    def preemptible_at(
        self,
        queued: Sequence[MindDemand],
        ledger: Iterable[Grant],
        minds: Mapping[str, MindDemand],
        now: float,
    ) -> float | None:
        top = queued[0].priority
        for q in queued:
            if q.priority > top:
                top = q.priority
        protected_until = self.protected_until
        later: float | None = None
        for g in ledger:
            if g.state is not _GRANTED:
                continue
            m = minds.get(g.mind)
            if m is None or m.priority >= top:
                continue
            end = protected_until(g, m, now)
            if end is not None and (later is None or end < later):
                later = end
        return later


# The states as module globals: reading an enum member off its class goes through the enum's
# metaclass (about 70 ns in 3.11, a global about 5), and the step tests a state per mind several
# times over.
_GRANTED, _QUEUED = GrantState.GRANTED, GrantState.QUEUED
_RECLAIMING, _RELEASED = GrantState.RECLAIMING, GrantState.RELEASED
_HOLDING = (_GRANTED, _RECLAIMING)

# Every move of a step makes a Grant and a Transition, and a frozen dataclass's `__init__` sets
# each field through `object.__setattr__`: about 3.3 us the two, most of a move (50,000 minds
# arriving are 82,000 moves). `_grant` and `_transition` make the same objects (equal, and as
# frozen) by setting their slots directly, in about 1.3 us the two. Their parameters are the
# fields in order, checked against the class at import, so a field added or moved fails here
# rather than silently.
_Setter = Callable[[object, object], None]


def _slot_setters(cls: type, names: tuple[str, ...]) -> tuple[_Setter, ...]:
    actual = tuple(f.name for f in fields(cls))
    if actual != names:
        raise TypeError(f"{cls.__name__}'s fields are {actual}, not {names}")
    return tuple(getattr(cls, name).__set__ for name in names)


def _grant_maker() -> Callable[
    [
        str,
        GrantState,
        GrantReason,
        float,
        int,
        int | None,
        str | None,
        float | None,
        float | None,
        float | None,
        int,
        float,
    ],
    Grant,
]:
    names = (
        "mind",
        "state",
        "reason",
        "since",
        "tokens",
        "slot",
        "by",
        "deadline",
        "granted_at",
        "reclaimed_at",
        "priority",
        "protection_window",
    )
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11 = _slot_setters(Grant, names)
    new = object.__new__

    def grant(
        mind: str,
        state: GrantState,
        reason: GrantReason,
        since: float,
        tokens: int,
        slot: int | None,
        by: str | None,
        deadline: float | None,
        granted_at: float | None,
        reclaimed_at: float | None,
        priority: int,
        protection_window: float,
    ) -> Grant:
        g = new(Grant)
        s0(g, mind)
        s1(g, state)
        s2(g, reason)
        s3(g, since)
        s4(g, tokens)
        s5(g, slot)
        s6(g, by)
        s7(g, deadline)
        s8(g, granted_at)
        s9(g, reclaimed_at)
        s10(g, priority)
        s11(g, protection_window)
        return g

    return grant


def _transition_maker() -> Callable[
    [
        float,
        str,
        GrantState | None,
        GrantState,
        GrantReason,
        int,
        int | None,
        int,
        float,
        str | None,
        float | None,
    ],
    Transition,
]:
    names = (
        "at",
        "mind",
        "from_state",
        "to_state",
        "reason",
        "tokens",
        "slot",
        "priority",
        "protection_window",
        "by",
        "deadline",
    )
    s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10 = _slot_setters(Transition, names)
    new = object.__new__

    def transition(
        at: float,
        mind: str,
        from_state: GrantState | None,
        to_state: GrantState,
        reason: GrantReason,
        tokens: int,
        slot: int | None,
        priority: int,
        protection_window: float,
        by: str | None,
        deadline: float | None,
    ) -> Transition:
        t = new(Transition)
        s0(t, at)
        s1(t, mind)
        s2(t, from_state)
        s3(t, to_state)
        s4(t, reason)
        s5(t, tokens)
        s6(t, slot)
        s7(t, priority)
        s8(t, protection_window)
        s9(t, by)
        s10(t, deadline)
        return t

    return transition


_grant = _grant_maker()
_transition = _transition_maker()


class _Step:
    """One allocation pass: a mutable working copy of the ledger and the transitions made."""

    def __init__(
        self,
        grants: Mapping[str, Grant],
        minds: Mapping[str, MindDemand],
        now: float,
        quota_left: Mapping[str, int] | None,
        rank: Callable[[MindDemand], RankKey],
    ) -> None:
        self.grants = dict(grants)
        self.minds = minds
        self.now = now
        self.quota_left = quota_left or {}
        self.transitions: list[Transition] = []
        # The minds best ranked first, sorted once: every ordered subset the step needs (the
        # queue, the grants preemption may take) is a filter of it, never a sort of its own. A
        # rank is unique to its mind, so filtering a sorted list gives what sorting the
        # filtered one would.
        self.ranked = sorted(minds.values(), key=rank)
        # Tokens held by namespace: counted on the first quota check, then kept by `move`, so
        # a queue of one namespace does not rescan the ledger for each of its minds.
        self._held: dict[str, int] | None = None

    def held(self, namespace: str) -> int:
        """Tokens the namespace's minds hold on this engine now (Granted and Reclaiming)."""
        if self._held is None:
            held: dict[str, int] = {}
            for g in self.grants.values():
                if g.state in _HOLDING:
                    ns = g.mind.partition("/")[0]
                    held[ns] = held.get(ns, 0) + g.tokens
            self._held = held
        return self._held.get(namespace, 0)

    def over_quota(self, m: MindDemand, tokens: int, reserved: Mapping[str, int]) -> bool:
        """Whether granting her `tokens` would take her namespace past what it may hold here
        (`reserved`: tokens promised to minds of the namespace waiting for a reclaim)."""
        left = self.quota_left.get(m.namespace)
        if left is None:
            return False
        return self.held(m.namespace) + reserved.get(m.namespace, 0) + tokens > left

    def in_state(self, state: GrantState) -> list[tuple[MindDemand, Grant]]:
        """The minds whose grant is in `state`, best ranked first, each with her grant."""
        grants = self.grants
        out = []
        for m in self.ranked:
            g = grants.get(m.name)
            if g is not None and g.state is state:
                out.append((m, g))
        return out

    def move(
        self,
        mind: str,
        to: GrantState,
        reason: GrantReason,
        *,
        tokens: int = 0,
        slot: int | None = None,
        by: str | None = None,
        deadline: float | None = None,
    ) -> Grant:
        now = self.now
        old = self.grants.get(mind)
        demand = self.minds.get(mind)
        if demand is not None:
            priority, window = demand.priority, demand.protection_window
        elif old is not None:
            priority, window = old.priority, old.protection_window
        else:
            priority, window = 0, 0.0
        if old is None:
            from_state = None
            granted_at = now if to is _GRANTED else None
            reclaimed_at = now if to is _RECLAIMING else None
        else:
            from_state = old.state
            newly_granted = to is _GRANTED and from_state is not to
            granted_at = now if newly_granted else old.granted_at
            reclaimed_at = now if to is _RECLAIMING else old.reclaimed_at
        new = _grant(
            mind,
            to,
            reason,
            now,
            tokens,
            slot,
            by,
            deadline,
            granted_at,
            reclaimed_at,
            priority,
            window,
        )
        self.transitions.append(
            _transition(
                now, mind, from_state, to, reason, tokens, slot, priority, window, by, deadline
            )
        )
        gone = to is _RELEASED and (demand is None or reason is GrantReason.MIND_DELETED)
        held = self._held
        if held is not None:
            if old is not None and old.state in _HOLDING:
                ns = old.mind.partition("/")[0]
                held[ns] = held.get(ns, 0) - old.tokens
            if not gone and to in _HOLDING:
                ns = mind.partition("/")[0]
                held[ns] = held.get(ns, 0) + tokens
        if gone:
            self.grants.pop(mind, None)
        else:
            self.grants[mind] = new
        return new

    def release(self, mind: str, reason: GrantReason) -> None:
        """Reclaiming -> Released, then back in line if she still wants a grant."""
        self.move(mind, _RELEASED, reason)
        if mind in self.minds:
            self.move(mind, _QUEUED, GrantReason.REQUEUED)


def allocate(
    grants: Mapping[str, Grant],
    minds: Iterable[MindDemand],
    capacity: Capacity,
    now: float,
    *,
    released: Collection[str] = (),
    policy: GrantPolicy = PriorityPolicy(),
    quota_left: Mapping[str, int] | None = None,
    idle: Collection[str] = (),
) -> Allocation:
    """The ledger that should hold now, and the transitions that get there.

    `policy`: the order the queue is served in and who preempts whom (`GrantPolicy`).
    `quota_left`: by namespace, the most tokens its minds may hold on this engine (absent: no
    limit). `idle`: minds the gateway parked when they went idle and that have sent nothing
    since: their slots go to waiting minds first (`Parked`), before any preemption, and while
    queued they are served after everyone else and preempt nobody."""
    demand = {m.name: m for m in minds}
    step = _Step(grants, demand, now, quota_left, policy.rank)
    ledger = step.grants

    # 1. Reclaims that ended: reported by the gateway, or forced at their grace deadline. Each
    # move touches only its own mind, so choosing the names before the loop changes nothing.
    for name in sorted(n for n, g in ledger.items() if g.state is _RECLAIMING):
        g = ledger[name]
        if name in released:
            step.release(name, GrantReason.SLOT_RELEASED)
        elif g.deadline is not None and now >= g.deadline:
            step.release(name, GrantReason.GRACE_EXPIRED)

    # 2. Minds that left, and minds new to the ledger.
    for name in sorted(n for n in ledger if n not in demand):
        g = ledger[name]
        if g.state is _GRANTED:
            _reclaim(step, g, GrantReason.MIND_DELETED, policy)
        elif g.state is _RELEASED:
            del ledger[name]  # refused earlier (a refusal): it holds nothing
        elif g.state is not _RECLAIMING:
            step.move(name, _RELEASED, GrantReason.MIND_DELETED)
    tokens_per_slot = capacity.tokens_per_slot
    for m in step.ranked:
        name = m.name
        entry = ledger.get(name)
        refusal = m.refusal(tokens_per_slot)
        if entry is None:
            if refusal is not None:
                step.move(name, _RELEASED, refusal)
            else:
                step.move(name, _QUEUED, GrantReason.ARRIVED)
        elif entry.state is _RELEASED and entry.reason in REFUSALS:
            if refusal is None:
                step.move(name, _QUEUED, GrantReason.ARRIVED)
            elif refusal is not entry.reason:
                # Still refused, now for the other reason (her class or the engine changed):
                # back in line and out again, two moves of the transition table.
                step.move(name, _QUEUED, GrantReason.ARRIVED)
                step.move(name, _RELEASED, refusal)
        elif refusal is not None and entry.state is _GRANTED:
            _reclaim(step, entry, refusal, policy)
        elif refusal is not None and entry.state is _QUEUED:
            step.move(name, _RELEASED, refusal)

    if capacity.phase is EnginePhase.SERVING:
        _serve(step, capacity, policy, idle)
    else:
        _drain(step, capacity, policy)
    review = _review_at(step, capacity, policy)
    return Allocation(step.grants, tuple(step.transitions), review)


def _review_at(step: _Step, capacity: Capacity, policy: GrantPolicy) -> float | None:
    now = step.now
    minds = step.minds
    later: float | None = None
    queued: list[MindDemand] = []
    for g in step.grants.values():
        if g.state is _RECLAIMING:
            if (
                g.deadline is not None
                and g.deadline > now
                and (later is None or g.deadline < later)
            ):
                later = g.deadline
        elif g.state is _QUEUED and (m := minds.get(g.mind)) is not None:
            queued.append(m)
    if capacity.phase is EnginePhase.SERVING and queued:
        end = policy.preemptible_at(queued, step.grants.values(), minds, now)
        if end is not None and end > now and (later is None or end < later):
            later = end
    return later


def _reclaim(
    step: _Step, g: Grant, reason: GrantReason, policy: GrantPolicy, by: str | None = None
) -> None:
    step.move(
        g.mind,
        _RECLAIMING,
        reason,
        tokens=g.tokens,
        slot=g.slot,
        by=by,
        deadline=policy.reclaim_deadline(step.now),
    )


def _queued(step: _Step) -> list[MindDemand]:
    return [m for m, _ in step.in_state(_QUEUED)]


def _set_wait_reason(step: _Step, names: Iterable[str], reason: GrantReason) -> None:
    """A line for each queued mind whose reason changed, or whose class did (a priority or a
    protection window edited): the log says what each waits with."""
    for name in names:
        g, d = step.grants[name], step.minds.get(name)
        edited = d is not None and (g.priority, g.protection_window) != (
            d.priority,
            d.protection_window,
        )
        if g.reason is not reason or edited:
            step.move(name, _QUEUED, reason)


def _drain(step: _Step, capacity: Capacity, policy: GrantPolicy) -> None:
    """A relaunch or resize: reclaim every grant, the lowest ranked beyond the new size first."""
    if capacity.phase is EnginePhase.DRAINING:
        granted = [g for _, g in step.in_state(_GRANTED)]
        keep = capacity.target_slots if capacity.target_slots is not None else capacity.slots
        holders_ranked = [
            m.name
            for m in step.ranked
            if (g := step.grants.get(m.name)) is not None and g.state in _HOLDING
        ]
        survivors = set(holders_ranked[:keep])
        for g in reversed(granted):
            reason = (
                GrantReason.ENGINE_RELAUNCHING if g.mind in survivors else GrantReason.ENGINE_SHRUNK
            )
            _reclaim(step, g, reason, policy)
    wait = _WAIT_REASONS.get(capacity.phase, GrantReason.ENGINE_RELAUNCHING)
    _set_wait_reason(step, (m.name for m in _queued(step)), wait)


def _move_stray(
    step: _Step, capacity: Capacity, holders: list[Grant], free_slots: list[int]
) -> None:
    """Slots beyond the engine's size (left from before a relaunch) move to free ones (taken
    from `free_slots`)."""
    stray = [
        g for g in holders if g.state is _GRANTED and (g.slot is None or g.slot >= capacity.slots)
    ]
    for g in sorted(stray, key=lambda g: g.mind):
        if not free_slots:
            break
        m = step.minds.get(g.mind)
        step.move(
            g.mind,
            _GRANTED,
            GrantReason.SLOT_MOVED,
            tokens=m.grant_tokens(capacity.tokens_per_slot) if m else g.tokens,
            slot=free_slots.pop(0),
        )


def _preempt(
    step: _Step, uncovered: list[MindDemand], policy: GrantPolicy, still_waiting: list[MindDemand]
) -> list[MindDemand]:
    """The minds of `uncovered` that preempt a grant, as the policy chooses (each now waits for
    its reclaim); those that do not are appended to `still_waiting`."""
    if not uncovered:
        return []
    pairs = policy.preemptions(uncovered, step.in_state(_GRANTED), step.now)
    if not pairs:
        still_waiting.extend(uncovered)
        return []
    for m, victim in pairs:
        # Her line first, with her priority now: the log's reader judges the reclaim against
        # what it has read of her (a class raised, a quota freed in this very step).
        _set_wait_reason(step, [m.name], GrantReason.WAITING_FOR_RECLAIM)
        _reclaim(step, victim, GrantReason.PREEMPTED, policy, by=m.name)
    preempting = [m for m, _ in pairs]
    if len(preempting) < len(uncovered):
        chosen = {m.name for m in preempting}
        still_waiting.extend(m for m in uncovered if m.name not in chosen)
    return preempting


def _take_idle(
    step: _Step, uncovered: list[MindDemand], policy: GrantPolicy, idle: Collection[str]
) -> list[MindDemand]:
    """The first minds of `uncovered`, each given the slot of a mind parked idle (reclaimed
    `Parked`, whatever her rank or protection window: she asked, and her context is saved);
    the lowest ranked idle mind's first."""
    if not idle or not uncovered:
        return []
    parked = [g for m, g in reversed(step.in_state(_GRANTED)) if m.name in idle]
    served = uncovered[: len(parked)]
    for m, g in zip(served, parked, strict=False):
        _set_wait_reason(step, [m.name], GrantReason.WAITING_FOR_RECLAIM)
        _reclaim(step, g, GrantReason.PARKED, policy, by=m.name)
    return served


def _serve(step: _Step, capacity: Capacity, policy: GrantPolicy, idle: Collection[str]) -> None:
    holders = [g for g in step.grants.values() if g.state in _HOLDING]
    taken = {g.slot for g in holders}
    free_slots = [s for s in range(capacity.slots) if s not in taken]
    _move_stray(step, capacity, holders, free_slots)

    # Free slots to the queue in order; a mind her namespace's quota holds back is passed
    # over (the slot goes to whoever is behind her) and preempts nobody. A mind parked idle
    # (and silent since) is served after everyone else, and preempts nobody either.
    queued = _queued(step)
    if idle:
        queued = [m for m in queued if m.name not in idle] + [m for m in queued if m.name in idle]
    over_quota: list[MindDemand] = []
    granted_now: set[str] = set()
    quota_left = step.quota_left
    for m in queued:
        if not free_slots:
            break
        tokens = m.grant_tokens(capacity.tokens_per_slot)
        if quota_left and step.over_quota(m, tokens, {}):
            over_quota.append(m)
            continue
        step.move(m.name, _GRANTED, GrantReason.SLOT_FREE, tokens=tokens, slot=free_slots.pop(0))
        granted_now.add(m.name)
    # Of the rest, those whose grant the quota would refuse once a slot frees wait for it, not
    # for a slot; the others keep their order. Tokens promised to minds waiting for a reclaim
    # count against their namespace, so one free slot is not promised past the quota twice.
    skip = granted_now.union(m.name for m in over_quota)
    reserved: dict[str, int] = {}
    queue: list[MindDemand] = []
    for m in queued:
        if m.name in skip:
            continue
        if quota_left:
            tokens = m.grant_tokens(capacity.tokens_per_slot)
            if step.over_quota(m, tokens, reserved):
                over_quota.append(m)
                continue
            if m.namespace in quota_left:
                reserved[m.namespace] = reserved.get(m.namespace, 0) + tokens
        queue.append(m)

    # Slots already being reclaimed will come free: the first of the queue wait for those.
    reclaiming = sum(1 for g in step.grants.values() if g.state is _RECLAIMING)
    covered = policy.served_by_reclaims(reclaiming)
    waiting_for_reclaim = queue[:covered]
    uncovered = queue[covered:]

    still_waiting: list[MindDemand] = []
    if idle:
        still_waiting.extend(m for m in uncovered if m.name in idle)
        uncovered = [m for m in uncovered if m.name not in idle]
    took_idle = _take_idle(step, uncovered, policy, idle)
    waiting_for_reclaim.extend(took_idle)
    uncovered = uncovered[len(took_idle) :]
    waiting_for_reclaim.extend(_preempt(step, uncovered, policy, still_waiting))

    _set_wait_reason(step, (m.name for m in waiting_for_reclaim), GrantReason.WAITING_FOR_RECLAIM)
    _set_wait_reason(step, (m.name for m in still_waiting), GrantReason.POOL_FULL)
    _set_wait_reason(step, (m.name for m in over_quota), GrantReason.QUOTA_EXCEEDED)
