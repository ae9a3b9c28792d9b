"""An Engine's conditions from what the operator knows; transition times kept while they hold."""

from __future__ import annotations

from continuum_operator.core.conditions import (
    ConditionType,
    EngineFacts,
    PlannedEngine,
    PodPhase,
    Problem,
    Reason,
    engine_conditions,
    merge,
    transitions,
)
from continuum_operator.core.damping import Outcome


def by_type(facts: EngineFacts) -> dict[str, tuple[str, str]]:
    return {c.type: (c.status, c.reason) for c in engine_conditions(facts)}


PLANNED = PlannedEngine("gpu-1", "discrete", 33, 33, 8, 8, True)


def test_every_condition_type_is_always_present_in_one_order() -> None:
    for facts in (
        EngineFacts(generation=1),
        EngineFacts(generation=1, planned=PLANNED, pod=PodPhase.READY),
        EngineFacts(generation=1, problem=Problem(Reason.INVALID_SPEC, "spec.x: bad")),
    ):
        assert [c.type for c in engine_conditions(facts)] == [str(t) for t in ConditionType]
        assert all(c.observed_generation == 1 for c in engine_conditions(facts))


def test_a_running_engine_at_its_full_plan_is_ready_and_not_degraded() -> None:
    got = by_type(EngineFacts(generation=1, planned=PLANNED, pod=PodPhase.READY))
    assert got["Planned"] == ("True", "Planned")
    assert got["Ready"] == ("True", "PodReady")
    assert got["Degraded"] == ("False", "AsPlanned")
    assert got["Unschedulable"] == ("False", "Placed")


def test_fewer_minds_than_asked_is_degraded() -> None:
    few = PlannedEngine("gpu-1", "discrete", 33, 33, 3, 8, True)
    assert by_type(EngineFacts(generation=1, planned=few))["Degraded"] == ("True", "MindsLimited")


def test_a_deferred_relaunch_shows_as_degraded_with_its_reason() -> None:
    facts = EngineFacts(
        generation=1,
        planned=PLANNED,
        pod=PodPhase.READY,
        damping=Outcome.GATHERING_EVIDENCE,
        damping_message="1 of 3",
    )
    assert by_type(facts)["Degraded"] == ("True", "RelaunchDeferred")


def test_unknown_memory_mode_and_a_stale_board_are_conditions_of_their_own() -> None:
    unknown = PlannedEngine("cpu-1", "unknown", 0, 33, 2, 2, False)
    got = by_type(EngineFacts(generation=1, planned=unknown, board_fresh=False))
    assert got["MemoryModeUnknown"] == ("True", "NoMemoryModeReported")
    assert got["BoardStale"] == ("True", "LeaseExpired")


def test_an_unschedulable_engine_is_not_ready_for_the_same_reason() -> None:
    why = Problem(Reason.NO_FRESH_BOARD, "a: board is stale")
    got = by_type(EngineFacts(generation=2, unschedulable=why))
    assert got["Unschedulable"] == ("True", "NoFreshBoard")
    assert got["Ready"] == ("False", "NoFreshBoard")
    assert got["Planned"] == ("False", "NotPlaced")


def test_transition_times_are_kept_while_the_status_holds() -> None:
    first = merge([], engine_conditions(EngineFacts(generation=1)), "t1")
    again = merge(first, engine_conditions(EngineFacts(generation=1)), "t2")
    assert {c.last_transition_time for c in again} == {"t1"}
    placed = engine_conditions(EngineFacts(generation=1, planned=PLANNED, pod=PodPhase.READY))
    moved = merge(again, placed, "t3")
    times = {c.type: c.last_transition_time for c in moved}
    assert times["Planned"] == "t3" and times["Ready"] == "t3"
    assert times["BoardStale"] == "t1"  # False before and after
    changed = {c.type for c in transitions(again, moved)}
    assert {"Planned", "Ready", "Unschedulable"} <= changed
    assert "BoardStale" not in changed
