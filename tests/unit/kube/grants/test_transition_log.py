"""The operator's transition log (`kube.ledger.transition_log`): steps appended whole, `t` never
going backwards across replicas, and a step the log missed (a leader died between the ledger write
and the append) recovered from the Engine's journal exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from continuum_operator import checklog
from continuum_operator.kube.ledger.transition_log import TransitionLog
from tests.support.grants_world import World, engine, mind


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


def test_a_pass_reads_a_journal_only_where_the_log_lacks_its_step(tmp_path: Path) -> None:
    # Asked from the journal as stored (its times as text, unread), before `read_journal`.
    path = tmp_path / "log.jsonl"
    log = TransitionLog(path)
    log.append("ns/e", 2, [{**queued(10.0, "ns/a"), "ledger": "l1"}])
    at = "1970-01-01T00:00:10.0Z"
    line = {**queued(10.0, "ns/a"), "t": at, "ledger": "l1"}
    stored = {"seq": 2, "t": at, "lines": [line]}
    assert log.nothing_to_recover("ns/e", stored)
    assert not log.nothing_to_recover("ns/e", {**stored, "seq": 3})
    assert not log.nothing_to_recover("ns/f", stored)  # another engine's log has no step
    # A ledger made again under the name: its seq counts from 1, not after the old one's.
    remade = {**stored, "lines": [{**line, "ledger": "l2"}]}
    assert not log.nothing_to_recover("ns/e", remade)
    for nothing in (None, {}, {"seq": 3}, {"seq": 3, "lines": []}, {"seq": "3", "lines": [{}]}):
        assert log.nothing_to_recover("ns/e", nothing)


def test_a_crash_point_exits_at_once_with_the_status_of_a_kill() -> None:
    code = (
        "from continuum_operator.kube.base import crash\n"
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


def test_steps_written_side_by_side_never_interleave_and_are_synced_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "log.jsonl"
    log = TransitionLog(path)

    def steps_of(i: int) -> None:
        for seq in range(1, 21):
            t = 10.0 + seq
            name = f"ns/e{i}"
            step = [{**capacity(t), "engine": name}, {**queued(t, f"ns/m{i}"), "engine": name}]
            log.append(name, seq, step)

    threads = [threading.Thread(target=steps_of, args=(i,)) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert synced == []  # group commit: written, not yet flushed
    log.sync()
    log.sync()  # nothing written since: no second fsync
    assert len(synced) == 1
    lines = read(path)
    assert len(lines) == 8 * 20 * 2
    # Each step's two lines together, and `t` never going backwards.
    for first, second in zip(lines[::2], lines[1::2], strict=True):
        assert (first["engine"], first["seq"], first["event"]) == (
            second["engine"],
            second["seq"],
            "capacity",
        )
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)


def test_a_grants_pass_syncs_the_log_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = World(tmp_path)
    for e in range(3):
        w.engine(engine("team-a", f"e{e}"))
        w.mind(mind("team-a", f"m{e}", f"e{e}"))
    synced: list[int] = []
    real = w.loop.log.sync

    def sync() -> None:
        synced.append(1)
        real()

    monkeypatch.setattr(w.loop.log, "sync", sync)
    w.loop.pass_once()
    assert synced == [1]
    assert {x["engine"] for x in read(tmp_path / "log.jsonl")} == {f"team-a/e{e}" for e in range(3)}


def test_the_log_knows_which_minds_it_leaves_waiting_read_back_by_the_next_leader(
    tmp_path: Path,
) -> None:
    path = tmp_path / "log.jsonl"
    log = TransitionLog(path)
    granted = {**queued(2.0, "ns/a"), "from": "Queued", "to": "Granted", "reason": "SlotFree",
               "tokens": 512, "slot": 0}  # fmt: skip
    refused = {**queued(2.0, "ns/c"), "to": "Released", "reason": "ContextTooLarge"}
    gone = {**queued(3.0, "ns/d"), "from": "Queued", "to": "Released", "reason": "MindDeleted"}
    log.append("ns/e", 1, [capacity(1.0), queued(1.0, "ns/a"), queued(1.0, "ns/b"),
                           queued(1.0, "ns/d")])  # fmt: skip
    log.append("ns/e", 2, [granted, refused, {**queued(2.5, "ns/b"), "from": "Queued",
                                              "reason": "PoolFull"}])  # fmt: skip
    log.append("ns/e", 3, [gone])
    expected = {"ns/b": ("Queued", "PoolFull", 2.5), "ns/c": ("Released", "ContextTooLarge", 2.0)}
    for reader in (log, TransitionLog(path)):  # as written, and as a new leader reads the file
        waiting = reader.waiting("ns/e")
        assert waiting is not None
        assert {m: (p.state, p.reason, p.t) for m, p in waiting.items()} == expected
    assert TransitionLog(None).waiting("ns/e") is None  # no log: nothing to follow
