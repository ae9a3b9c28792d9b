"""The allocator against its plain statement (bench/grants_reference.py, the allocator as it was
before the second scale pass): the fast path sorts the minds once and filters, walks the
preemption victims with one cursor, keeps each namespace's held tokens as it moves and makes its
Grants and Transitions by setting their slots, and must answer what the reference answers,
transition for transition, on random runs of steps."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace

import pytest
from bench.grants_reference import Policy as ReferencePolicy
from bench.grants_reference import allocate as reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum_operator.core.broken_policies import weakened
from continuum_operator.core.grants import (
    Capacity,
    EnginePhase,
    Grant,
    GrantPolicy,
    MindDemand,
    PriorityPolicy,
    allocate,
)
from continuum_operator.model.mind import GrantState

NAMES = [f"{ns}/{n}" for ns in ("a", "b", "c") for n in ("p", "q", "r", "s", "t")]


@st.composite
def demands(draw: st.DrawFn) -> list[MindDemand]:
    names = draw(st.lists(st.sampled_from(NAMES), unique=True, max_size=12))
    return [
        MindDemand(
            name,
            priority=draw(st.integers(0, 3)),
            # Few distinct arrivals, so ties fall to the name.
            arrival=draw(st.sampled_from([0.0, 1.0, 2.5, 7.0])),
            context_tokens=draw(st.sampled_from([100, 500, 1000, 2000])),
            protection_window=draw(st.sampled_from([0.0, 5.0, 60.0])),
            max_tokens=draw(st.sampled_from([None, None, 400, 800, 1500])),
        )
        for name in names
    ]


@st.composite
def capacities(draw: st.DrawFn) -> Capacity:
    return Capacity(
        # Serving most of the time: it is where the queue, quotas and preemption are.
        draw(st.sampled_from([EnginePhase.SERVING] * 4 + list(EnginePhase))),
        slots=draw(st.integers(0, 6)),
        tokens_per_slot=draw(st.sampled_from([800, 1000, 2000])),
        target_slots=draw(st.one_of(st.none(), st.integers(0, 6))),
    )


@st.composite
def quotas(draw: st.DrawFn) -> dict[str, int] | None:
    if draw(st.booleans()):
        return None
    return draw(st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 4000)))


@st.composite
def policies(draw: st.DrawFn) -> tuple[GrantPolicy, ReferencePolicy]:
    """A policy and the reference's switches that answer as it does."""
    grace = draw(st.sampled_from([None, 3.0, 30.0]))
    protection, count_reclaiming = draw(st.booleans()), draw(st.booleans())
    policy = weakened(
        30.0 if grace is None else grace,
        protection=protection,
        count_reclaiming=count_reclaiming,
        grace_deadline=grace is not None,
    )
    if grace is not None and protection and count_reclaiming:
        assert policy == PriorityPolicy(grace)  # the operator's own
    return policy, ReferencePolicy(grace, protection, count_reclaiming)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(
        st.tuples(
            demands(),
            capacities(),
            quotas(),
            st.sampled_from([0.0, 1.0, 4.0, 30.0, 61.0]),  # time to the step
            st.lists(st.sampled_from(NAMES), max_size=6),  # releases reported
        ),
        min_size=1,
        max_size=8,
    ),
    policies(),
)
def test_the_allocator_answers_as_its_reference_on_random_runs(
    steps: list[tuple[list[MindDemand], Capacity, dict[str, int] | None, float, list[str]]],
    policies: tuple[GrantPolicy, ReferencePolicy],
) -> None:
    policy, switches = policies
    ledger: dict[str, Grant] = {}
    now = 0.0
    for minds, capacity, quota, dt, released in steps:
        now += dt
        got = allocate(
            ledger, minds, capacity, now, released=set(released), policy=policy, quota_left=quota
        )
        want = reference(
            ledger, minds, capacity, now, released=set(released), policy=switches, quota_left=quota
        )
        assert got.transitions == want.transitions
        assert got.grants == want.grants
        assert list(got.grants) == list(want.grants)  # the same order, as the writer sees it
        assert got.review_at == want.review_at
        ledger = got.grants


def test_the_reference_is_still_exercised_on_a_preemption_with_a_quota() -> None:
    # A fixed case where every branch the fast path changed runs: a quota skip, a preemption
    # past a protected grant, a slot beyond the pool moved, and a release requeued.
    def m(name: str, priority: int, arrival: float) -> MindDemand:
        return MindDemand(name, priority, arrival, 500, 60.0)

    low = [m("a/p", 0, 0.0), m("a/q", 0, 1.0), m("b/p", 0, 2.0)]
    first = allocate({}, low, Capacity(EnginePhase.SERVING, 3, 1000), 0.0)
    ledger = dict(first.grants)
    # a/q's slot beyond a smaller pool: it must move.
    ledger["a/q"] = Grant("a/q", GrantState.GRANTED, first.grants["a/q"].reason, 0.0, 1000, 5)
    minds = [*low, m("a/vip", 3, 5.0), m("b/vip", 3, 6.0), m("c/vip", 2, 7.0)]
    for now in (10.0, 100.0):
        args = (ledger, minds, Capacity(EnginePhase.SERVING, 3, 1000), now)
        kw: dict[str, object] = {"quota_left": {"a": 2000}, "released": {"b/p"}}
        got = allocate(*args, **kw)  # type: ignore[arg-type]
        want = reference(*args, **kw)  # type: ignore[arg-type]
        assert (got.transitions, got.grants, got.review_at) == (
            want.transitions,
            want.grants,
            want.review_at,
        )
        ledger = got.grants
    reasons = {str(t.reason) for t in got.transitions}
    assert {"Preempted", "QuotaExceeded"} <= reasons | {str(g.reason) for g in got.grants.values()}


def test_the_grants_and_transitions_a_step_makes_are_the_dataclasses_own() -> None:
    # The step sets their slots directly rather than through `__init__`: the objects must be
    # what the constructor makes, equal, hashing alike and as frozen.
    a = allocate(
        {}, [MindDemand("a/p", 1, 0.0, 500, 60.0)], Capacity(EnginePhase.SERVING, 1, 1000), 5.0
    )
    g = a.grants["a/p"]
    assert g == Grant(
        "a/p", GrantState.GRANTED, g.reason, 5.0, 1000, 0, None, None, 5.0, None, 1, 60.0
    )
    assert hash(g) == hash(replace(g))
    assert repr(g) == repr(replace(g))
    t = a.transitions[-1]
    assert t == replace(t) and hash(t) == hash(replace(t))
    with pytest.raises(FrozenInstanceError):
        g.state = GrantState.QUEUED  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        t.tokens = 1  # type: ignore[misc]
