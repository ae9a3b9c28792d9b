"""The controller kernel (`kube.base.kernel`): a keyed work queue with dirty marks, a resync,
a leader gate and retries with backoff, and the loop that drains it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from continuum_operator.kube.base import kernel
from continuum_operator.kube.base.kernel import KernelSettings, PassHooks, WorkQueue

SETTINGS = KernelSettings(
    resync_seconds=60, debounce_seconds=0, retry_seconds=1, max_retry_seconds=8
)


@dataclass
class Recorder(PassHooks[str]):
    """A reconciler over `every`, recording what it decided and wrote; `failing` keys raise."""

    every: list[str]
    failing: set[str] = field(default_factory=set)
    decided: list[str] = field(default_factory=list)
    written: list[str] = field(default_factory=list)

    def keys(self) -> list[str]:
        return list(self.every)

    def decide(self, key: str, now: float) -> str | None:
        self.decided.append(key)
        if key == "broken":
            raise ValueError("a decision that raised")
        return None if key not in self.every else f"{key}@{now:g}"

    async def write(self, key: str, writes: str) -> None:
        if key in self.failing:
            raise RuntimeError(f"{key} conflicted")
        self.written.append(writes)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def drain(r: Recorder, q: WorkQueue[str], clock: Clock, leading: bool = True) -> int:
    return asyncio.run(kernel.drain(r, q, SETTINGS, may_write=lambda: leading, clock=clock))


def test_the_first_pass_decides_every_key_then_only_the_marked_ones() -> None:
    r, q, clock = Recorder(["a", "b", "c"]), WorkQueue[str](), Clock()
    assert drain(r, q, clock) == 3 and r.written == ["a@100", "b@100", "c@100"]
    assert drain(r, q, clock) == 0
    q.mark("c", "a", "c")
    r.written.clear()
    assert drain(r, q, clock) == 2 and r.written == ["a@100", "c@100"]
    q.mark_all()
    assert drain(r, q, clock) == 3


def test_a_key_gone_from_the_cache_is_decided_once_and_writes_nothing() -> None:
    r, q, clock = Recorder(["a"]), WorkQueue[str](), Clock()
    drain(r, q, clock)
    q.mark("gone")
    r.written.clear()
    assert drain(r, q, clock) == 1 and r.decided[-1] == "gone" and r.written == []


def test_a_failed_write_is_taken_again_after_a_doubling_backoff_without_holding_the_others() -> (
    None
):
    r, q, clock = Recorder(["a", "b"], failing={"a"}), WorkQueue[str](), Clock()
    drain(r, q, clock)
    assert r.written == ["b@100"]  # b is written though a failed before it
    waits = []
    for _ in range(5):
        due = q.next_retry()
        assert due is not None
        waits.append(due - clock.now)
        clock.now = due - 0.01
        assert drain(r, q, clock) == 0  # not yet due
        clock.now = due
        assert drain(r, q, clock) == 1  # due: decided again, fails again
    assert waits == [1, 2, 4, 8, 8]  # doubled up to max_retry_seconds
    r.failing.clear()
    clock.now = q.next_retry() or 0
    assert drain(r, q, clock) == 1 and r.written[-1] == f"a@{clock.now:g}"
    assert q.next_retry() is None  # a success ends the backoff


def test_a_replica_that_does_not_lead_decides_and_writes_nothing_and_keeps_the_marks() -> None:
    r, q, clock = Recorder(["a", "b"]), WorkQueue[str](), Clock()
    assert drain(r, q, clock, leading=False) == 0 and r.decided == [] and r.written == []
    assert drain(r, q, clock, leading=True) == 2  # the first pass's "every key" was kept


def test_the_loop_decides_on_a_mark_made_while_it_waits_and_stops() -> None:
    r, q = Recorder(["a", "b"]), WorkQueue[str]()
    fast = KernelSettings(resync_seconds=3600, debounce_seconds=0.01)

    async def scenario() -> list[str]:
        stop = asyncio.Event()
        task = asyncio.create_task(kernel.run(r, q, fast, stop))
        while len(r.written) < 2:  # the first pass: every key
            await asyncio.sleep(0.01)
        # A write's answer (or a watch event), recorded on the loop while it waits.
        asyncio.get_running_loop().call_soon(q.mark, "b")
        while len(r.written) < 3:
            await asyncio.sleep(0.01)
        stop.set()
        q.mark("a")  # wakes it to see the stop
        await asyncio.wait_for(task, 5)
        return r.written

    written = asyncio.run(scenario())
    assert [w.split("@")[0] for w in written] == ["a", "b", "b"]


def test_the_loop_waiting_for_its_resync_stops_at_the_stop_alone() -> None:
    """No mark and an hour to the resync: the stop ends the wait (the operator's shutdown
    waits for its loops, and kopf cancels those still running 5 s into it: kube.process.run)."""
    r, q = Recorder(["a"]), WorkQueue[str]()
    idle = KernelSettings(resync_seconds=3600, debounce_seconds=0)

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(kernel.run(r, q, idle, stop))
        while not r.written:  # the first pass, then it waits
            await asyncio.sleep(0.01)
        stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())
    assert [w.split("@")[0] for w in r.written] == ["a"]  # no pass at the stop


def test_the_loop_decides_every_key_again_at_each_resync() -> None:
    r, q = Recorder(["a"]), WorkQueue[str]()
    quick = KernelSettings(resync_seconds=0.05, debounce_seconds=0)

    async def scenario() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(kernel.run(r, q, quick, stop))
        await asyncio.sleep(0.4)
        stop.set()
        q.mark("a")
        await asyncio.wait_for(task, 5)
        return len(r.decided)

    assert asyncio.run(scenario()) >= 3  # no mark after the first pass: the resyncs decided


@pytest.mark.parametrize("wait", [1.0, 3.0])
def test_backoff_starts_at_the_retry_setting(wait: float) -> None:
    q = WorkQueue[str]()
    settings = KernelSettings(retry_seconds=wait, max_retry_seconds=60)
    q.failed("a", 10.0, settings)
    assert q.next_retry() == 10.0 + wait


def test_a_decision_that_raises_is_retried_and_stops_nothing() -> None:
    r, q, clock = Recorder(["a", "broken", "c"]), WorkQueue[str](), Clock()
    assert drain(r, q, clock) == 3 and r.written == ["a@100", "c@100"]
    assert q.next_retry() == 101  # taken again after its backoff


@dataclass
class Slow(PassHooks[str]):
    """A reconciler whose writes take a while and overlap: how many were in flight at once,
    decisions taken in reverse order, and the passes' hooks recorded."""

    every: list[str]
    in_flight: int = 0
    most: int = 0
    decided: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)

    def keys(self) -> list[str]:
        return list(self.every)

    def order(self, keys: list[str]) -> list[str]:
        return sorted(keys, reverse=True)

    def before_pass(self, queue: WorkQueue[str], now: float) -> None:
        self.hooks.append("before")

    def after_pass(self, now: float) -> None:
        self.hooks.append(f"after {self.in_flight} in flight")

    def decide(self, key: str, now: float) -> str:
        self.decided.append(key)
        return key

    async def write(self, key: str, writes: str) -> None:
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1


