"""The grants loop steps only the engines something changed for (`kube.grants.loop`): a Mind
created, changed or deleted marks the engine she names (and the one she named before); an Engine
whose body changed, whose review time or grace deadline came, or whose ledger write failed is
stepped again; every engine when the classes or quotas change, at a leader's first pass and every
`loop.full_resync_seconds` (the kernel's resync). Each test counts the `grant_ledger.step` calls of
a pass, by engine."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.grants.loop import GrantsLoop
from continuum_operator.kube.ledger import grant_ledger
from continuum_operator.kube.state.cache import EngineKey
from continuum_operator.kube.state.mind_cache import MindCache
from tests.support.grants_world import BASE, World, engine, mind

N = 6  # engines, each with two minds


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The engines `grant_ledger.step` was called for, in order."""
    calls: list[str] = []
    real = grant_ledger.step

    def counting(body: Any, *args: Any, **kwargs: Any) -> grant_ledger.LedgerStep:
        calls.append(str(body["metadata"]["name"]))
        return real(body, *args, **kwargs)

    monkeypatch.setattr(grant_ledger, "step", counting)
    return calls


def world(tmp_path: Path) -> tuple[World, Clock]:
    """N engines of three slots, two minds each, all granted by a first pass."""
    w = World(tmp_path)
    clock = Clock()
    w.loop.clock = clock
    w.cls("gold")
    for e in range(N):
        w.engine(engine("team-a", f"e{e}", slots=3))
        for i in range(2):
            w.mind(mind("team-a", f"m{e}-{i}", f"e{e}", second=i))
    w.loop.pass_once()
    return w, clock


def changed(w: World, ns: str, name: str, **spec: Any) -> dict[str, Any]:
    """A watch event of the Mind with `spec` changed (a newer resourceVersion)."""
    body = copy.deepcopy(w.api.objects[f"{BASE}/{ns}/minds/{name}"])
    body["spec"].update(spec)
    body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
    body["metadata"]["generation"] = int(body["metadata"].get("generation") or 1) + 1
    w.api.add(body, "minds")
    return body


def test_a_pass_with_nothing_changed_steps_no_ledger(tmp_path: Path, steps: list[str]) -> None:
    w, _ = world(tmp_path)
    assert sorted(set(steps)) == [f"e{e}" for e in range(N)]
    steps.clear()
    w.loop.pass_once()  # the cache's copies of our own ledger writes: the same bodies
    w.loop.pass_once()
    assert steps == []


def test_a_mind_created_steps_only_her_engine_and_her_status_is_written(
    tmp_path: Path, steps: list[str]
) -> None:
    w, _ = world(tmp_path)
    w.loop.pass_once()
    steps.clear()
    w.mind(mind("team-a", "new", "e3", second=9))
    w.loop.pass_once()
    assert steps == ["e3"]
    assert w.ledger("team-a", "e3")["team-a/new"] == ("Granted", "SlotFree")
    assert w.granted("team-a", "new")["status"] == "True"
    # Her projection was written by us: it marks nothing more.
    steps.clear()
    w.loop.pass_once()
    assert steps == []


def test_a_mind_queued_behind_others_is_told_so_though_the_ledger_only_gains_her(
    tmp_path: Path, steps: list[str]
) -> None:
    w, _ = world(tmp_path)
    w.mind(mind("team-a", "third", "e1", second=5))
    w.mind(mind("team-a", "fourth", "e1", second=6))  # three slots: she waits
    steps.clear()
    w.loop.pass_once()
    assert steps == ["e1"]
    assert w.ledger("team-a", "e1")["team-a/fourth"][0] == "Queued"
    assert w.granted("team-a", "fourth")["status"] == "False"


def test_a_mind_moved_to_another_engine_steps_both(tmp_path: Path, steps: list[str]) -> None:
    w, _ = world(tmp_path)
    steps.clear()
    w.cache.observe_mind(changed(w, "team-a", "m0-0", engine="e4"), deleted=False)
    w.loop.pass_once()
    assert sorted(set(steps)) == ["e0", "e4"]
    assert w.ledger("team-a", "e0")["team-a/m0-0"][0] == "Reclaiming"
    assert w.ledger("team-a", "e4")["team-a/m0-0"][0] == "Granted"


def test_a_mind_deleted_steps_her_engine(tmp_path: Path, steps: list[str]) -> None:
    w, _ = world(tmp_path)
    steps.clear()
    body = w.api.objects[f"{BASE}/team-a/minds/m2-1"]
    w.cache.observe_mind(body, deleted=True)
    w.loop.pass_once()
    assert steps == ["e2"]
    assert w.ledger("team-a", "e2")["team-a/m2-1"][0] == "Reclaiming"


def test_a_class_changed_steps_every_engine(tmp_path: Path, steps: list[str]) -> None:
    w, _ = world(tmp_path)
    steps.clear()
    w.cls("gold", priority=5)
    w.loop.pass_once()
    assert sorted(steps) == [f"e{e}" for e in range(N)]
    steps.clear()
    w.loop.pass_once()
    assert steps == []


