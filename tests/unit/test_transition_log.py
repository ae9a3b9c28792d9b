"""The operator's transition log (`kube.transition_log`): steps appended whole, `t` never going
backwards across replicas, and a step the log missed (a leader died between the ledger write
and the append) recovered from the Engine's journal exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from continuum_operator import checklog
from continuum_operator.kube.transition_log import TransitionLog


def capacity(t: float) -> dict[str, Any]:
    return {"t": t, "engine": "ns/e", "event": "capacity", "phase": "Relaunching", "slots": 1,
            "tokensPerSlot": 512}  # fmt: skip


def queued(t: float, mind: str) -> dict[str, Any]:
    return {"t": t, "engine": "ns/e", "event": "transition", "mind": mind, "from": None,
            "to": "Queued", "reason": "Arrived", "tokens": 0, "slot": None, "priority": 0,
            "protectionWindow": 0.0}  # fmt: skip


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_step_is_appended_whole_with_its_seq_and_check_log_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = TransitionLog(path)
    log.append("ns/e", 1, [capacity(10.0), queued(10.0, "ns/a")])
    lines = read(path)
    assert [x["seq"] for x in lines] == [1, 1]
    assert checklog.check(lines) == []


def test_time_never_goes_backwards_for_a_replica_that_opens_the_log_later(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    TransitionLog(path).append("ns/e", 1, [capacity(10.0)])
    successor = TransitionLog(path)  # another replica, whose clock reads earlier
    assert successor.time(9.5) == 10.0
    successor.append("ns/e", 2, [queued(9.5, "ns/a")])
    assert [x["t"] for x in read(path)] == [10.0, 10.0]


def test_a_journaled_step_the_log_lacks_is_appended_once(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    TransitionLog(path).append("ns/e", 1, [capacity(10.0)])
    journal = {"seq": 2, "t": 11.0, "lines": [queued(11.0, "ns/a")]}
    successor = TransitionLog(path)
    assert successor.recover("ns/e", journal) is True
    assert successor.recover("ns/e", journal) is False
    assert TransitionLog(path).recover("ns/e", journal) is False  # a third replica, later
    assert [x["seq"] for x in read(path)] == [1, 2]


def test_a_crash_point_exits_at_once_with_the_status_of_a_kill() -> None:
    code = (
        "from continuum_operator.kube import crash\n"
        "crash.reached(crash.CrashPoint.AFTER_LOG)\n"
        "print('on')"
    )
    env = {"CONTINUUM_CRASH_AT": "after-log", "PYTHONPATH": "operator"}
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert ran.returncode == 137 and "on" not in ran.stdout
    assert "crash point after-log" in ran.stderr
    env["CONTINUUM_CRASH_AT"] = "after-log@2"  # the second passage: the first goes on
    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert ran.returncode == 0 and "on" in ran.stdout
