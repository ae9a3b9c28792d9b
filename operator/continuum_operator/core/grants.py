"""Grants of one engine's KV pool: the allocator, pure and with the clock injected.

A mind takes turns on an engine only while it holds a grant, one slot of the pool in tokens
(slots are uniform: docs/design.md). `allocate` takes the ledger as it stands, the minds that want
grants, the engine's phase and capacity, the slot releases the engine gateway reported and the
time, and returns the ledger that should hold with every transition that gets there, each with
its reason. The operator writes the result to the Engine's `status.grants`; the simulator
replays it in virtual time; `continuum check-log` checks its log from outside.

Rule 7 in code:
- A reclaim is two-phase: `Granted -> Reclaiming` with a grace deadline, then `Released` when
  the gateway reports the slot erased (`SlotReleased`) or at the deadline (`GraceExpired`). Only
  a released slot is reused. The mind is requeued at once, keeping her place.
- Higher priority preempts lower; minds already reclaiming count toward what preemptors need,
  so no slot is reclaimed that nobody is waiting for. A grant younger than its mind's
  protection window is not preempted, nor a mind reclaimed within that window.
- An engine changing size or relaunching drains: every grant is reclaimed (the lowest ranked
  beyond the new size with `EngineShrunk`, the rest `EngineRelaunching`), protection windows
  notwithstanding, because llama.cpp cannot resize a KV buffer in place. Queued minds wait
  with the engine's reason: `EngineRelaunching` (it served before), `EngineStarting` (it never
  has yet), `EngineUnschedulable` (no node takes it).
- A mind asking more than a slot holds is refused with `ContextTooLarge`, never squeezed; one
  asking more than her class allows (`MindClass.maxTokens`) with `ClassLimit`. A grant holds
  the slot's tokens, or her class's limit where that is smaller.

Tenancy (docs/tenancy.md): `quota_left` is what each namespace's minds may hold on this engine
(its TokenQuota less what it holds on other engines). A queued mind whose grant would take her
namespace past it stays `Queued` with `QuotaExceeded`: she is not granted, preempts nobody and
blocks nobody behind her. Tokens held are those of `Granted` and `Reclaiming` grants; a quota
lowered below use reclaims nothing (only new grants are held back).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

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
    QUOTA_EXCEEDED = "QuotaExceeded"
    SLOT_RELEASED = "SlotReleased"
    GRACE_EXPIRED = "GraceExpired"
    REQUEUED = "Requeued"


# Refusals: the mind holds nothing until her spec (or her class, or the engine) changes.
REFUSALS = frozenset({GrantReason.CONTEXT_TOO_LARGE, GrantReason.CLASS_LIMIT})

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
    """A mind that wants a grant: its class's priority, window and token limit, and her place
    in line. `name` is "namespace/name" (her namespace is what a token quota counts)."""

    name: str
    priority: int
    arrival: float
    context_tokens: int
    protection_window: float = 300.0
    max_tokens: int | None = None  # her class's limit; None: the slot's size

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


@dataclass(frozen=True, slots=True)
class Policy:
    # None is the seed's broken order: a reclaim with no deadline, waiting for the turn to end.
    grace_seconds: float | None = 30.0
    # Deliberately broken policies, kept as switches so tests can show the checker flags them.
    honour_protection: bool = True
    count_reclaiming: bool = True


_HOLDING = (GrantState.GRANTED, GrantState.RECLAIMING)


class _Step:
    """One allocation pass: a mutable working copy of the ledger and the transitions made."""

    def __init__(
        self,
        grants: Mapping[str, Grant],
        minds: Mapping[str, MindDemand],
        now: float,
        quota_left: Mapping[str, int] | None = None,
    ) -> None:
        self.grants = dict(grants)
        self.minds = minds
        self.now = now
        self.quota_left = quota_left or {}
        self.transitions: list[Transition] = []

    def held(self, namespace: str) -> int:
        """Tokens the namespace's minds hold on this engine now (Granted and Reclaiming)."""
        return sum(
            g.tokens
            for g in self.grants.values()
            if g.state in _HOLDING and g.mind.partition("/")[0] == namespace
        )

    def over_quota(self, m: MindDemand, tokens: int, reserved: Mapping[str, int]) -> bool:
        """Whether granting her `tokens` would take her namespace past what it may hold here
        (`reserved`: tokens promised to minds of the namespace waiting for a reclaim)."""
        left = self.quota_left.get(m.namespace)
        if left is None:
            return False
        return self.held(m.namespace) + reserved.get(m.namespace, 0) + tokens > left

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
        old = self.grants.get(mind)
        demand = self.minds.get(mind)
        newly_granted = to is GrantState.GRANTED and (old is None or old.state is not to)
        if demand is not None:
            priority, window = demand.priority, demand.protection_window
        else:
            priority, window = (old.priority, old.protection_window) if old else (0, 0.0)
        new = Grant(
            mind=mind,
            state=to,
            reason=reason,
            since=self.now,
            tokens=tokens,
            slot=slot,
            by=by,
            deadline=deadline,
            granted_at=self.now if newly_granted else (old.granted_at if old else None),
            reclaimed_at=self.now
            if to is GrantState.RECLAIMING
            else (old.reclaimed_at if old else None),
            priority=priority,
            protection_window=window,
        )
        self.transitions.append(
            Transition(
                at=self.now,
                mind=mind,
                from_state=old.state if old else None,
                to_state=to,
                reason=reason,
                tokens=tokens,
                slot=slot,
                priority=priority,
                protection_window=window,
                by=by,
                deadline=deadline,
            )
        )
        if to is GrantState.RELEASED and (demand is None or reason is GrantReason.MIND_DELETED):
            self.grants.pop(mind, None)
        else:
            self.grants[mind] = new
        return new

    def release(self, mind: str, reason: GrantReason) -> None:
        """Reclaiming -> Released, then back in line if she still wants a grant."""
        self.move(mind, GrantState.RELEASED, reason)
        if mind in self.minds:
            self.move(mind, GrantState.QUEUED, GrantReason.REQUEUED)


