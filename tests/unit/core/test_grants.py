"""The grant allocator, behaviour by behaviour (docs/design.md rule 7)."""

from __future__ import annotations

from collections.abc import Iterable

from continuum_operator.core.broken_policies import ReclaimsUncounted
from continuum_operator.core.grants import (
    Allocation,
    Capacity,
    EnginePhase,
    Grant,
    GrantReason,
    MindDemand,
    PriorityPolicy,
    allocate,
)
from continuum_operator.model.mind import GrantState

G, Q, R, X = GrantState.GRANTED, GrantState.QUEUED, GrantState.RECLAIMING, GrantState.RELEASED
SERVING = EnginePhase.SERVING


def cap(
    slots: int, tokens: int = 1000, phase: EnginePhase = SERVING, target: int | None = None
) -> Capacity:
    return Capacity(phase, slots, tokens, target)


def mind(
    name: str, priority: int = 0, arrival: float = 0.0, context: int = 500, window: float = 60.0
) -> MindDemand:
    return MindDemand(name, priority, arrival, context, window)


def states(a: Allocation) -> dict[str, GrantState]:
    return {name: g.state for name, g in a.grants.items()}


def run(
    grants: dict[str, Grant],
    minds: Iterable[MindDemand],
    capacity: Capacity,
    now: float,
    **kw: object,
) -> Allocation:
    return allocate(grants, list(minds), capacity, now, **kw)  # type: ignore[arg-type]


def test_a_mind_arriving_to_a_free_slot_is_granted_at_once_with_the_slots_tokens() -> None:
    a = run({}, [mind("a")], cap(2), 0.0)
    g = a.grants["a"]
    assert (g.state, g.reason, g.tokens, g.slot) == (G, GrantReason.SLOT_FREE, 1000, 0)
    assert [(t.from_state, t.to_state) for t in a.transitions] == [(None, Q), (Q, G)]


def test_minds_beyond_the_slots_queue_by_priority_then_arrival_with_their_reason() -> None:
    minds = [mind("late-high", 5, 3.0), mind("early-low", 0, 1.0), mind("early-high", 5, 2.0)]
    a = run({}, minds, cap(1), 0.0)
    assert states(a) == {"early-high": G, "late-high": Q, "early-low": Q}
    assert a.grants["late-high"].reason is GrantReason.POOL_FULL


def test_no_two_minds_hold_the_same_slot() -> None:
    a = run({}, [mind(f"m{i}", arrival=i) for i in range(5)], cap(3), 0.0)
    slots = [g.slot for g in a.grants.values() if g.state is G and g.slot is not None]
    assert sorted(slots) == [0, 1, 2]


def test_a_higher_priority_mind_preempts_the_lowest_unprotected_grant_and_keeps_her_place() -> None:
    first = run({}, [mind("low-a", 0, 0.0), mind("low-b", 0, 1.0)], cap(2), 0.0)
    later = run(
        first.grants,
        [mind("low-a", 0, 0.0), mind("low-b", 0, 1.0), mind("vip", 9, 100.0)],
        cap(2),
        100.0,
    )
    victim = later.grants["low-b"]  # arrived last among equals: ranked lowest
    assert (victim.state, victim.reason, victim.by) == (R, GrantReason.PREEMPTED, "vip")
    assert victim.deadline == 100.0 + PriorityPolicy().grace_seconds
    assert later.grants["low-a"].state is G
    assert (later.grants["vip"].state, later.grants["vip"].reason) == (
        Q,
        GrantReason.WAITING_FOR_RECLAIM,
    )


def test_a_grant_younger_than_its_protection_window_is_not_preempted() -> None:
    first = run({}, [mind("low", window=60.0)], cap(1), 0.0)
    later = run(first.grants, [mind("low", window=60.0), mind("vip", 9, 10.0)], cap(1), 30.0)
    assert states(later) == {"low": G, "vip": Q}
    assert later.grants["vip"].reason is GrantReason.POOL_FULL
    after_window = run(later.grants, [mind("low", window=60.0), mind("vip", 9, 10.0)], cap(1), 60.0)
    assert after_window.grants["low"].state is R