@pytest.mark.parametrize("writers", [1, 3])
def test_writes_go_out_at_most_writers_at_a_time_and_the_pass_ends_when_all_answered(
    writers: int,
) -> None:
    r, q = Slow([f"k{i}" for i in range(7)]), WorkQueue[str]()
    settings = KernelSettings(debounce_seconds=0, writers=writers)
    assert asyncio.run(kernel.drain(r, q, settings, clock=Clock())) == 7
    assert r.most == writers
    assert r.decided == [f"k{i}" for i in range(6, -1, -1)]  # the reconciler's order
    assert r.hooks == ["before", "after 0 in flight"]


def test_before_pass_marks_what_the_clock_changed_and_pass_seconds_runs_it_unmarked() -> None:
    class Deadline(Recorder):
        """`late` is decided at each pass, marked by the clock alone (a deadline pending)."""

        def before_pass(self, queue: WorkQueue[str], now: float) -> None:
            queue.mark("late", wake=False)

    r = Deadline(["a", "late"])
    ticking = KernelSettings(resync_seconds=3600, debounce_seconds=0, pass_seconds=0.05)

    async def scenario(settings: KernelSettings) -> list[str]:
        r.decided.clear()
        q = WorkQueue[str]()
        stop = asyncio.Event()
        task = asyncio.create_task(kernel.run(r, q, settings, stop))
        await asyncio.sleep(0.4)
        stop.set()
        q.wake()
        await asyncio.wait_for(task, 5)
        return r.decided

    decided = asyncio.run(scenario(ticking))
    assert decided[:2] == ["a", "late"]  # the first pass: every key
    assert decided.count("late") >= 4 and decided.count("a") == 1
    # Without pass_seconds nothing wakes the loop after its first pass.
    decided = asyncio.run(scenario(KernelSettings(resync_seconds=3600, debounce_seconds=0)))
    assert decided == ["a", "late"]
