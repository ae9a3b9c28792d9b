"""The allocator's policy seam (`GrantPolicy`): a new policy is a small class the allocator
follows, and the operator's policy (`PriorityPolicy`, the default) answers as before. Field for
field against the allocator as it was: test_grants_reference.py."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from continuum_operator.checklog import check
from continuum_operator.core.broken_policies import (
    NoGraceDeadline,
    ReclaimsUncounted,
    UnprotectedPolicy,
    weakened,
)
from continuum_operator.core.grants import (
    Allocation,
    Capacity,
    EnginePhase,
    Grant,
    GrantPolicy,
    GrantReason,
    MindDemand,
    PriorityPolicy,
    RankKey,
    allocate,
)
from continuum_operator.core.simulate import EngineScenario, MindScenario, Scenario, simulate
from continuum_operator.model.mind import GrantState

G, Q, R = GrantState.GRANTED, GrantState.QUEUED, GrantState.RECLAIMING


def cap(slots: int) -> Capacity:
    return Capacity(EnginePhase.SERVING, slots, 1000)


def mind(
    name: str, priority: int = 0, arrival: float = 0.0, max_tokens: int | None = None
) -> MindDemand:
    return MindDemand(name, priority, arrival, 100, protection_window=60.0, max_tokens=max_tokens)


def states(a: Allocation) -> dict[str, tuple[GrantState, GrantReason]]:
    return {name: (g.state, g.reason) for name, g in a.grants.items()}


@dataclass(frozen=True, slots=True)
class FirstComeFirstServed:
    """Served in arrival order whatever the priority; nobody is preempted."""

    def rank(self, mind: MindDemand) -> RankKey:
        return (mind.arrival, mind.name)

    def reclaim_deadline(self, now: float) -> float:
        return now + 30.0

    def served_by_reclaims(self, reclaiming: int) -> int:
        return reclaiming

    def preemptions(
        self, queue: Sequence[MindDemand], granted: Sequence[tuple[MindDemand, Grant]], now: float
    ) -> list[tuple[MindDemand, Grant]]:
        return []

    def preemptible_at(
        self,
        queued: Sequence[MindDemand],
        ledger: Iterable[Grant],
        minds: Mapping[str, MindDemand],
        now: float,
    ) -> float | None:
        return None


@dataclass(frozen=True, slots=True)
class LargestVictimFirst(PriorityPolicy):
    """The operator's policy, but a preemptor takes the grant holding the most tokens among
    those it may take (then the lowest ranked)."""

    def preemptions(
        self, queue: Sequence[MindDemand], granted: Sequence[tuple[MindDemand, Grant]], now: float
    ) -> list[tuple[MindDemand, Grant]]:
        free = list(granted)
        pairs: list[tuple[MindDemand, Grant]] = []
        for m in queue:
            takeable = [
                i
                for i, (vm, vg) in enumerate(free)
                if vm.priority < m.priority and not self.protected(vg, vm, now)
            ]
            if takeable:
                at = max(takeable, key=lambda i: (free[i][1].tokens, i))
                pairs.append((m, free.pop(at)[1]))
        return pairs


def test_a_policy_serving_in_arrival_order_is_followed_by_the_allocator() -> None:
    minds = [mind("late-vip", 9, 5.0), mind("early", 0, 1.0), mind("middle", 0, 3.0)]
    policy: GrantPolicy = FirstComeFirstServed()
    a = allocate({}, minds, cap(1), 0.0, policy=policy)
    assert states(a) == {
        "early": (G, GrantReason.SLOT_FREE),
        "middle": (Q, GrantReason.POOL_FULL),
        "late-vip": (Q, GrantReason.POOL_FULL),  # no preemption, even past the window
    }
    later = allocate(a.grants, minds, cap(1), 1000.0, policy=policy)
    assert later.transitions == () and later.review_at is None
    # The slot freed goes to who came next, not to the higher priority.
    b = allocate(later.grants, minds, cap(2), 1001.0, policy=policy)
    assert states(b)["middle"] == (G, GrantReason.SLOT_FREE)
    # The operator's policy serves the priority first, and preempts once the window lapses.
    default = allocate({}, minds, cap(1), 0.0)
    assert states(default)["late-vip"] == (G, GrantReason.SLOT_FREE)


def test_a_policy_choosing_its_victims_by_tokens_is_followed_by_the_allocator() -> None:
    small, large = mind("small", 0, 1.0, max_tokens=400), mind("large", 0, 0.0, max_tokens=900)
    first = allocate({}, [small, large], cap(2), 0.0)
    assert {g.mind: g.tokens for g in first.holders()} == {"small": 400, "large": 900}
    minds = [small, large, mind("vip", 9, 100.0)]
    # The operator's policy takes the lowest ranked (the later arrival) ...
    default = allocate(first.grants, minds, cap(2), 100.0)
    assert {n for n, (s, _) in states(default).items() if s is R} == {"small"}
    # ... this one the largest grant.
    largest = allocate(first.grants, minds, cap(2), 100.0, policy=LargestVictimFirst())
    assert {n for n, (s, _) in states(largest).items() if s is R} == {"large"}
    assert largest.grants["large"].by == "vip"
    assert states(largest)["vip"] == (Q, GrantReason.WAITING_FOR_RECLAIM)


@dataclass(frozen=True, slots=True)
class CountingPolicy(PriorityPolicy):
    """The operator's policy, counting how often the allocator asks it."""

    calls: dict[str, int] = field(default_factory=dict)

    def count(self, what: str) -> None:
        self.calls[what] = self.calls.get(what, 0) + 1

    def rank(self, mind: MindDemand) -> RankKey:
        self.count("rank")
        return mind.rank()

    def preemptions(
        self, queue: Sequence[MindDemand], granted: Sequence[tuple[MindDemand, Grant]], now: float
    ) -> list[tuple[MindDemand, Grant]]:
        self.count("preemptions")
        return PriorityPolicy.preemptions(self, queue, granted, now)

    def preemptible_at(
        self,
        queued: Sequence[MindDemand],
        ledger: Iterable[Grant],
        minds: Mapping[str, MindDemand],
        now: float,
    ) -> float | None:
        self.count("preemptible_at")
        return PriorityPolicy.preemptible_at(self, queued, ledger, minds, now)