def test_equal_priority_never_preempts() -> None:
    first = run({}, [mind("a")], cap(1), 0.0)
    later = run(first.grants, [mind("a"), mind("b", arrival=1.0)], cap(1), 10_000.0)
    assert states(later) == {"a": G, "b": Q}


def test_minds_already_reclaiming_count_toward_what_preemptors_need() -> None:
    minds = [mind("l1", 0, 0.0), mind("l2", 0, 1.0), mind("l3", 0, 2.0)]
    a = run({}, minds, cap(3), 0.0)
    a = run(a.grants, [*minds, mind("v1", 9, 100.0)], cap(3), 100.0)
    assert sum(g.state is R for g in a.grants.values()) == 1
    # A second allocation with nothing new changes nothing: the reclaim in flight covers v1.
    again = run(a.grants, [*minds, mind("v1", 9, 100.0)], cap(3), 101.0)
    assert sum(g.state is R for g in again.grants.values()) == 1
    assert again.transitions == ()
    # A second preemptor takes exactly one more victim.
    two = run(again.grants, [*minds, mind("v1", 9, 100.0), mind("v2", 9, 101.0)], cap(3), 102.0)
    assert sum(g.state is R for g in two.grants.values()) == 2


def test_the_broken_policy_that_ignores_reclaiming_minds_reclaims_needlessly() -> None:
    minds = [mind("l1", 0, 0.0), mind("l2", 0, 1.0), mind("l3", 0, 2.0), mind("v1", 9, 100.0)]
    a = run({}, minds[:3], cap(3), 0.0)
    a = run(a.grants, minds, cap(3), 100.0)
    broken = run(a.grants, minds, cap(3), 101.0, policy=ReclaimsUncounted(PriorityPolicy()))
    assert sum(g.state is R for g in broken.grants.values()) == 2


def test_a_released_slot_is_requeued_and_goes_to_the_preemptor() -> None:
    minds = [mind("low", 0, 0.0), mind("vip", 9, 100.0)]
    a = run({}, minds[:1], cap(1), 0.0)
    a = run(a.grants, minds, cap(1), 100.0)
    b = run(a.grants, minds, cap(1), 101.0, released={"low"})
    reasons = [(t.mind, t.to_state, t.reason) for t in b.transitions]
    assert reasons[:3] == [
        ("low", X, GrantReason.SLOT_RELEASED),
        ("low", Q, GrantReason.REQUEUED),
        ("vip", G, GrantReason.SLOT_FREE),
    ]
    assert b.grants["low"].state is Q


def test_a_reclaim_is_forced_at_its_grace_deadline() -> None:
    minds = [mind("low", 0, 0.0), mind("vip", 9, 100.0)]
    a = run({}, minds[:1], cap(1), 0.0)
    a = run(a.grants, minds, cap(1), 100.0)
    deadline = a.grants["low"].deadline
    assert deadline is not None
    early = run(a.grants, minds, cap(1), deadline - 0.001)
    assert early.grants["low"].state is R
    forced = run(a.grants, minds, cap(1), deadline)
    assert forced.transitions[0].reason is GrantReason.GRACE_EXPIRED
    assert forced.grants["vip"].state is G


def test_a_mind_reclaimed_within_its_window_is_not_reclaimed_again() -> None:
    g = Grant("low", G, GrantReason.SLOT_FREE, since=0.0, tokens=1000, slot=0,
              granted_at=0.0, reclaimed_at=90.0)  # fmt: skip
    a = run({"low": g}, [mind("low", window=60.0), mind("vip", 9, 95.0)], cap(1), 100.0)
    assert a.grants["low"].state is G


def test_a_draining_engine_reclaims_everyone_the_lowest_beyond_the_new_size_as_shrunk() -> None:
    minds = [mind("a", 5, 0.0), mind("b", 1, 1.0), mind("c", 1, 2.0)]
    a = run({}, minds, cap(3), 0.0)
    d = run(
        a.grants, minds, cap(3, phase=EnginePhase.DRAINING, target=1), 1.0
    )  # protection ignored
    reasons = {n: g.reason for n, g in d.grants.items()}
    assert all(g.state is R for g in d.grants.values())
    assert reasons == {
        "a": GrantReason.ENGINE_RELAUNCHING,
        "b": GrantReason.ENGINE_SHRUNK,
        "c": GrantReason.ENGINE_SHRUNK,
    }
    # Lowest ranked first.
    assert [t.mind for t in d.transitions if t.to_state is R] == ["c", "b", "a"]


