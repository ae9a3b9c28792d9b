"""A relaunch's Deployment waits for the drain of the grants of the engine it replaces
(`Loop.held_for_drain`, `grant_ledger.holds_another_launch`): strategy Recreate would stop the old
pod before its gateway reports the releases, and they would only be forced at grace."""

from __future__ import annotations

import asyncio
from typing import Any

from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.engines.engine_pass import Memory, Writes
from continuum_operator.kube.engines.loop import DRAIN_HOLD_SECONDS, Loop
from continuum_operator.kube.ledger import grant_ledger
from continuum_operator.kube.state.cache import Cache, DeploymentEntry
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ANNOTATION
from tests.support.builders import observe_with_ledger
from tests.support.fakes import FakeKubeApi

OLD_PLAN = {"node": "n1", "engineArgs": ["-np", "2"], "mindsGrantable": 2}
NEW_PLAN = {"node": "n1", "engineArgs": ["-np", "3"], "mindsGrantable": 3}


def engine(plan: dict[str, Any], recorded: dict[str, Any], states: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": "coder", "resourceVersion": "5"},
        "spec": {},
        "status": {
            "plan": plan,
            grant_ledger.CAPACITY_FIELD: {"launch": grant_ledger.launch_of(recorded), "slots": 2},
            "grants": [{"mind": f"ns/m{i}", "state": s} for i, s in enumerate(states)],
        },
    }


def deployment(launch: str) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "namespace": "ns",
            "name": "coder",
            "annotations": {LAUNCH_ANNOTATION: launch},
        },
    }


class World:
    def __init__(self, body: dict[str, Any]) -> None:
        self.now = 1_000.0
        self.api = FakeKubeApi()
        cache = Cache(clock=lambda: self.now)
        observe_with_ledger(cache, body)
        cache.deployments[("ns", "coder")] = DeploymentEntry("old-launch", 1, 1, 1, 1, 1)
        fake: Any = self.api.aio
        real: AsyncKubeApi = fake
        self.loop = Loop(real, OperatorSettings(), cache, clock=lambda: self.now)
        self.body = body

    def apply(self) -> list[dict[str, Any]]:
        writes = Writes(
            status_patch=None,
            deployment=deployment("new-launch"),
            service=None,
            delete_workload=False,
            events=(),
            memory=Memory(),
        )
        asyncio.run(self.loop.apply_workload(("ns", "coder"), self.body, writes))
        return self.api.applied


def test_the_ledger_holds_another_launch_only_while_it_has_holders_of_it() -> None:
    draining = engine(NEW_PLAN, OLD_PLAN, ["Granted", "Reclaiming", "Queued"])
    assert grant_ledger.holds_another_launch(draining["status"])
    drained = engine(NEW_PLAN, OLD_PLAN, ["Queued", "Queued"])
    assert not grant_ledger.holds_another_launch(drained["status"])
    same = engine(OLD_PLAN, OLD_PLAN, ["Granted"])
    assert not grant_ledger.holds_another_launch(same["status"])


def test_a_relaunch_waits_for_the_drain_then_goes_out() -> None:
    w = World(engine(NEW_PLAN, OLD_PLAN, ["Granted", "Reclaiming"]))
    assert w.apply() == []  # the old engine still holds grants of its launch
    w.now += 5
    assert w.apply() == []
    # Drained: the grants loop wrote the ledger for the new launch.
    drained = engine(NEW_PLAN, NEW_PLAN, ["Queued", "Queued"])
    drained["metadata"]["resourceVersion"] = "6"
    observe_with_ledger(w.loop.cache, drained)
    applied = w.apply()
    assert [d["metadata"]["annotations"][LAUNCH_ANNOTATION] for d in applied] == ["new-launch"]


def test_a_drain_that_never_ends_holds_the_relaunch_no_longer_than_the_limit() -> None:
    w = World(engine(NEW_PLAN, OLD_PLAN, ["Reclaiming"]))
    assert w.apply() == []
    w.now += DRAIN_HOLD_SECONDS - 1
    assert w.apply() == []
    w.now += 2
    assert len(w.apply()) == 1


def test_a_first_launch_is_never_held() -> None:
    w = World(engine(NEW_PLAN, OLD_PLAN, ["Granted"]))
    w.loop.cache.deployments.clear()
    assert len(w.apply()) == 1
