"""The transition log's grant lines, one writer for the operator and the simulator: the fields
and their order as docs/transition-log.md shows them."""

from __future__ import annotations

from continuum_operator.core.grants import Capacity, EnginePhase, GrantReason, Transition
from continuum_operator.core.simulate import EngineScenario, MindScenario, Scenario, simulate
from continuum_operator.core.transition_lines import capacity_line, transition_line
from continuum_operator.model.mind import GrantState


def test_the_lines_are_the_documented_ones_field_for_field() -> None:
    capacity = Capacity(EnginePhase.DRAINING, 4, 8192, target_slots=2)
    assert list(capacity_line(0.0, "ns/e", capacity).items()) == [
        ("t", 0.0),
        ("engine", "ns/e"),
        ("event", "capacity"),
        ("phase", "Draining"),
        ("slots", 4),
        ("tokensPerSlot", 8192),
    ]
    preempted = Transition(
        12.5, "ns/m1", GrantState.GRANTED, GrantState.RECLAIMING, GrantReason.PREEMPTED,
        8192, 2, 10, 300.0, by="ns/m7", deadline=42.5,
    )  # fmt: skip
    assert list(transition_line(12.5, "ns/e", preempted).items()) == [
        ("t", 12.5),
        ("engine", "ns/e"),
        ("event", "transition"),
        ("mind", "ns/m1"),
        ("from", "Granted"),
        ("to", "Reclaiming"),
        ("reason", "Preempted"),
        ("by", "ns/m7"),
        ("tokens", 8192),
        ("slot", 2),
        ("priority", 10),
        ("protectionWindow", 300.0),
        ("deadline", 42.5),
    ]
    arrived = Transition(
        0.0, "ns/m1", None, GrantState.QUEUED, GrantReason.ARRIVED, 0, None, 0, 0.0
    )
    assert transition_line(0.0, "ns/e", arrived)["from"] is None


def test_the_simulator_writes_them_with_plain_strings() -> None:
    scenario = Scenario((EngineScenario("e", 1, 4096),), (MindScenario("m", "e"),), duration=60.0)
    log = simulate(scenario).log
    grant_lines = [line for line in log if line["event"] in ("capacity", "transition")]
    assert grant_lines and all(
        type(value) is str
        for line in grant_lines
        for value in line.values()
        if isinstance(value, str)
    )
    assert grant_lines[0] == {
        "t": 0.0,
        "engine": "e",
        "event": "capacity",
        "phase": "Serving",
        "slots": 1,
        "tokensPerSlot": 4096,
    }