def allocate(
    grants: Mapping[str, Grant],
    minds: Iterable[MindDemand],
    capacity: Capacity,
    now: float,
    *,
    released: Collection[str] = (),
    policy: Policy = Policy(),
    quota_left: Mapping[str, int] | None = None,
) -> Allocation:
    """The ledger that should hold now, and the transitions that get there.

    `quota_left`: by namespace, the most tokens its minds may hold on this engine (absent: no
    limit)."""
    demand = {m.name: m for m in minds}
    step = _Step(grants, demand, now, quota_left)

    # 1. Reclaims that ended: reported by the gateway, or forced at their grace deadline.
    for name in sorted(step.grants):
        g = step.grants[name]
        if g.state is not GrantState.RECLAIMING:
            continue
        if name in released:
            step.release(name, GrantReason.SLOT_RELEASED)
        elif g.deadline is not None and now >= g.deadline:
            step.release(name, GrantReason.GRACE_EXPIRED)

    # 2. Minds that left, and minds new to the ledger.
    for name in sorted(step.grants):
        g = step.grants[name]
        if name in demand:
            continue
        if g.state is GrantState.GRANTED:
            _reclaim(step, g, GrantReason.MIND_DELETED, policy)
        elif g.state is GrantState.RELEASED:
            del step.grants[name]  # refused earlier (a refusal): it holds nothing
        elif g.state is not GrantState.RECLAIMING:
            step.move(name, GrantState.RELEASED, GrantReason.MIND_DELETED)
    for name in sorted(demand, key=lambda n: demand[n].rank()):
        entry = step.grants.get(name)
        refusal = demand[name].refusal(capacity.tokens_per_slot)
        if entry is None:
            if refusal is not None:
                step.move(name, GrantState.RELEASED, refusal)
            else:
                step.move(name, GrantState.QUEUED, GrantReason.ARRIVED)
        elif entry.state is GrantState.RELEASED and entry.reason in REFUSALS:
            if refusal is None:
                step.move(name, GrantState.QUEUED, GrantReason.ARRIVED)
            elif refusal is not entry.reason:
                # Still refused, now for the other reason (her class or the engine changed):
                # back in line and out again, two moves of the transition table.
                step.move(name, GrantState.QUEUED, GrantReason.ARRIVED)
                step.move(name, GrantState.RELEASED, refusal)
        elif refusal is not None and entry.state is GrantState.GRANTED:
            _reclaim(step, entry, refusal, policy)
        elif refusal is not None and entry.state is GrantState.QUEUED:
            step.move(name, GrantState.RELEASED, refusal)

    if capacity.phase is EnginePhase.SERVING:
        _serve(step, capacity, policy)
    else:
        _drain(step, capacity, policy)
    review = _review_at(step, capacity, policy)
    return Allocation(step.grants, tuple(step.transitions), review)


