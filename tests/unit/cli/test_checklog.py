"""`continuum check-log` on hand-written logs: one that holds, and for each invariant of
docs/transition-log.md logs that break it, next to near misses that must pass.

The logs are lists of dicts built by the helpers below, one engine `ns/e` unless said, every
mind at priority 1 with a 10 s protection window unless said.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.checklog import (
    ALLOWED,
    INVARIANTS,
    LogFormatError,
    Violation,
    check,
    check_file,
)
from continuum_operator.cli import main
from continuum_operator.core.grants import Capacity, EnginePhase, Grant, MindDemand, allocate
from continuum_operator.core.transition_lines import capacity_line, transition_line

E = "ns/e"
TPS = 100
Line = dict[str, Any]


def cap(t: float, slots: int = 2, phase: str = "Serving", engine: str = E) -> Line:
    return {"t": t, "engine": engine, "event": "capacity", "phase": phase, "slots": slots,
            "tokensPerSlot": TPS}  # fmt: skip


def tr(
    t: float,
    mind: str,
    src: str | None,
    dst: str,
    reason: str,
    *,
    slot: int | None = None,
    prio: float = 1,
    window: float = 10.0,
    deadline: float | None = None,
    by: str | None = None,
    tokens: int | None = None,
    engine: str = E,
) -> Line:
    if tokens is None:
        tokens = TPS if dst in ("Granted", "Reclaiming") else 0
    return {"t": t, "engine": engine, "event": "transition", "mind": mind, "from": src,
            "to": dst, "reason": reason, "by": by, "tokens": tokens, "slot": slot,
            "priority": prio, "protectionWindow": window, "deadline": deadline}  # fmt: skip


def grant(t: float, mind: str, slot: int, prio: float = 1, window: float = 10.0) -> list[Line]:
    """A mind arrives and is granted at once."""
    return [
        tr(t, mind, None, "Queued", "Arrived", prio=prio, window=window),
        tr(t, mind, "Queued", "Granted", "SlotFree", slot=slot, prio=prio, window=window),
    ]


def reclaim(t: float, mind: str, reason: str, slot: int, deadline: float, *, prio: float = 1,
            by: str | None = None) -> Line:  # fmt: skip
    return tr(t, mind, "Granted", "Reclaiming", reason, slot=slot, prio=prio, deadline=deadline,
              by=by)  # fmt: skip


def release(t: float, mind: str, reason: str = "SlotReleased", prio: float = 1) -> list[Line]:
    """A reclaim ends and the mind is requeued."""
    return [
        tr(t, mind, "Reclaiming", "Released", reason, prio=prio),
        tr(t, mind, "Released", "Queued", "Requeued", prio=prio),
    ]


def wait(t: float, mind: str, deadline: float, reason: str = "PoolFull") -> Line:
    return {"t": t, "engine": E, "event": "wait", "mind": mind, "reason": reason,
            "deadline": deadline}  # fmt: skip


def wait_end(t: float, mind: str, outcome: str = "granted") -> Line:
    return {"t": t, "engine": E, "event": "waitEnd", "mind": mind, "outcome": outcome}


def turn(t: float, mind: str, phase: str) -> Line:
    return {"t": t, "engine": E, "event": "turn", "mind": mind, "phase": phase}


def broken(log: list[Line]) -> set[int]:
    """The invariants the log breaks."""
    return {v.invariant for v in check(log)}


def holds(log: list[Line]) -> None:
    found = check(log)
    assert found == [], "\n".join(map(str, found))


# --- a log that holds ------------------------------------------------------------------------

ALL_EVENTS: list[Line] = [
    cap(0),
    wait(0, "a", 100),
    *grant(0, "a", 0),
    wait_end(0, "a"),
    turn(0, "a", "start"),
    *grant(0, "b", 1),
    turn(0, "b", "start"),
    # c finds the pool full; the wait's reason changes from Arrived to PoolFull.
    tr(1, "c", None, "Queued", "Arrived"),
    tr(1, "c", "Queued", "Queued", "PoolFull"),
    wait(1, "c", 50),
    turn(2, "a", "end"),
    # h outranks a and b, but both grants are younger than their 10 s window.
    tr(5, "h", None, "Queued", "Arrived", prio=5),
    tr(5, "h", "Queued", "Queued", "PoolFull", prio=5),
    wait(5, "h", 100),
    # At 10 a's grant is exactly one window old: no longer protected.
    reclaim(10, "a", "Preempted", 0, 15, by="h"),
    turn(10, "a", "cut"),
    tr(10, "h", "Queued", "Queued", "WaitingForReclaim", prio=5),
    wait(10, "h", 100, "WaitingForReclaim"),
    # a is slow to release: forced exactly at her grace deadline.
    *release(15, "a", "GraceExpired"),
    tr(15, "h", "Queued", "Granted", "SlotFree", slot=0, prio=5),
    wait_end(15, "h"),
    turn(15, "h", "start"),
    # The engine relaunches with 3 slots: everyone is reclaimed, young grants included.
    cap(20, phase="Draining"),
    reclaim(20, "b", "EngineRelaunching", 1, 25),
    reclaim(20, "h", "EngineRelaunching", 0, 25, prio=5),
    turn(20, "b", "cut"),
    turn(20, "h", "cut"),
    tr(20, "a", "Queued", "Queued", "EngineRelaunching"),
    tr(20, "c", "Queued", "Queued", "EngineRelaunching"),
    *release(22, "b"),
    *release(22, "h", prio=5),
    wait(22, "b", 200, "EngineRelaunching"),
    cap(23, slots=3, phase="Relaunching"),
    cap(30, slots=3),
    tr(30, "h", "Queued", "Granted", "SlotFree", slot=0, prio=5),
    tr(30, "a", "Queued", "Granted", "SlotFree", slot=1),
    tr(30, "c", "Queued", "Granted", "SlotFree", slot=2),
    wait_end(30, "c"),
    # Two slots swapped in one step: the same slot twice only between the step's lines.
    tr(31, "a", "Granted", "Granted", "SlotMoved", slot=2),
    tr(31, "c", "Granted", "Granted", "SlotMoved", slot=1),
    reclaim(32, "a", "MindDeleted", 2, 35),
    tr(33, "a", "Reclaiming", "Released", "SlotReleased"),
    tr(33, "b", "Queued", "Granted", "SlotFree", slot=2),
    wait_end(33, "b"),
    # d asks more than a slot holds; e waits until its turn's deadline and is deleted later.
    tr(34, "d", None, "Released", "ContextTooLarge"),
    tr(34, "e", None, "Queued", "Arrived"),
    wait(34, "e", 36),
    wait_end(36, "e", "deadline"),
    tr(40, "e", "Queued", "Released", "MindDeleted"),
    tr(40, "d", "Released", "Queued", "Arrived"),
    # a comes back, new to the ledger after her release.
    tr(41, "a", None, "Queued", "Arrived"),
]


def test_a_log_with_every_event_and_every_transition_holds() -> None:
    holds(ALL_EVENTS)
    moves = {(ln["from"], ln["to"]) for ln in ALL_EVENTS if ln["event"] == "transition"}
    assert moves == set(ALLOWED)
    assert {ln["event"] for ln in ALL_EVENTS} == {
        "capacity", "transition", "wait", "waitEnd", "turn"
    }  # fmt: skip


def test_violations_name_the_invariant_time_engine_and_mind() -> None:
    log = [cap(0, slots=2), *grant(0, "a", 0), *grant(1, "b", 0)]
    v = check(log)[0]
    assert isinstance(v, Violation)
    assert (v.invariant, v.name, v.t, v.engine) == (1, INVARIANTS[1], 1.0, E)
    assert "slot 0" in v.message
    assert str(v).startswith("t=1 ns/e b: invariant 1 (granted-within-pool): ")


# --- 1. granted tokens within the pool -------------------------------------------------------


def test_more_tokens_granted_than_the_pool_holds_breaks_invariant_1() -> None:
    log = [cap(0, slots=2), *grant(0, "a", 0), tr(0, "b", None, "Queued", "Arrived"),
           tr(0, "b", "Queued", "Granted", "SlotFree", slot=1, tokens=2 * TPS)]  # fmt: skip
    assert broken(log) == {1}


def test_two_minds_on_one_slot_break_invariant_1() -> None:
    assert broken([cap(0), *grant(0, "a", 0), *grant(0, "b", 0)]) == {1}


def test_a_slot_beyond_the_engines_slots_breaks_invariant_1() -> None:
    assert 1 in broken([cap(0, slots=2), *grant(0, "a", 2)])


def test_a_grant_before_any_capacity_line_breaks_invariant_1() -> None:
    assert 1 in broken([*grant(0, "a", 0), cap(1)])


def test_a_grant_without_a_slot_breaks_invariant_1() -> None:
    log = [cap(0), tr(0, "a", None, "Queued", "Arrived"),
           tr(0, "a", "Queued", "Granted", "SlotFree", slot=None)]  # fmt: skip
    assert 1 in broken(log)


def test_a_queued_mind_holding_tokens_breaks_invariant_1() -> None:
    assert broken([cap(0, slots=0), tr(0, "a", None, "Queued", "Arrived", tokens=TPS)]) == {1}


def test_a_pool_over_full_between_lines_of_one_step_holds() -> None:
    # The capacity grows in the same step as the third grant, after it.
    holds([cap(0, slots=2), *grant(0, "a", 0), *grant(0, "b", 1), *grant(5, "c", 2),
           cap(5, slots=3)])  # fmt: skip


def test_steps_are_per_engine_even_when_their_lines_interleave() -> None:
    f = "ns/f"
    holds([cap(0, slots=1), cap(0, slots=1, engine=f),
           tr(0, "a", None, "Queued", "Arrived", engine=f),
           *grant(0, "a", 0),
           tr(0, "a", "Queued", "Granted", "SlotFree", slot=0, engine=f)])  # fmt: skip


# --- 2. one state per mind -------------------------------------------------------------------


def test_a_transition_from_a_state_the_mind_is_not_in_breaks_invariant_2() -> None:
    log = [cap(0, slots=0), tr(0, "a", None, "Queued", "Arrived"),
           tr(1, "a", "Granted", "Reclaiming", "MindDeleted", slot=0, deadline=5)]  # fmt: skip
    found = check(log)
    assert {v.invariant for v in found} >= {2}
    assert "mind is Queued" in found[0].message


def test_a_first_line_that_does_not_start_from_null_breaks_invariant_2() -> None:
    assert 2 in broken([cap(0), tr(0, "a", "Queued", "Granted", "SlotFree", slot=0)])


def test_a_mind_arriving_twice_breaks_invariant_2() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0), tr(1, "a", None, "Queued", "Arrived")]
    assert 2 in broken(log)


def test_a_move_outside_the_table_breaks_invariant_2() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0), *release(1, "a")]
    found = check([cap(0), tr(0, "a", None, "Queued", "Arrived"),
                   tr(0, "a", "Queued", "Reclaiming", "Preempted", slot=0, deadline=5,
                      by="b")])  # fmt: skip
    assert 2 in {v.invariant for v in found}
    assert 2 in broken(log)  # Granted -> Released skips Reclaiming


def test_a_reason_that_does_not_fit_the_move_breaks_invariant_2() -> None:
    log = [cap(0), tr(0, "a", None, "Queued", "Arrived"),
           tr(0, "a", "Queued", "Granted", "Preempted", slot=0)]  # fmt: skip
    assert broken(log) == {2}


def test_a_preemption_without_a_preemptor_breaks_invariant_2() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0),
           reclaim(20, "a", "Preempted", 0, 25)]  # fmt: skip
    assert 2 in broken(log)


def test_a_released_mind_back_from_released_or_from_null_holds() -> None:
    holds([cap(0, slots=1),
           tr(0, "a", None, "Released", "ContextTooLarge"),
           tr(1, "a", "Released", "Queued", "Arrived"),
           tr(1, "a", "Queued", "Released", "MindDeleted"),
           tr(2, "a", None, "Queued", "Arrived"),
           tr(2, "a", "Queued", "Granted", "SlotFree", slot=0)])  # fmt: skip


# --- 3. every reclaim ends within its grace --------------------------------------------------


def test_a_reclaim_released_after_its_deadline_breaks_invariant_3() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0), reclaim(20, "a", "MindDeleted", 0, 25),
           tr(26, "a", "Reclaiming", "Released", "GraceExpired")]  # fmt: skip
    found = check(log)
    assert [(v.invariant, v.t, v.mind) for v in found] == [(3, 26.0, "a")]


def test_a_reclaim_the_log_outlives_breaks_invariant_3_once() -> None:
    log = [cap(0, slots=2), *grant(0, "a", 0), reclaim(20, "a", "MindDeleted", 0, 25),
           cap(30, slots=2), cap(40, slots=2),
           tr(41, "a", "Reclaiming", "Released", "SlotReleased")]  # fmt: skip
    found = check(log)
    assert [(v.invariant, v.t) for v in found] == [(3, 30.0)]


def test_a_reclaim_without_a_deadline_breaks_invariant_3() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0),
           tr(20, "a", "Granted", "Reclaiming", "MindDeleted", slot=0)]  # fmt: skip
    assert broken(log) == {3}
    del log[-1]["deadline"]
    assert broken(log) == {3}


def test_a_reclaim_that_ends_exactly_at_its_deadline_holds() -> None:
    holds([cap(0, slots=1), *grant(0, "a", 0), reclaim(20, "a", "MindDeleted", 0, 25),
           cap(25, slots=1), tr(25, "a", "Reclaiming", "Released", "GraceExpired")])  # fmt: skip


def test_a_reclaim_open_when_the_log_ends_before_its_deadline_holds() -> None:
    holds([cap(0, slots=1), *grant(0, "a", 0), reclaim(20, "a", "MindDeleted", 0, 25)])


# --- 4. no wait past its deadline ------------------------------------------------------------


def test_a_wait_that_ends_after_its_deadline_breaks_invariant_4() -> None:
    log = [cap(0, slots=0), tr(0, "a", None, "Queued", "Arrived"), wait(0, "a", 10),
           wait_end(12, "a", "deadline")]  # fmt: skip
    assert [(v.invariant, v.t) for v in check(log)] == [(4, 12.0)]


def test_a_wait_the_log_outlives_breaks_invariant_4() -> None:
    log = [cap(0, slots=0), tr(0, "a", None, "Queued", "Arrived"), wait(0, "a", 10),
           cap(11, slots=0)]  # fmt: skip
    assert broken(log) == {4}


def test_a_restated_wait_does_not_move_its_deadline_later() -> None:
    log = [cap(0, slots=0), tr(0, "a", None, "Queued", "Arrived"), wait(0, "a", 10),
           wait(5, "a", 50, "EngineRelaunching"), wait_end(20, "a")]  # fmt: skip
    assert broken(log) == {4}


def test_a_wait_end_without_a_wait_breaks_invariant_4() -> None:
    assert broken([cap(0, slots=0), wait_end(1, "a", "left")]) == {4}


def test_a_wait_ending_at_its_deadline_or_open_when_the_log_ends_holds() -> None:
    holds([cap(0, slots=0), tr(0, "a", None, "Queued", "Arrived"), wait(0, "a", 10),
           tr(0, "b", None, "Queued", "Arrived"), wait(0, "b", 100),
           wait_end(10, "a", "deadline"), cap(50, slots=0)])  # fmt: skip


# --- 5. no thrash ----------------------------------------------------------------------------


def test_preempting_a_grant_younger_than_its_window_breaks_invariant_5() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0), tr(5, "h", None, "Queued", "Arrived", prio=5),
           reclaim(5, "a", "Preempted", 0, 8, by="h")]  # fmt: skip
    found = check(log)
    assert {v.invariant for v in found} == {5}
    assert "protection window of 10 s" in found[0].message


def test_a_second_preemption_inside_one_window_breaks_invariant_5() -> None:
    # Granted -> Reclaiming -> ... -> Granted -> Reclaiming, 8 s apart with a 10 s window.
    log = [cap(0, slots=1), *grant(0, "a", 0), tr(20, "h", None, "Queued", "Arrived", prio=5),
           reclaim(20, "a", "Preempted", 0, 21, by="h"),
           tr(21, "a", "Reclaiming", "Released", "SlotReleased"),
           tr(21, "a", "Released", "Queued", "Requeued"),
           tr(21, "h", "Queued", "Granted", "SlotFree", slot=0, prio=5),
           tr(22, "h", "Granted", "Reclaiming", "MindDeleted", slot=0, prio=5, deadline=22),
           tr(22, "h", "Reclaiming", "Released", "SlotReleased", prio=5),
           tr(22, "a", "Queued", "Granted", "SlotFree", slot=0),
           tr(28, "k", None, "Queued", "Arrived", prio=5),
           reclaim(28, "a", "Preempted", 0, 30, by="k")]  # fmt: skip
    found = check(log)
    assert [(v.invariant, v.t, v.mind) for v in found] == [(5, 28.0, "a")]


def test_a_second_reclaim_inside_one_window_for_a_relaunch_holds() -> None:
    holds([cap(0, slots=1), *grant(0, "a", 0), tr(20, "h", None, "Queued", "Arrived", prio=5),
           reclaim(20, "a", "Preempted", 0, 21, by="h"),
           *release(21, "a"),
           tr(21, "h", "Queued", "Granted", "SlotFree", slot=0, prio=5),
           tr(22, "h", "Granted", "Reclaiming", "MindDeleted", slot=0, prio=5, deadline=22),
           tr(22, "h", "Reclaiming", "Released", "SlotReleased", prio=5),
           tr(22, "a", "Queued", "Granted", "SlotFree", slot=0),
           cap(25, slots=1, phase="Draining"),
           reclaim(25, "a", "EngineRelaunching", 0, 30)])  # fmt: skip


def test_preempting_a_grant_exactly_one_window_old_holds() -> None:
    holds([cap(0, slots=1), *grant(0, "a", 0), tr(5, "h", None, "Queued", "Arrived", prio=5),
           reclaim(10, "a", "Preempted", 0, 12, by="h")])  # fmt: skip


# --- 6. no higher-priority mind queued behind a lower one it could preempt --------------------


def test_a_higher_mind_left_behind_an_unprotected_lower_grant_breaks_invariant_6() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0), tr(20, "h", None, "Queued", "Arrived", prio=5)]
    found = check(log)
    assert [(v.invariant, v.t, v.mind) for v in found] == [(6, 20.0, "h")]
    assert "behind a" in found[0].message


def test_a_grant_unprotected_at_exactly_its_window_must_yield_under_invariant_6() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0), tr(10, "h", None, "Queued", "Arrived", prio=5)]
    assert broken(log) == {6}


def test_a_slot_left_free_while_a_mind_is_queued_breaks_invariant_6() -> None:
    log = [cap(0, slots=2), *grant(0, "a", 0), tr(1, "b", None, "Queued", "Arrived")]
    assert broken(log) == {6}


def test_a_higher_mind_behind_a_protected_grant_holds() -> None:
    holds([cap(0, slots=1), *grant(0, "a", 0), tr(5, "h", None, "Queued", "Arrived", prio=5)])


def test_a_higher_mind_behind_an_equal_grant_holds() -> None:
    holds([cap(0, slots=1), *grant(0, "a", 0, prio=5),
           tr(20, "h", None, "Queued", "Arrived", prio=5)])  # fmt: skip


def test_a_higher_mind_covered_by_a_reclaim_in_flight_holds() -> None:
    # b is reclaiming (deleted); h waits for b's slot although a is lower and unprotected.
    holds([cap(0, slots=2), *grant(0, "a", 0), *grant(0, "b", 1),
           reclaim(20, "b", "MindDeleted", 1, 25),
           tr(20, "h", None, "Queued", "Arrived", prio=5),
           tr(20, "h", "Queued", "Queued", "WaitingForReclaim", prio=5)])  # fmt: skip


def test_the_second_higher_mind_beyond_the_reclaims_in_flight_breaks_invariant_6() -> None:
    log = [cap(0, slots=2), *grant(0, "a", 0), *grant(0, "b", 1),
           reclaim(20, "b", "MindDeleted", 1, 25),
           tr(20, "h", None, "Queued", "Arrived", prio=5),
           tr(20, "k", None, "Queued", "Arrived", prio=4)]  # fmt: skip
    found = check(log)
    assert [(v.invariant, v.mind) for v in found] == [(6, "k")]


def test_a_queue_on_a_draining_engine_is_not_ranked() -> None:
    holds([cap(0, slots=1), *grant(0, "a", 0), cap(20, slots=1, phase="Draining"),
           tr(20, "h", None, "Queued", "Arrived", prio=5),
           tr(20, "h", "Queued", "Queued", "EngineRelaunching", prio=5)])  # fmt: skip


# --- 7. no needless reclaim ------------------------------------------------------------------


def test_a_preemption_ignoring_a_mind_already_reclaiming_breaks_invariant_7() -> None:
    # b's slot is already coming free for h: reclaiming a as well serves nobody.
    log = [cap(0, slots=2), *grant(0, "a", 0), *grant(0, "b", 1),
           reclaim(20, "b", "MindDeleted", 1, 25),
           tr(20, "h", None, "Queued", "Arrived", prio=5),
           reclaim(20, "a", "Preempted", 0, 25, by="h")]  # fmt: skip
    found = check(log)
    assert [(v.invariant, v.mind) for v in found] == [(7, "a")]
    assert "2 reclaiming (this one included) for 1 queued above" in found[0].message


def test_a_preemption_with_a_slot_free_breaks_invariant_7() -> None:
    log = [cap(0, slots=2), *grant(0, "a", 0),
           tr(20, "h", None, "Queued", "Arrived", prio=5),
           reclaim(20, "a", "Preempted", 0, 25, by="h")]  # fmt: skip
    assert 7 in broken(log)


def test_a_preemption_by_a_mind_not_above_its_victim_breaks_invariant_7() -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0, prio=5),
           tr(20, "h", None, "Queued", "Arrived", prio=5),
           reclaim(20, "a", "Preempted", 0, 25, prio=5, by="h")]  # fmt: skip
    assert broken(log) == {7}
    log[-2:] = [reclaim(20, "a", "Preempted", 0, 25, prio=5, by="ghost")]
    assert broken(log) == {7}


def test_a_preemption_that_counts_minds_already_reclaiming_holds() -> None:
    # Two higher minds queue; b's reclaim covers one, so exactly one more grant is reclaimed.
    holds([cap(0, slots=3), *grant(0, "a", 0), *grant(0, "b", 1), *grant(0, "c", 2),
           reclaim(20, "b", "MindDeleted", 1, 25),
           tr(20, "h", None, "Queued", "Arrived", prio=5),
           tr(20, "k", None, "Queued", "Arrived", prio=5),
           reclaim(20, "a", "Preempted", 0, 25, by="k"),
           tr(20, "h", "Queued", "Queued", "WaitingForReclaim", prio=5),
           tr(20, "k", "Queued", "Queued", "WaitingForReclaim", prio=5)])  # fmt: skip


# --- the command -----------------------------------------------------------------------------


def _write(tmp_path: Path, lines: list[Any]) -> Path:
    path = tmp_path / "log.jsonl"
    path.write_text("".join(ln if isinstance(ln, str) else json.dumps(ln) + "\n" for ln in lines))
    return path


def test_the_command_exits_0_for_a_log_that_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check-log", str(_write(tmp_path, ALL_EVENTS))]) == 0
    assert "ok" in capsys.readouterr().out
    assert main(["check-log", str(_write(tmp_path, ALL_EVENTS)), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"ok": True, "violations": []}


def test_the_command_exits_1_and_prints_each_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = [cap(0, slots=1), *grant(0, "a", 0), tr(20, "h", None, "Queued", "Arrived", prio=5)]
    path = _write(tmp_path, log)
    assert main(["check-log", str(path)]) == 1
    out = capsys.readouterr().out
    assert "t=20 ns/e h: invariant 6 (no-priority-inversion): " in out
    assert main(["check-log", str(path), "-o", "json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False
    assert doc["violations"][0] | {"message": ""} == {
        "invariant": 6, "name": "no-priority-inversion", "t": 20.0, "engine": E, "mind": "h",
        "message": "",
    }  # fmt: skip


MALFORMED = [
    pytest.param([cap(0), "\n", '{"t": 1, "engine": \n'], "line 3: not JSON", id="bad-json"),
    pytest.param([cap(0), {k: v for k, v in cap(1).items() if k != "slots"}],
                 "line 2: missing field `slots`", id="missing-field"),
    pytest.param([cap(0), tr(1, "a", None, "Queued", "Arrived") | {"priority": None}],
                 "line 2: `priority` must be a finite number", id="null-number"),
    pytest.param([cap(5), cap(4)], "line 2: `t` goes backwards: 4 after 5", id="t-backwards"),
    pytest.param([cap(0), "[1, 2]\n"], "line 2: a line must be a JSON object",
                 id="not-an-object"),
    pytest.param([cap(0) | {"event": "grant"}], "line 1: `event` must be one of",
                 id="unknown-event"),
    pytest.param([cap(0), tr(1, "a", "Waiting", "Queued", "Arrived")],
                 "line 2: `from` must be null or", id="unknown-state"),
    pytest.param([cap(0), wait_end(1, "a", "timeout")], "line 2: `outcome` must be one of",
                 id="unknown-outcome"),
    pytest.param([cap(0), '{"t": NaN, "engine": "ns/e", "event": "capacity"}\n'],
                 "line 2: `t` must be", id="nan"),
    pytest.param([cap(0) | {"slots": True}], "line 1: `slots` must be a whole number",
                 id="bool-count"),
]  # fmt: skip


@pytest.mark.parametrize(("lines", "expected"), MALFORMED)
def test_a_malformed_log_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[Any], expected: str
) -> None:
    path = _write(tmp_path, lines)
    assert main(["check-log", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:")
    number, what = expected.removeprefix("line ").split(": ", 1)
    assert err.startswith(f"error: {path}:{number}: {what}")
    with pytest.raises(LogFormatError, match=expected):
        check_file(path)


def test_check_numbers_the_lines_of_dicts_from_one() -> None:
    with pytest.raises(LogFormatError, match="line 2: missing field `mind`") as info:
        check([cap(0), {"t": 1, "engine": E, "event": "turn", "phase": "start"}])
    assert info.value.line == 2


def test_an_unreadable_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-log", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "\n\n  \n"], ids=["empty", "blank-lines"])
def test_an_empty_log_says_so_and_exits_2_rather_than_holding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "log.jsonl"
    path.write_text(text)
    assert main(["check-log", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: the log is empty") and "--transition-log" in err
    with pytest.raises(LogFormatError, match="the log is empty"):
        check_file(path)


def test_a_log_cut_off_mid_line_says_it_is_truncated_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = _write(tmp_path, ALL_EVENTS).read_text()
    path = tmp_path / "cut.jsonl"
    path.write_text(whole[: whole.rindex("\n", 0, len(whole) - 1) + 20])  # 19 chars of the last
    assert main(["check-log", str(path)]) == 2
    err = capsys.readouterr().err
    last = whole.count("\n")
    assert err.startswith(f"error: {path}:{last}: the last line is cut short")
    assert "truncated" in err
    # The same bad JSON mid-file, newline and all, is malformed rather than truncated.
    path.write_text(whole[:19] + "\n" + whole)
    assert main(["check-log", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:1: not JSON") and "cut short" not in err


def _raised_log(low_priority: int, raised: int, at: float) -> list[Line]:
    """The operator's lines for one slot: `ns/low` granted and `ns/high` queued (priority 0) at
    0, then `ns/high`'s class raised to `raised` and the engine stepped again at `at`."""
    one = Capacity(EnginePhase.SERVING, 1, 1000)
    low = MindDemand("ns/low", low_priority, 1.0, 100, protection_window=60.0)
    lines = [capacity_line(0.0, E, one)]
    grants: dict[str, Grant] = {}
    for now, priority in ((0.0, 0), (at, raised)):
        high = MindDemand("ns/high", priority, 2.0, 100, protection_window=60.0)
        a = allocate(grants, [low, high], one, now)
        lines += [transition_line(now, E, t) for t in a.transitions]
        grants = a.grants
    return lines


