"""A pass decides only the engines that may decide differently (`Loop._to_decide`): those whose
inputs changed (`Cache.take_dirty`), those whose board went stale by the clock alone, those not
quiet (a deadline may fire), and every engine at the full resync."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import pytest

from continuum_operator.kube.engines import loop as loop_module
from continuum_operator.kube.engines.engine_pass import Memory, Writes
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.ledger import grant_ledger
from continuum_operator.kube.state.cache import Cache, EngineKey
from continuum_operator.model.base import API_VERSION
from tests.support.engine_loop import NOW, GiB, World, agent_lease, engine_on, node_board


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    w = World()
    _count(monkeypatch, w)
    return w


def _count(monkeypatch: pytest.MonkeyPatch, w: World) -> None:
    real = reconcile

    def counted(body: Any, snap: Any, memory: Memory, now: float, settings: Any) -> Writes:
        w.decided.append((body["metadata"]["namespace"], body["metadata"]["name"]))
        return real(body, snap, memory, now, settings)

    monkeypatch.setattr(loop_module, "reconcile", counted)


def test_a_pass_with_nothing_changed_decides_nothing(world: World) -> None:
    world.settle()
    assert world.pass_once() == set()
    assert world.api.requests == []
    # ... the engine no node takes included: it is decided again when a node's room changes.
    world.now += 30
    assert world.pass_once() == set()


def test_a_board_change_decides_the_engines_of_its_node_and_those_not_placed(world: World) -> None:
    world.settle()
    world.cache.observe_board(node_board("n1", used_gib=1, rv=2), deleted=False)
    assert world.pass_once() == world.on["n1"] | {world.nowhere}
    # Each of n1's engines wrote the node's new reading into the plan it keeps
    # (`core.replan`): decided once more after its write, writing nothing, and quiet then.
    assert world.pass_once() == world.on["n1"]
    assert world.pass_once() == set()


def test_a_board_event_changing_nothing_a_decision_reads_decides_no_engine(world: World) -> None:
    # Its words (the mode's reason, a GPU's name, evidence): before, each such event decided
    # the engines of the node and every engine placed nowhere, cluster-wide, so one agent
    # rewording its board kept best fit running over every board.
    world.settle()
    for rv, reason in ((2, "x"), (3, "y"), (4, "x")):
        body = node_board("n1", rv=rv)
        body["status"]["memoryModeReason"] = reason
        world.cache.observe_board(body, deleted=False)
        assert world.pass_once() == set()
    assert world.cache.boards["n1"].resource_version == "4"  # the reading is the newest
    world.cache.observe_board(node_board("n1", used_gib=1, rv=5), deleted=False)
    assert world.pass_once() == world.on["n1"] | {world.nowhere}  # its room did change


def test_an_engine_watch_event_decides_that_engine(world: World) -> None:
    world.settle()
    key = sorted(world.on["n2"])[0]
    changed = copy.deepcopy(world.cache.engines[key])
    changed["metadata"]["resourceVersion"] = "9999"
    changed["metadata"].setdefault("annotations", {})["team"] = "b"
    world.cache.observe_engine(changed, deleted=False)
    assert world.pass_once() == {key}


def _ledger(body: Mapping[str, Any], launch: str, state: str, version: int) -> dict[str, Any]:
    """The GrantLedger of `body`'s Engine as the grants loop writes it: one mind, for `launch`."""
    meta = body["metadata"]
    return {
        "metadata": {"namespace": meta["namespace"], "name": meta["name"],
                     "resourceVersion": str(version)},
        "status": {
            "grants": [{"mind": "ns/m0", "state": state, "tokens": 4096, "slot": 0}],
            "grantCapacity": {"phase": "Serving", "slots": 4, "launch": launch},
            "grantStep": {"seq": 1, "t": "2027-01-15T08:00:00Z", "lines": []},
        },
    }  # fmt: skip


def test_a_ledger_write_alone_decides_no_plan(world: World) -> None:
    # The grants loop writes an Engine's GrantLedger once a granted mind, and no plan reads the
    # ledger: deciding the engine again for each would cost the plan loop a pass per grant.
    world.settle()
    key = sorted(world.on["n2"])[0]
    body = world.cache.engines[key]
    launch = grant_ledger.launch_of(body["status"].get("plan") or {})
    assert launch is not None
    world.cache.observe_ledger(_ledger(body, launch, "Granted", 1), deleted=False)
    assert world.cache.engines[key]["status"]["grants"][0]["state"] == "Granted"  # merged
    assert world.pass_once() == set()


def test_a_ledger_write_decides_the_plan_while_a_relaunch_waits_for_the_drain(
    world: World,
) -> None:
    # A relaunch's Deployment waits while the ledger holds grants of the old launch: the write
    # that releases the last of them is what lets it go (`Loop.held_for_drain`).
    world.settle()
    key = sorted(world.on["n2"])[0]
    world.cache.observe_ledger(_ledger(world.cache.engines[key], "old-launch", "Granted", 1),
                               deleted=False)  # fmt: skip
    assert key in world.pass_once()
    world.pass_once()
    world.cache.observe_ledger(_ledger(world.cache.engines[key], "old-launch", "Released", 2),
                               deleted=False)  # fmt: skip
    assert key in world.pass_once()
    # Decided with the ledger merged into its body: planned as before, not an invalid spec.
    conditions = world.cache.engines[key]["status"]["conditions"]
    planned = [c for c in conditions if c["type"] == "Planned"]
    assert planned and planned[0]["status"] == "True", planned


