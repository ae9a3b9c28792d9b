"""Tenancy in the allocator (docs/tenancy.md): a class's token limit, a namespace's token quota
over several engines, and quota-held minds that neither preempt nor block those behind them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from hypothesis import given, settings
from hypothesis import strategies as st

from continuum_operator.checklog import check
from continuum_operator.core.grants import (
    Allocation,
    Capacity,
    EnginePhase,
    Grant,
    GrantReason,
    MindDemand,
    allocate,
)
from continuum_operator.kube.ledger import grant_ledger
from continuum_operator.model.mind import GrantState

G, Q, R, X = GrantState.GRANTED, GrantState.QUEUED, GrantState.RECLAIMING, GrantState.RELEASED


def cap(slots: int, tokens: int = 1000) -> Capacity:
    return Capacity(EnginePhase.SERVING, slots, tokens)


def mind(
    name: str,
    priority: int = 0,
    arrival: float = 0.0,
    context: int = 500,
    max_tokens: int | None = None,
    window: float = 0.0,
) -> MindDemand:
    return MindDemand(name, priority, arrival, context, window, max_tokens)


def run(
    grants: Mapping[str, Grant],
    minds: Iterable[MindDemand],
    capacity: Capacity,
    now: float,
    quota: Mapping[str, int] | None = None,
) -> Allocation:
    return allocate(grants, list(minds), capacity, now, quota_left=quota)


def held(a: Allocation, namespace: str) -> int:
    return sum(g.tokens for g in a.holders() if g.mind.partition("/")[0] == namespace)


# --- a class's token limit --------------------------------------------------------------------


def test_a_grant_holds_the_class_limit_where_it_is_smaller_than_the_slot() -> None:
    a = run({}, [mind("t/a", context=300, max_tokens=400), mind("t/b")], cap(2), 0.0)
    assert (a.grants["t/a"].state, a.grants["t/a"].tokens) == (G, 400)
    assert a.grants["t/b"].tokens == 1000


def test_a_class_limit_above_the_slot_leaves_the_slots_tokens() -> None:
    a = run({}, [mind("t/a", max_tokens=5000)], cap(1), 0.0)
    assert a.grants["t/a"].tokens == 1000


def test_a_mind_asking_more_than_her_class_allows_is_refused_with_class_limit_not_queued() -> None:
    a = run({}, [mind("t/a", context=800, max_tokens=400)], cap(1), 0.0)
    g = a.grants["t/a"]
    assert (g.state, g.reason, g.tokens, g.slot) == (X, GrantReason.CLASS_LIMIT, 0, None)
    assert [t.to_state for t in a.transitions] == [X]


def test_a_granted_mind_whose_class_shrinks_below_her_ask_is_reclaimed_with_class_limit() -> None:
    first = run({}, [mind("t/a", context=800)], cap(1), 0.0)
    later = run(first.grants, [mind("t/a", context=800, max_tokens=400)], cap(1), 10.0)
    g = later.grants["t/a"]
    assert (g.state, g.reason) == (R, GrantReason.CLASS_LIMIT)


def test_a_refused_mind_is_queued_again_once_her_class_allows_her() -> None:
    first = run({}, [mind("t/a", context=800, max_tokens=400)], cap(1), 0.0)
    later = run(first.grants, [mind("t/a", context=800, max_tokens=900)], cap(1), 1.0)
    g = later.grants["t/a"]
    assert (g.state, g.tokens) == (G, 900)


def test_a_refused_mind_refused_for_the_other_reason_says_the_new_one() -> None:
    first = run({}, [mind("t/a", context=800, max_tokens=400)], cap(1), 0.0)
    later = run(first.grants, [mind("t/a", context=800)], cap(1, tokens=600), 1.0)
    assert later.grants["t/a"].reason is GrantReason.CONTEXT_TOO_LARGE
    assert [(t.from_state, t.to_state) for t in later.transitions] == [(X, Q), (Q, X)]


# --- a namespace's token quota ----------------------------------------------------------------


def test_a_queued_mind_over_her_namespaces_quota_waits_with_quota_exceeded() -> None:
    minds = [mind("t/a", arrival=0), mind("t/b", arrival=1)]
    a = run({}, minds, cap(3), 0.0, {"t": 1500})
    assert a.grants["t/a"].state is G
    assert (a.grants["t/b"].state, a.grants["t/b"].reason) == (Q, GrantReason.QUOTA_EXCEEDED)
    assert held(a, "t") == 1000


def test_a_quota_held_mind_does_not_block_the_minds_behind_her() -> None:
    minds = [mind("t/a", arrival=0), mind("t/big", arrival=1), mind("u/c", arrival=2)]
    small = mind("t/small", arrival=3, context=100, max_tokens=200)
    a = run({}, [*minds, small], cap(4), 0.0, {"t": 1300})
    assert a.grants["t/big"].reason is GrantReason.QUOTA_EXCEEDED
    # Behind her: a mind of another namespace, and one of hers small enough to fit the quota.
    assert a.grants["u/c"].state is G
    assert (a.grants["t/small"].state, a.grants["t/small"].tokens) == (G, 200)
    assert held(a, "t") == 1200


def test_a_quota_held_mind_preempts_nobody_even_above_every_holder() -> None:
    first = run({}, [mind("u/low")], cap(1), 0.0)
    vip = mind("t/vip", priority=9, arrival=5)
    later = run(first.grants, [mind("u/low"), vip], cap(1), 10.0, {"t": 0})
    assert later.grants["u/low"].state is G
    assert later.grants["t/vip"].reason is GrantReason.QUOTA_EXCEEDED
    assert not any(t.reason is GrantReason.PREEMPTED for t in later.transitions)


def test_a_quota_counts_reclaiming_grants_as_held() -> None:
    first = run({}, [mind("t/a"), mind("u/b", arrival=1)], cap(2), 0.0)
    vip = mind("u/vip", priority=9, arrival=2)
    preempting = run(first.grants, [mind("t/a"), mind("u/b", arrival=1), vip], cap(2), 1.0)
    assert preempting.grants["u/b"].state is R
    # While u/b's slot is being reclaimed, u holds 1000 (reclaiming); a quota of 1500 has no
    # room for u/vip's promised grant on top of it, and none is made.
    minds = [mind("t/a"), mind("u/b", arrival=1), vip]
    a = run(preempting.grants, minds, cap(2), 2.0, {"u": 1500})
    assert a.grants["u/vip"].reason is GrantReason.QUOTA_EXCEEDED
    assert held(a, "u") == 1000


def test_the_quota_left_by_other_engines_is_what_this_engine_may_grant() -> None:
    # The namespace holds 1500 of its 2000 on another engine: 500 are left here.
    minds = [mind("t/a", context=100, max_tokens=600), mind("t/b", context=100, max_tokens=400)]
    a = run({}, minds, cap(2), 0.0, {"t": 500})
    assert a.grants["t/a"].reason is GrantReason.QUOTA_EXCEEDED
    assert (a.grants["t/b"].state, a.grants["t/b"].tokens) == (G, 400)


def test_a_quota_lowered_below_use_reclaims_nothing() -> None:
    first = run({}, [mind("t/a"), mind("t/b", arrival=1)], cap(2), 0.0)
    later = run(first.grants, [mind("t/a"), mind("t/b", arrival=1)], cap(2), 5.0, {"t": 100})
    assert {n: g.state for n, g in later.grants.items()} == {"t/a": G, "t/b": G}
    assert later.transitions == ()


def test_a_quota_held_mind_is_granted_once_her_namespace_releases_tokens() -> None:
    minds = [mind("t/a"), mind("t/b", arrival=1)]
    first = run({}, minds, cap(2), 0.0, {"t": 1000})
    assert first.grants["t/b"].reason is GrantReason.QUOTA_EXCEEDED
    later = run(first.grants, [mind("t/b", arrival=1)], cap(2), 1.0, {"t": 1000})
    # t/a left: her grant is reclaimed (still held) ...
    assert later.grants["t/a"].state is R and later.grants["t/b"].state is Q
    done = allocate(
        later.grants,
        [mind("t/b", arrival=1)],
        cap(2),
        2.0,
        released={"t/a"},
        quota_left={"t": 1000},
    )
    # ... and once released, t/b is granted within the quota.
    assert done.grants["t/b"].state is G
    assert held(done, "t") == 1000


def test_quota_held_waits_pass_the_transition_log_checker() -> None:
    minds = [mind("t/a"), mind("t/b", arrival=1), mind("u/c", arrival=2)]
    a = run({}, minds, cap(3), 0.0, {"t": 1000})
    assert a.grants["t/b"].reason is GrantReason.QUOTA_EXCEEDED
    pool = grant_ledger.GrantPool(cap(3), "launch")
    s = grant_ledger.LedgerStep(a.grants, ((pool, a.transitions),), [], True, None)
    lines = grant_ledger.log_lines(0.0, "ns/e", None, s)
    # A free slot stays while t/b is queued: the checker does not call that a violation, since
    # the quota holds her.
    assert check(lines) == []


# --- the property: a namespace within its quota stays within it -------------------------------


@st.composite
def steps(draw: st.DrawFn) -> list[tuple[list[MindDemand], frozenset[str], int]]:
    names = [f"{ns}/m{i}" for ns in ("t", "u") for i in range(4)]
    out = []
    for _ in range(draw(st.integers(1, 8))):
        present = draw(st.lists(st.sampled_from(names), unique=True, max_size=8))
        minds = [
            mind(
                n,
                priority=draw(st.integers(0, 3)),
                arrival=float(names.index(n)),
                context=100,
                max_tokens=draw(st.sampled_from([None, 200, 700])),
            )
            for n in present
        ]
        released = frozenset(draw(st.lists(st.sampled_from(names), unique=True, max_size=3)))
        out.append((minds, released, draw(st.integers(0, 3))))
    return out


@settings(max_examples=200, deadline=None)
@given(steps(), st.integers(0, 3000), st.integers(0, 3000))
def test_a_namespace_within_its_quota_never_exceeds_it_after_a_step(
    script: list[tuple[list[MindDemand], frozenset[str], int]], t_quota: int, u_quota: int
) -> None:
    quota = {"t": t_quota, "u": u_quota}
    grants: dict[str, Grant] = {}
    for i, (minds, released, _) in enumerate(script):
        before = {ns: sum(g.tokens for g in grants.values() if g.state in (G, R)
                          and g.mind.startswith(ns + "/")) for ns in quota}  # fmt: skip
        a = allocate(grants, minds, cap(3), float(i * 40), released=released, quota_left=quota)
        for ns, limit in quota.items():
            if before[ns] <= limit:
                assert held(a, ns) <= limit, (ns, limit, a.grants)
        grants = a.grants