def test_a_preemption_after_a_class_is_raised_is_a_log_check_log_finds_clean() -> None:
    # Found by review: the victim's Preempted line came before any line of the preemptor's
    # new priority (hers came after it, or never where her wait reason stayed), so check-log,
    # judging the reclaim at its line, flagged the operator's own log as needless.
    lines = _raised_log(low_priority=0, raised=10, at=400.0)
    assert check(lines) == []
    later = [(x["mind"], x["reason"]) for x in lines if x["t"] == 400.0]
    assert later[:2] == [("ns/high", "WaitingForReclaim"), ("ns/low", "Preempted")]


def test_a_queued_minds_class_edited_is_logged_though_her_wait_reason_stays() -> None:
    lines = _raised_log(low_priority=5, raised=3, at=10.0)
    queued = [(x["reason"], x["priority"]) for x in lines if x.get("mind") == "ns/high"]
    assert queued[-2:] == [("PoolFull", 0), ("PoolFull", 3)]
    assert check(lines) == []


def test_a_line_naming_another_ledger_starts_the_engine_afresh() -> None:
    # An Engine made again under its name: her first grant on the new ledger is no second
    # grant of one mind, and a reclaim of the old ledger owes nothing past its deadline.
    first = {"ledger": "uid-1"}
    second = {"ledger": "uid-2"}
    lines = [
        {**cap(0.0, slots=1), **first},
        {**tr(0.0, "ns/a", None, "Queued", "Arrived"), **first},
        {**tr(0.0, "ns/a", "Queued", "Granted", "SlotFree", tokens=TPS, slot=0), **first},
        {**cap(10.0, slots=1), **second},
        {**tr(10.0, "ns/a", None, "Queued", "Arrived"), **second},
        {**tr(10.0, "ns/a", "Queued", "Granted", "SlotFree", tokens=TPS, slot=0), **second},
    ]
    assert check(lines) == []
    assert check([{**x, "ledger": "uid-1"} for x in lines])[0].invariant == 2


def test_a_ledger_that_is_not_a_string_is_malformed() -> None:
    with pytest.raises(LogFormatError, match="`ledger` must be a non-empty string"):
        check([{**cap(0.0), "ledger": 7}])