def test_nothing_is_granted_while_the_engine_relaunches_and_the_queue_says_why() -> None:
    a = run({}, [mind("a")], cap(1, phase=EnginePhase.RELAUNCHING), 0.0)
    assert a.grants["a"].state is Q
    assert a.grants["a"].reason is GrantReason.ENGINE_RELAUNCHING
    served = run(a.grants, [mind("a")], cap(1), 20.0)
    assert served.grants["a"].state is G


def test_a_mind_asking_more_than_a_slot_holds_is_refused_never_squeezed() -> None:
    a = run({}, [mind("big", context=5000)], cap(4, tokens=4096), 0.0)
    assert (a.grants["big"].state, a.grants["big"].reason) == (X, GrantReason.CONTEXT_TOO_LARGE)
    assert all(g.tokens in (0, 4096) for g in a.grants.values())
    bigger = run(a.grants, [mind("big", context=5000)], cap(4, tokens=8192), 1.0)
    assert bigger.grants["big"].state is G


def test_a_deleted_mind_gives_back_her_slot_through_a_reclaim_and_leaves_the_ledger() -> None:
    a = run({}, [mind("a"), mind("b", arrival=1.0)], cap(1), 0.0)
    gone = run(a.grants, [mind("b", arrival=1.0)], cap(1), 5.0)
    assert (gone.grants["a"].state, gone.grants["a"].reason) == (R, GrantReason.MIND_DELETED)
    done = run(gone.grants, [mind("b", arrival=1.0)], cap(1), 6.0, released={"a"})
    assert "a" not in done.grants
    assert done.grants["b"].state is G
    queued_then_gone = run(done.grants, [], cap(1), 7.0)
    assert queued_then_gone.grants["b"].state is R


def test_the_same_inputs_give_the_same_allocation() -> None:
    minds = [mind(f"m{i}", i % 3, float(i)) for i in range(12)]
    assert run({}, minds, cap(5), 0.0) == run({}, list(reversed(minds)), cap(5), 0.0)


def test_a_mind_parked_idle_gives_her_slot_to_the_first_waiting_and_keeps_her_place() -> None:
    # Ann holds the one slot, inside her protection window, equal in priority to Bob who
    # waits: nothing would preempt her. Parked idle, her slot goes to Bob.
    first = run({}, [mind("ann", window=600.0)], cap(1), 0.0)
    minds = [mind("ann", window=600.0), mind("bob", arrival=1.0)]
    waiting = run(first.grants, minds, cap(1), 10.0)
    assert states(waiting) == {"ann": G, "bob": Q}
    idle = run(waiting.grants, minds, cap(1), 11.0, idle={"ann"})
    ann = idle.grants["ann"]
    assert (ann.state, ann.reason, ann.by) == (R, GrantReason.PARKED, "bob")
    assert idle.grants["bob"].reason is GrantReason.WAITING_FOR_RECLAIM
    # The gateway reports her slot released: Bob is granted it; she waits, idle, behind him.
    after = run(idle.grants, minds, cap(1), 12.0, released={"ann"}, idle={"ann"})
    assert states(after) == {"ann": Q, "bob": G}
    assert after.grants["ann"].reason is GrantReason.POOL_FULL
    # A slot frees beside Cy, who came after her: while she is idle it is Cy's; once she asks
    # again (no longer idle) she has her place back, before Cy.
    more = [*minds, mind("cy", arrival=2.0)]
    assert states(run(after.grants, more, cap(2), 13.0, idle={"ann"}))["cy"] is G
    assert states(run(after.grants, more, cap(2), 13.0)) == {"ann": G, "bob": G, "cy": Q}


def test_a_mind_parked_idle_keeps_her_slot_while_nobody_waits() -> None:
    first = run({}, [mind("ann"), mind("bob", arrival=1.0)], cap(2), 0.0)
    idle = run(first.grants, [mind("ann"), mind("bob", arrival=1.0)], cap(2), 1.0, idle={"ann"})
    assert states(idle) == {"ann": G, "bob": G} and idle.transitions == ()