def _review_at(step: _Step, capacity: Capacity, policy: Policy) -> float | None:
    times = [
        g.deadline
        for g in step.grants.values()
        if g.state is GrantState.RECLAIMING and g.deadline is not None
    ]
    queued = [
        step.minds[g.mind]
        for g in step.grants.values()
        if g.state is GrantState.QUEUED and g.mind in step.minds
    ]
    if capacity.phase is EnginePhase.SERVING and queued and policy.honour_protection:
        top = max(m.priority for m in queued)
        for g in step.grants.values():
            m = step.minds.get(g.mind)
            if g.state is not GrantState.GRANTED or m is None or m.priority >= top:
                continue
            ends = [
                t + m.protection_window
                for t in (g.granted_at, g.reclaimed_at)
                if t is not None and t + m.protection_window > step.now
            ]
            if ends:
                times.append(max(ends))
    later = [t for t in times if t > step.now]
    return min(later) if later else None


def _reclaim(
    step: _Step, g: Grant, reason: GrantReason, policy: Policy, by: str | None = None
) -> None:
    step.move(
        g.mind,
        GrantState.RECLAIMING,
        reason,
        tokens=g.tokens,
        slot=g.slot,
        by=by,
        deadline=None if policy.grace_seconds is None else step.now + policy.grace_seconds,
    )


def _queued(step: _Step) -> list[MindDemand]:
    return sorted(
        (step.minds[n] for n, g in step.grants.items() if g.state is GrantState.QUEUED),
        key=MindDemand.rank,
    )


def _set_wait_reason(step: _Step, names: Iterable[str], reason: GrantReason) -> None:
    for name in names:
        if step.grants[name].reason is not reason:
            step.move(name, GrantState.QUEUED, reason)


def _drain(step: _Step, capacity: Capacity, policy: Policy) -> None:
    """A relaunch or resize: reclaim every grant, the lowest ranked beyond the new size first."""
    if capacity.phase is EnginePhase.DRAINING:
        granted = sorted(
            (g for g in step.grants.values() if g.state is GrantState.GRANTED),
            key=lambda g: step.minds[g.mind].rank(),
        )
        keep = capacity.target_slots if capacity.target_slots is not None else capacity.slots
        holders_ranked = sorted(
            (g for g in step.grants.values() if g.state in _HOLDING and g.mind in step.minds),
            key=lambda g: step.minds[g.mind].rank(),
        )
        survivors = {g.mind for g in holders_ranked[:keep]}
        for g in reversed(granted):
            reason = (
                GrantReason.ENGINE_RELAUNCHING if g.mind in survivors else GrantReason.ENGINE_SHRUNK
            )
            _reclaim(step, g, reason, policy)
    wait = _WAIT_REASONS.get(capacity.phase, GrantReason.ENGINE_RELAUNCHING)
    _set_wait_reason(step, (m.name for m in _queued(step)), wait)


