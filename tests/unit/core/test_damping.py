"""Relaunch damping: evidence over consecutive readings, a gain worth the relaunch, a cooldown,
nothing weighed in flight; and the properties that rule out a storm whatever the readings."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from continuum_operator.core.damping import (
    Damper,
    DampingSettings,
    Observation,
    Outcome,
    PlanShape,
    step,
)

S = DampingSettings(readings_required=3, min_gain=0.10, cooldown_seconds=300)


def shape(minds: int, layers: int = 33) -> PlanShape:
    args = ("--n-gpu-layers", str(layers), "--parallel", str(minds))
    return PlanShape(args, layers, 33, minds * 8192)


RUNNING = shape(2)
BIGGER = shape(4)


def feed(
    damper: Damper, candidates: list[PlanShape], *, start: float = 0.0, every: float = 10.0
) -> tuple[Damper, list[Outcome]]:
    outcomes = []
    for i, c in enumerate(candidates):
        damper, out = step(damper, Observation(start + i * every, f"r{i}", RUNNING, c), S)
        outcomes.append(out)
    return damper, outcomes


def test_a_new_plan_relaunches_only_after_three_agreeing_readings() -> None:
    _, outcomes = feed(Damper(), [BIGGER] * 4)
    assert outcomes == [
        Outcome.GATHERING_EVIDENCE,
        Outcome.GATHERING_EVIDENCE,
        Outcome.RELAUNCH,
        Outcome.GATHERING_EVIDENCE,  # the caller did not relaunch: evidence starts again
    ]


def test_a_reading_that_agrees_with_the_running_plan_resets_the_evidence() -> None:
    _, outcomes = feed(Damper(), [BIGGER, BIGGER, RUNNING, BIGGER, BIGGER])
    assert Outcome.RELAUNCH not in outcomes


def test_the_same_reading_seen_twice_counts_once() -> None:
    d = Damper()
    for t in range(10):
        d, out = step(d, Observation(float(t), "same", RUNNING, BIGGER), S)
    assert out is Outcome.GATHERING_EVIDENCE and d.readings == 1


def test_a_small_gain_does_not_pay_for_a_relaunch() -> None:
    slightly = PlanShape(("--parallel", "2", "--ctx-size", "17000"), 33, 33, 17000)
    running = PlanShape(("--parallel", "2", "--ctx-size", "16384"), 33, 33, 16384)
    d = Damper()
    for i in range(6):
        d, out = step(d, Observation(float(i), f"r{i}", running, slightly), S)
    assert out is Outcome.GAIN_TOO_SMALL


def test_a_shrink_needs_evidence_but_no_gain() -> None:
    smaller = shape(1)
    d = Damper()
    outs = []
    for i in range(3):
        d, out = step(d, Observation(float(i), f"r{i}", RUNNING, smaller), S)
        outs.append(out)
    assert outs[-1] is Outcome.RELAUNCH


def test_a_cooldown_follows_each_relaunch_and_then_lets_the_next_through() -> None:
    d, outcomes = feed(Damper(), [BIGGER] * 3)
    assert outcomes[-1] is Outcome.RELAUNCH and d.relaunches == 1
    # The running engine is now BIGGER; the board moves again at once.
    even_bigger = shape(8)
    outs = []
    for i in range(5):
        d, out = step(d, Observation(30.0 + i, f"s{i}", BIGGER, even_bigger), S)
        outs.append(out)
    assert outs[2:] == [Outcome.COOLING_DOWN] * 3
    # No new reading, only time: the cooldown ends and the evidence still holds.
    d, out = step(d, Observation(20.0 + 301, "s4", BIGGER, even_bigger), S)
    assert out is Outcome.RELAUNCH and d.relaunches == 2


def test_nothing_is_weighed_while_a_relaunch_is_in_flight() -> None:
    d = Damper()
    for i in range(10):
        d, out = step(d, Observation(float(i), f"r{i}", RUNNING, BIGGER, in_flight=True), S)
        assert out is Outcome.IN_FLIGHT
    assert d.readings == 0
    # Evidence starts from nothing once the pod is up.
    d, out = step(d, Observation(11.0, "r11", RUNNING, BIGGER), S)
    assert out is Outcome.GATHERING_EVIDENCE and d.readings == 1


candidates = st.sampled_from([RUNNING, BIGGER, shape(1), shape(8), shape(3, layers=20)])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            candidates,
            st.floats(min_value=0, max_value=120),  # seconds to the next reading
            st.booleans(),  # a new reading (else the same one again)
            st.booleans(),  # in flight
        ),
        max_size=80,
    )
)
def test_no_storm_whatever_the_readings(
    readings: list[tuple[PlanShape, float, bool, bool]],
) -> None:
    """Relaunches are at most one per cooldown, never in flight, never on one reading."""
    d = Damper()
    now = 0.0
    reading = 0
    relaunch_times: list[float] = []
    running = RUNNING
    agreeing = 0
    last: tuple[str, ...] | None = None
    for candidate, gap, new_reading, in_flight in readings:
        now += gap
        reading += 1 if new_reading else 0
        d, out = step(d, Observation(now, f"r{reading}", running, candidate, in_flight), S)
        if in_flight or candidate.args == running.args:
            agreeing, last = 0, None
        elif new_reading or last != candidate.args:
            agreeing = agreeing + 1 if candidate.args == last else 1
            last = candidate.args
        if out is Outcome.RELAUNCH:
            assert not in_flight
            assert agreeing >= S.readings_required
            relaunch_times.append(now)
            running = candidate
            agreeing, last = 0, None
    for a, b in itertools.pairwise(relaunch_times):
        assert b - a >= S.cooldown_seconds
    assert d.relaunches == len(relaunch_times)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=2, max_value=60))
def test_alternating_readings_never_relaunch(n: int) -> None:
    """The seed's failure: readings that flip between two views never agree long enough."""
    _, outcomes = feed(Damper(), [BIGGER if i % 2 else shape(8) for i in range(n)], every=1)
    assert Outcome.RELAUNCH not in outcomes
