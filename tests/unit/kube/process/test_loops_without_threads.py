"""The loops' API calls are awaited on the event loop, not run in its executor's threads
(`kube.client.async_api`): with an executor that runs nothing, the Engines' loop still places and
launches its engines, the lanes' loop writes its lanes and the placed pods reach their boards.
When each call went through `asyncio.to_thread`, every write here failed (or waited for a
thread: the executor was sized for them, `kube.process.run.api_threads`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from continuum_operator.kube.base import kernel
from continuum_operator.kube.base.kernel import KernelSettings
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.lanes.loop import LaneLoop
from continuum_operator.kube.nodes.placed_pods import CONSUMER_LABELS, PlacedPods
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.workloads.engine_objects import ENGINE_LABEL
from tests.support.engine_loop import NOW, World, node_board
from tests.support.fakes import FakeKubeApi
from tests.support.lanes import lane
from tests.support.placed_pods import list_pods
from tests.support.threads import NoThreads, T


def without_threads(work: Callable[[], Coroutine[Any, Any, T]]) -> tuple[T, list[str]]:
    """`work` on an event loop whose default executor is `NoThreads`; what it asked of it."""
    refusing = NoThreads()

    async def main() -> T:
        asyncio.get_running_loop().set_default_executor(refusing)
        return await work()

    return asyncio.run(main()), refusing.asked


def test_the_engines_loop_places_and_launches_without_a_thread() -> None:
    w = World()
    asked: list[str] = []
    for _ in range(4):  # placed, launched, ready: as `World.settle`, each pass on no threads
        _, more = without_threads(w.loop.pass_once)
        asked += more
    assert asked == []
    placed = [k for keys in w.on.values() for k in keys]
    assert placed and all(w.ready(k) for k in placed)
    assert sum(1 for body in w.api.applied if body["kind"] == "Deployment") == len(placed)


def test_the_lanes_loop_writes_without_a_thread() -> None:
    api, cache = FakeKubeApi(), Cache()
    body = lane("a", "missing")
    api.add(body, "embedlanes")
    cache.observe_lane(body, deleted=False, nudge=False)
    lanes = LaneLoop(api.aio, OperatorSettings(), cache, lambda: NOW)  # type: ignore[arg-type]

    async def drain() -> int:
        return await kernel.drain(lanes, cache.lane_queue, KernelSettings(), clock=lambda: NOW)

    decided, asked = without_threads(drain)
    assert (decided, asked) == (1, [])
    # The Deployment an earlier process may have left deleted once (it gets no pod), its
    # status (EngineNotFound), then the Event that says so.
    assert [c.method for c in api.calls] == ["DELETE", "PATCH", "POST"]


def test_the_placed_pods_reach_their_board_without_a_thread() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u1",
            "labels": {ENGINE_LABEL: "coder"},
        },
        "spec": {"nodeName": "n0"},
        "status": {"phase": "Running"},
    }
    board = node_board("n0")
    api, cache = FakeKubeApi([pod]), Cache()
    api.add(board, "nodeboards")
    cache.observe_board(board, deleted=False)
    publisher = PlacedPods(api.aio, cache)  # type: ignore[arg-type]

    async def listed_then_published() -> int:
        for label, kind in CONSUMER_LABELS:
            await list_pods(publisher, label, kind)
        return await publisher.publish_once()

    written, asked = without_threads(listed_then_published)
    assert (written, asked) == (1, [])
    assert api.objects["/apis/continuum.dev/v1alpha1/nodeboards/n0"]["spec"]["placed"] == [
        {"uid": "u1", "kind": "Engine", "namespace": "ns", "name": "coder"}
    ]