def _protected(g: Grant, m: MindDemand, now: float) -> bool:
    # Written as `start + window` so the end agrees, to the bit, with `review_at`'s wake-up.
    young = g.granted_at is not None and now < g.granted_at + m.protection_window
    recently_reclaimed = g.reclaimed_at is not None and now < g.reclaimed_at + m.protection_window
    return young or recently_reclaimed


def _serve(step: _Step, capacity: Capacity, policy: Policy) -> None:
    holders = [g for g in step.grants.values() if g.state in _HOLDING]
    taken = {g.slot for g in holders}
    free_slots = [s for s in range(capacity.slots) if s not in taken]
    # Slots beyond the engine's size (left from before a relaunch) move to free ones.
    for g in sorted(holders, key=lambda g: g.mind):
        if (
            g.state is GrantState.GRANTED
            and (g.slot is None or g.slot >= capacity.slots)
            and free_slots
        ):
            m = step.minds.get(g.mind)
            step.move(
                g.mind,
                GrantState.GRANTED,
                GrantReason.SLOT_MOVED,
                tokens=m.grant_tokens(capacity.tokens_per_slot) if m else g.tokens,
                slot=free_slots.pop(0),
            )

    # Free slots to the queue in order; a mind her namespace's quota holds back is passed
    # over (the slot goes to whoever is behind her) and preempts nobody.
    over_quota: list[MindDemand] = []
    for m in _queued(step):
        if not free_slots:
            break
        tokens = m.grant_tokens(capacity.tokens_per_slot)
        if step.over_quota(m, tokens, {}):
            over_quota.append(m)
            continue
        step.move(
            m.name, GrantState.GRANTED, GrantReason.SLOT_FREE, tokens=tokens, slot=free_slots.pop(0)
        )
    # Of the rest, those whose grant the quota would refuse once a slot frees wait for it, not
    # for a slot; the others keep their order. Tokens promised to minds waiting for a reclaim
    # count against their namespace, so one free slot is not promised past the quota twice.
    reserved: dict[str, int] = {}
    queue: list[MindDemand] = []
    for m in _queued(step):
        if m in over_quota:
            continue
        tokens = m.grant_tokens(capacity.tokens_per_slot)
        if step.over_quota(m, tokens, reserved):
            over_quota.append(m)
            continue
        queue.append(m)
        if m.namespace in step.quota_left:
            reserved[m.namespace] = reserved.get(m.namespace, 0) + tokens

    # Slots already being reclaimed will come free: the first of the queue wait for those.
    reclaiming = sum(1 for g in step.grants.values() if g.state is GrantState.RECLAIMING)
    covered = reclaiming if policy.count_reclaiming else 0
    waiting_for_reclaim = queue[:covered]
    uncovered = queue[covered:]

    # The rest may preempt, highest first, each taking the lowest-ranked unprotected grant of
    # strictly lower priority.
    victims = sorted(
        (g for g in step.grants.values() if g.state is GrantState.GRANTED and g.mind in step.minds),
        key=lambda g: step.minds[g.mind].rank(),
        reverse=True,
    )
    still_waiting: list[MindDemand] = []
    for m in uncovered:
        victim = next(
            (
                g
                for g in victims
                if step.minds[g.mind].priority < m.priority
                and not (policy.honour_protection and _protected(g, step.minds[g.mind], step.now))
            ),
            None,
        )
        if victim is None:
            still_waiting.append(m)
            continue
        victims.remove(victim)
        _reclaim(step, victim, GrantReason.PREEMPTED, policy, by=m.name)
        waiting_for_reclaim.append(m)

    _set_wait_reason(step, (m.name for m in waiting_for_reclaim), GrantReason.WAITING_FOR_RECLAIM)
    _set_wait_reason(step, (m.name for m in still_waiting), GrantReason.POOL_FULL)
    _set_wait_reason(step, (m.name for m in over_quota), GrantReason.QUOTA_EXCEEDED)