def test_the_allocator_asks_the_policy_once_a_mind_and_once_a_step() -> None:
    low = [mind(f"low{i}", 0, float(i)) for i in range(8)]
    high = [mind(f"high{i}", 5, 100.0 + i) for i in range(8)]
    first = allocate({}, low, cap(8), 0.0)
    counting = CountingPolicy()
    a = allocate(first.grants, low + high, cap(8), 100.0, policy=counting)
    assert counting.calls == {"rank": 16, "preemptions": 1, "preemptible_at": 1}
    assert a == allocate(first.grants, low + high, cap(8), 100.0)


def test_the_default_policy_is_the_operators_and_answers_as_before() -> None:
    low = [mind("a/low", 0, 0.0), mind("b/low", 0, 1.0)]
    minds = [*low, mind("a/vip", 9, 2.0), mind("b/vip", 9, 3.0)]
    first = allocate({}, low, cap(2), 0.0)
    for now in (10.0, 70.0):  # inside the protection window, then past it
        implicit = allocate(first.grants, minds, cap(2), now, quota_left={"b": 1000})
        explicit = allocate(
            first.grants, minds, cap(2), now, policy=PriorityPolicy(30.0), quota_left={"b": 1000}
        )
        assert implicit == explicit
    # b/vip is held back by b's quota; a/vip takes the lowest ranked grant, b/low's.
    assert states(implicit) == {
        "a/low": (G, GrantReason.SLOT_FREE),
        "b/low": (R, GrantReason.PREEMPTED),
        "a/vip": (Q, GrantReason.WAITING_FOR_RECLAIM),
        "b/vip": (Q, GrantReason.QUOTA_EXCEEDED),
    }
    assert implicit.grants["b/low"].deadline == 100.0
    # Within the window it was a wake-up at the window's end instead.
    inside = allocate(first.grants, minds, cap(2), 10.0)
    assert inside.review_at == 60.0 and all(s is not R for s, _ in states(inside).values())


def test_each_broken_policy_is_the_operators_with_one_safeguard_off() -> None:
    assert weakened(30.0) == PriorityPolicy(30.0)
    assert weakened(5.0, protection=False) == UnprotectedPolicy(5.0)
    assert weakened(5.0, count_reclaiming=False) == ReclaimsUncounted(PriorityPolicy(5.0))
    assert weakened(5.0, grace_deadline=False) == NoGraceDeadline(PriorityPolicy(5.0))
    both = weakened(5.0, protection=False, grace_deadline=False)
    assert both == NoGraceDeadline(UnprotectedPolicy(5.0))

    low, vip = mind("low", 0, 0.0), mind("vip", 9, 1.0)
    first = allocate({}, [low], cap(1), 0.0)
    protected = allocate(first.grants, [low, vip], cap(1), 10.0)
    assert states(protected)["low"] == (G, GrantReason.SLOT_FREE)
    unprotected = allocate(first.grants, [low, vip], cap(1), 10.0, policy=both)
    assert states(unprotected)["low"] == (R, GrantReason.PREEMPTED)
    assert unprotected.grants["low"].deadline is None
    assert unprotected.review_at is None


def test_protection_ends_with_the_later_window_and_both_questions_read_that_end() -> None:
    low, vip = mind("low", 0, 0.0), mind("vip", 9, 1.0)  # windows of 60 s
    reclaimed = Grant(
        "low", G, GrantReason.SLOT_FREE, 30.0, tokens=100, slot=0, granted_at=0.0,
        reclaimed_at=30.0,
    )  # fmt: skip
    policy = PriorityPolicy()
    assert policy.protected_until(reclaimed, low, 10.0) == 90.0
    assert policy.protected(reclaimed, low, 89.0) and not policy.protected(reclaimed, low, 90.0)
    assert policy.preemptible_at([vip], [reclaimed], {"low": low}, 10.0) == 90.0
    unprotected = UnprotectedPolicy()
    assert not unprotected.protected(reclaimed, low, 10.0)
    assert unprotected.preemptible_at([vip], [reclaimed], {"low": low}, 10.0) is None


def test_a_new_policy_runs_through_the_simulator_and_the_checker_judges_it() -> None:
    # Two minds hold the engine; an urgent one arrives after their protection windows.
    minds = (
        MindScenario("low0", "e", priority=0, protection_window=60.0, arrive=0.0),
        MindScenario("low1", "e", priority=0, protection_window=60.0, arrive=1.0),
        MindScenario("urgent", "e", priority=9, arrive=300.0, turn_deadline_seconds=600.0),
    )
    scenario = Scenario((EngineScenario("e", 2, 4096),), minds, duration=900.0)
    assert check(simulate(scenario).log) == []
    arrival_order = replace(scenario, policy=FirstComeFirstServed())
    # Never preempting, it leaves the urgent mind behind unprotected grants of lower priority.
    assert {v.invariant for v in check(simulate(arrival_order).log)} == {6}
