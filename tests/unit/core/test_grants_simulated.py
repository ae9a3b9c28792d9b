"""Grants and reclaims simulated in virtual time and judged from outside by `check-log`.

The allocator and the simulator write a transition log; `continuum_operator.checklog`, which
shares no code with them, checks docs/design.md rule 7's invariants over it. Random scenarios must
pass; deliberately broken policies must be caught.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from continuum_operator.checklog import check
from continuum_operator.core.simulate import (
    EngineEvent,
    EngineEventKind,
    EngineScenario,
    MindScenario,
    Scenario,
    simulate,
)
from continuum_operator.scenario import load
from tests.support.builders import EXAMPLES


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    engines = [
        EngineScenario(
            f"e{i}",
            slots=draw(st.integers(min_value=0, max_value=5)),
            tokens_per_slot=draw(st.sampled_from([2048, 4096, 8192])),
            relaunch_seconds=draw(st.floats(min_value=0, max_value=120)),
        )
        for i in range(draw(st.integers(min_value=1, max_value=2)))
    ]
    minds = []
    for i in range(draw(st.integers(min_value=1, max_value=12))):
        arrive = draw(st.floats(min_value=0, max_value=1800))
        leave = draw(st.one_of(st.none(), st.floats(min_value=arrive, max_value=3600)))
        minds.append(
            MindScenario(
                f"m{i}",
                engine=draw(st.sampled_from([e.name for e in engines])),
                priority=draw(st.integers(min_value=0, max_value=3)),
                protection_window=draw(st.sampled_from([0.0, 60.0, 300.0])),
                context_tokens=draw(st.sampled_from([1024, 2048, 4096, 8192, 16384])),
                arrive=arrive,
                leave=leave,
                turn_seconds=draw(st.floats(min_value=1, max_value=300)),
                think_seconds=draw(st.floats(min_value=0, max_value=120)),
                turn_deadline_seconds=draw(st.sampled_from([60.0, 600.0, 1500.0])),
                release_delay_seconds=draw(st.floats(min_value=0, max_value=90)),
            )
        )
    events = [
        EngineEvent(
            draw(st.floats(min_value=0, max_value=3600)),
            draw(st.sampled_from([e.name for e in engines])),
            kind := draw(st.sampled_from(list(EngineEventKind))),
            draw(st.integers(min_value=0, max_value=6)) if kind is EngineEventKind.RESIZE else None,
        )
        for _ in range(draw(st.integers(min_value=0, max_value=4)))
    ]
    return Scenario(
        tuple(engines),
        tuple(minds),
        tuple(events),
        duration=3600.0,
        grace_seconds=draw(st.sampled_from([5.0, 30.0])),
    )


def violations(log: list[dict[str, Any]]) -> list[str]:
    return [f"t={v.t} {v.mind}: {v.invariant} {v.name}: {v.message}" for v in check(log)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_scenarios_keep_every_invariant_of_rule_7(scenario: Scenario) -> None:
    result = simulate(scenario)
    assert violations(result.log) == []


def test_the_example_scenarios_keep_every_invariant() -> None:
    for path in sorted((EXAMPLES / "scenarios").glob("*.yaml")):
        if "old-order" in path.name:
            continue
        assert violations(simulate(load(path)).log) == [], path.name


def _invariants(scenario: Scenario) -> set[int]:
    return {v.invariant for v in check(simulate(scenario).log)}


def test_the_seed_failure_replayed_her_turns_keep_happening() -> None:
    """One mind, reclaims during her turns, a 1,500 s deadline: she never parks to it."""
    new = simulate(load(EXAMPLES / "scenarios" / "seed-one-mind.yaml"))
    old = simulate(load(EXAMPLES / "scenarios" / "seed-one-mind-old-order.yaml"))
    assert check(new.log) == []
    new_waits, old_waits = new.summary["waits"], old.summary["waits"]
    assert all(w["max"] < 60 for w in new_waits.values())
    assert all(w["abandoned"] == 0 for w in new_waits.values())
    # The old order parks her to the deadline after each reclaim during a turn.
    assert old_waits["OwnGrantReclaiming"]["max"] == 1500.0
    assert new.summary["turns"]["completed"] >= 2 * old.summary["turns"]["completed"]
    assert new.summary["reclaims"] == {"EngineRelaunching": 5}


def test_the_old_reclaim_order_is_flagged_by_the_checker() -> None:
    old = load(EXAMPLES / "scenarios" / "seed-one-mind-old-order.yaml")
    assert 3 in _invariants(old)  # a reclaim with no grace deadline, ended by the turn deadline


def _churn(**policy: bool) -> Scenario:
    """Low-priority minds fill the engine; urgent minds come and go, one after another."""
    minds = [
        MindScenario(
            f"bg{i}",
            "e",
            priority=0,
            protection_window=300.0,
            arrive=i,
            turn_seconds=50,
            think_seconds=5,
            release_delay_seconds=20.0,
        )
        for i in range(2)
    ]
    minds += [
        MindScenario(
            f"urgent{i}",
            "e",
            priority=9,
            protection_window=300.0,
            arrive=400 + 60 * i,
            leave=400 + 60 * i + 40,
            turn_seconds=10,
            think_seconds=5,
        )
        for i in range(6)
    ]
    return Scenario((EngineScenario("e", 2, 4096),), tuple(minds), duration=1200.0, **policy)  # type: ignore[arg-type]


def test_the_protection_window_is_kept_in_a_churn_of_preemptors() -> None:
    assert _invariants(_churn()) == set()


def test_a_policy_without_protection_windows_is_flagged_as_thrash() -> None:
    assert 5 in _invariants(_churn(honour_protection=False))


def test_a_policy_that_preempts_ignoring_minds_already_reclaiming_is_flagged() -> None:
    minds = [
        MindScenario(
            f"bg{i}",
            "e",
            priority=0,
            arrive=i,
            turn_seconds=50,
            think_seconds=5,
            release_delay_seconds=25.0,
        )
        for i in range(3)
    ]
    minds += [MindScenario("vip", "e", priority=9, arrive=400, turn_seconds=10, think_seconds=1)]
    # Another mind's arrival re-runs the allocator while the vip's victim is still reclaiming.
    minds += [MindScenario("late", "e", priority=0, arrive=410)]
    correct = Scenario((EngineScenario("e", 3, 4096),), tuple(minds), duration=900.0)
    assert _invariants(correct) == set()
    broken = Scenario(
        (EngineScenario("e", 3, 4096),), tuple(minds), duration=900.0, count_reclaiming=False
    )
    assert 7 in _invariants(broken)
