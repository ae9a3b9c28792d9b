"""The grant allocator as it was before the second scale pass (commit 247c309), kept verbatim
but for its imports and its `Policy`: the reference `bench/grants.py` times beside the real one,
and the property test (tests/unit/core/test_grants_reference.py) compares the two on random ledgers.
The data types are the real module's, so the two answers compare field by field. `Policy` is
the switches the allocator took then; the real one takes a `GrantPolicy`, and
`core.broken_policies.weakened` makes the one that answers as the same switches.

Do not optimise this file: it is the plain statement the fast path must agree with.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from continuum_operator.core.grants import (
    _WAIT_REASONS,
    REFUSALS,
    Allocation,
    Capacity,
    EnginePhase,
    Grant,
    GrantReason,
    MindDemand,
    Transition,
)
from continuum_operator.model.mind import GrantState

_HOLDING = (GrantState.GRANTED, GrantState.RECLAIMING)


@dataclass(frozen=True, slots=True)
class Policy:
    grace_seconds: float | None = 30.0  # None: a reclaim has no deadline
    honour_protection: bool = True
    count_reclaiming: bool = True


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
    """A line for each queued mind whose reason changed, or whose class did."""
    for name in names:
        g, d = step.grants[name], step.minds.get(name)
        edited = d is not None and (g.priority, g.protection_window) != (
            d.priority,
            d.protection_window,
        )
        if g.reason is not reason or edited:
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
        _set_wait_reason(step, [m.name], GrantReason.WAITING_FOR_RECLAIM)  # her line first
        _reclaim(step, victim, GrantReason.PREEMPTED, policy, by=m.name)
        waiting_for_reclaim.append(m)

    _set_wait_reason(step, (m.name for m in waiting_for_reclaim), GrantReason.WAITING_FOR_RECLAIM)
    _set_wait_reason(step, (m.name for m in still_waiting), GrantReason.POOL_FULL)
    _set_wait_reason(step, (m.name for m in over_quota), GrantReason.QUOTA_EXCEEDED)