def test_an_engine_deleted_decides_the_engines_left_on_its_node(world: World) -> None:
    world.settle()
    gone = sorted(world.on["n3"])[0]
    world.cache.observe_engine(world.cache.engines[gone], deleted=True)
    assert world.pass_once() == (world.on["n3"] - {gone}) | {world.nowhere}


def test_an_agent_lease_that_expires_with_no_event_marks_its_engines_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = World(short_lease="n2")
    _count(monkeypatch, w)
    w.settle()
    w.now += 30  # n2's Lease (20 s) expired; nothing was observed
    assert w.pass_once() == w.on["n2"] | {w.nowhere}
    for key in w.on["n2"]:
        assert w.condition(key, "Degraded")["reason"] == "LeaseExpired"
    for key in w.on["n1"]:
        assert w.condition(key, "Degraded")["status"] == "False"
    # Renewed: fresh again, through the Lease's own watch event.
    w.cache.observe_lease(agent_lease("n2", w.now, 20, rv=2), deleted=False)
    assert w.pass_once() == w.on["n2"] | {w.nowhere}
    for key in w.on["n2"]:
        assert w.condition(key, "Degraded")["status"] == "False"


def test_the_full_resync_decides_every_engine(world: World) -> None:
    world.settle()
    world.now += 61
    everyone = set(world.cache.engines)
    assert world.pass_once() == everyone
    world.now += 5
    assert world.pass_once() == set()


def test_an_engine_whose_pod_never_starts_is_released_at_the_timeout_with_no_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    w = World()
    _count(monkeypatch, w)
    stuck: EngineKey = sorted(w.on["n0"])[0]
    w.api.never_ready.add(stuck[1])
    for _ in range(4):
        w.pass_once()
    assert not w.ready(stuck)
    assert w.cache.engines[stuck]["status"]["placement"]["node"] == "n0"
    # Not quiet (its pod is not ready): decided at every pass, so its deadline fires.
    assert stuck in w.pass_once()
    w.now += w.loop.settings.placement.pod_start_timeout_seconds + 1
    w.pass_once()
    reasons = [o["reason"] for o in w.api.created if o["kind"] == "Event"]
    assert "PodNeverStarted" in reasons
    assert "placement" not in w.cache.engines[stuck]["status"]


def test_the_unschedulable_gauge_counts_engines_skipped_as_quiet(world: World) -> None:
    world.settle()
    world.pass_once()
    assert world.loop.metrics.unschedulable._value.get() == 1


def taken(cache: Cache) -> set[EngineKey]:
    """What the Engines' next pass takes from the cache's marks (`Loop.before_pass` first
    marks the engines not placed, if a node's room changed)."""
    cache.mark_unplaced()
    return set(cache.engine_queue.take(cache.engines, NOW))


def test_cache_marks_by_what_each_observation_can_change() -> None:
    cache = Cache()
    cache.observe_engine(engine_on("z", "n1", 1), deleted=False)
    assert taken(cache) == {("ns", "z")}  # at first, every engine
    assert taken(cache) == set()
    cache.observe_engine(engine_on("z", "n1", 1), deleted=True)
    taken(cache)
    placed = engine_on("a", "n1", 1)
    placed["status"] = {
        "placement": {"node": "n1", "assumed": False,
                      "pools": [{"pool": "device/0", "bytes": GiB}]},
    }  # fmt: skip
    cache.observe_engine(placed, deleted=False)
    cache.observe_engine(engine_on("b", "n2", 2), deleted=False)  # not placed
    assert taken(cache) == {("ns", "a"), ("ns", "b")}
    cache.observe_board(node_board("n9"), deleted=False)  # no engine there
    assert taken(cache) == {("ns", "b")}  # those not placed may place there
    cache.observe_node({"metadata": {"name": "n1", "labels": {"x": "y"}}}, deleted=False)
    assert taken(cache) == {("ns", "a"), ("ns", "b")}
    cache.observe_deployment(
        {"metadata": {"namespace": "ns", "name": "b", "resourceVersion": "3"}}, deleted=False
    )
    assert taken(cache) == {("ns", "b")}
    cache.observe_job(
        {"metadata": {"namespace": "ns", "name": "j", "labels": {"continuum.dev/facts-for": "a"}}},
        deleted=False,
    )
    assert taken(cache) == {("ns", "a")}
    lane: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "EmbedLane",
        "metadata": {"namespace": "ns", "name": "lane", "resourceVersion": "1"},
        "status": {"placement": {"node": "n1", "pools": [{"pool": "host", "bytes": GiB}]}},
    }
    cache.observe_lane(lane, deleted=False)
    assert taken(cache) == {("ns", "a"), ("ns", "b")}
    cache.observe_lane({**lane, "metadata": {**lane["metadata"], "resourceVersion": "2"}}, False)
    assert taken(cache) == set()  # its bytes did not move
    cache.engine_queue.mark_all()
    assert taken(cache) == {("ns", "a"), ("ns", "b")}