def test_an_engine_changed_by_another_writer_is_stepped(tmp_path: Path, steps: list[str]) -> None:
    w, _ = world(tmp_path)
    steps.clear()
    body = copy.deepcopy(w.api.objects[f"{BASE}/team-a/engines/e5"])
    body["metadata"]["resourceVersion"] = str(int(body["metadata"]["resourceVersion"]) + 1)
    body["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    w.engine(body)
    w.loop.pass_once()
    assert steps == ["e5"]


def test_a_grace_deadline_forces_the_release_on_time_with_no_event(
    tmp_path: Path, steps: list[str]
) -> None:
    w, clock = world(tmp_path)
    w.cache.observe_mind(changed(w, "team-a", "m1-0", contextTokens=100_000), deleted=False)
    gone = copy.deepcopy(w.api.objects[f"{BASE}/team-a/minds/m4-0"])
    gone["metadata"]["deletionTimestamp"] = "2026-12-03T06:10:00Z"
    gone["metadata"]["resourceVersion"] = "5"
    w.api.add(gone, "minds")
    w.cache.observe_mind(gone, deleted=False)
    w.loop.pass_once()
    assert w.ledger("team-a", "e4")["team-a/m4-0"][0] == "Reclaiming"
    steps.clear()
    clock.now += 10  # before the deadline: nothing to do
    w.loop.pass_once()
    assert "e4" not in steps
    clock.now += w.loop.settings.grace_seconds  # past it, and no event at all
    steps.clear()
    w.loop.pass_once()
    assert "e4" in steps
    assert "team-a/m4-0" not in w.ledger("team-a", "e4")


def test_a_ledger_write_that_failed_is_stepped_again(tmp_path: Path, steps: list[str]) -> None:
    w, clock = world(tmp_path)
    real = w.api.request
    failures = [ApiError(500, "InternalError", "etcd is slow")]

    def flaky(method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        if method == "PUT" and failures:
            raise failures.pop()
        return real(method, path, body, **kw)

    w.api.request = flaky  # type: ignore[method-assign]
    w.mind(mind("team-a", "new", "e2", second=9))
    w.loop.pass_once()
    assert "team-a/new" not in w.ledger("team-a", "e2")
    steps.clear()
    w.loop.pass_once()  # no event, and its backoff (the kernel's) not over: not yet
    assert steps == []
    clock.now += w.loop.kernel.retry_seconds
    w.loop.pass_once()  # no event: the engine is taken again once its backoff is over
    assert steps == ["e2"]
    assert w.ledger("team-a", "e2")["team-a/new"] == ("Granted", "SlotFree")


def test_every_engine_is_stepped_at_the_full_pass(tmp_path: Path, steps: list[str]) -> None:
    w, clock = world(tmp_path)
    w.loop.pass_once()
    steps.clear()
    clock.now += w.loop.kernel.resync_seconds
    w.loop.pass_once()
    assert sorted(steps) == [f"e{e}" for e in range(N)]


def test_a_new_leader_recovers_every_engines_journal_at_its_first_pass(tmp_path: Path) -> None:
    w, _ = world(tmp_path)
    path = tmp_path / "log.jsonl"
    # A machine crash lost the lines of the last steps (not yet synced): here, all of them.
    path.write_text("")
    successor = GrantsLoop(
        w.api.aio,  # type: ignore[arg-type]
        w.loop.settings,
        w.engines,
        w.cache,
        clock=w.loop.clock,
    )
    successor.pass_once()
    logged = {(x["engine"], x["seq"]) for x in map(json.loads, path.read_text().splitlines())}
    assert logged == {(f"team-a/e{e}", 1) for e in range(N)}


def test_a_second_loop_built_over_the_minds_cache_leaves_the_first_ones_queue_alone(
    tmp_path: Path, steps: list[str]
) -> None:
    # A loop rewired the Minds' cache's queue as it was built (its resync time reset): the loop
    # already draining that queue then stepped every engine at its next pass, nothing changed.
    w, _ = world(tmp_path)
    steps.clear()
    GrantsLoop(w.api.aio, w.loop.settings, w.engines, w.cache, clock=w.loop.clock)  # type: ignore[arg-type]
    w.loop.pass_once()
    assert steps == []


def marked(cache: MindCache) -> set[EngineKey]:
    """The engines marked on the grants loop's queue since the last call; the marks cleared."""
    return set(cache.queue.take((), 0.0))


def test_what_marks_a_minds_engine_in_the_cache() -> None:
    cache = MindCache()
    marked(cache)  # a new queue's first take is of every key (here none)
    body = mind("team-a", "ann", "coder")
    cache.observe_mind(body, deleted=False)
    assert marked(cache) == {("team-a", "coder")}
    # Our own write's answer: a finalizer or a status marks nothing; its watch echo (the same
    # resourceVersion) neither.
    ours = copy.deepcopy(body)
    ours["metadata"].update(resourceVersion="2", finalizers=["continuum.dev/grant"])
    ours["status"] = {"grant": {"state": "Granted"}}
    cache.observe_mind(ours, deleted=False, nudge=False)
    cache.observe_mind(ours, deleted=False)
    assert marked(cache) == set()
    # A newer version from the watch (someone else wrote her) marks her engine.
    theirs = copy.deepcopy(ours)
    theirs["metadata"]["resourceVersion"] = "3"
    theirs["status"] = {}
    cache.observe_mind(theirs, deleted=False)
    assert marked(cache) == {("team-a", "coder")}
    # Moved to another engine (in another namespace): both; the groups follow her.
    moved = copy.deepcopy(theirs)
    moved["metadata"]["resourceVersion"] = "4"
    moved["spec"].update(engine="big", engineNamespace="shared")
    cache.observe_mind(moved, deleted=False, nudge=False)
    assert marked(cache) == {("team-a", "coder"), ("shared", "big")}
    assert cache.minds_of([("team-a", "coder"), ("shared", "big")]) == {("shared", "big"): [moved]}
    # Her deletion starting marks her engine even as our own write's answer.
    going = copy.deepcopy(moved)
    going["metadata"].update(resourceVersion="5", deletionTimestamp="2026-12-03T06:10:00Z")
    cache.observe_mind(going, deleted=False, nudge=False)
    assert marked(cache) == {("shared", "big")}
    cache.observe_mind(going, deleted=True)
    assert marked(cache) == {("shared", "big")}
    assert cache.engine_keys() == set()
