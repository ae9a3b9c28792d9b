"""EmbedLanes on the controller kernel: the cache marks a lane when it, the Engine it follows
or the room on its node changed, and the lanes' reconciler decides only those (it decided
every lane at every plan pass before, with no dirty set)."""

from __future__ import annotations

import asyncio
from typing import Any

from continuum_operator.kube.base import kernel
from continuum_operator.kube.base.kernel import KernelSettings
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.lanes.loop import LaneLoop
from continuum_operator.kube.state.cache import Cache
from tests.support.fakes import FakeKubeApi
from tests.support.lanes import engine, lane

NOW = 1_000.0


def marked(cache: Cache) -> list[tuple[str, str]]:
    return cache.lane_queue.take([], NOW)


def test_the_cache_marks_the_lanes_a_change_may_move_and_no_others() -> None:
    cache = Cache()
    cache.lane_queue.take([], NOW)  # past the first pass's "every lane"
    for body in (lane("beside-a", "coder", node="n1"), lane("beside-b", "other", node="n2"),
                 lane("unplaced", "coder"), lane("own", None, node="n2")):  # fmt: skip
        cache.observe_lane(body, deleted=False, nudge=False)
    assert len(marked(cache)) == 4  # each lane that changed
    cache.observe_engine(engine("coder"), deleted=False, nudge=False)
    assert marked(cache) == [("ns", "beside-a"), ("ns", "unplaced")]  # the lanes beside it
    cache.observe_engine(engine("coder", ns="elsewhere"), deleted=False, nudge=False)
    assert marked(cache) == []  # an Engine of the same name in another namespace
    cache.mark_nodes(["n1"])
    # Placed on n1, and the lanes that may go anywhere (not placed, a model of their own).
    assert marked(cache) == [("ns", "beside-a"), ("ns", "own"), ("ns", "unplaced")]
    cache.mark_nodes([])
    assert marked(cache) == []


def test_the_lanes_reconciler_decides_and_writes_only_the_lanes_marked() -> None:
    api = FakeKubeApi()
    cache = Cache()
    for name in ("a", "b"):
        body = lane(name, "missing")
        api.add(body, "embedlanes")
        cache.observe_lane(body, deleted=False, nudge=False)
    fake: Any = api.aio
    lanes = LaneLoop(fake, OperatorSettings(), cache, lambda: NOW)
    settings = KernelSettings()

    def drain() -> int:
        return asyncio.run(kernel.drain(lanes, cache.lane_queue, settings, clock=lambda: NOW))

    def patched() -> list[str]:
        return [c.path.split("/")[-2] for c in api.calls if c.method == "PATCH"]

    assert drain() == 2 and patched() == ["a", "b"]  # EngineNotFound, said once each
    api.calls.clear()
    # Their own writes' answers marked them: decided again, nothing to write.
    assert drain() == 2 and patched() == []
    assert drain() == 0  # nothing changed, nothing decided
    cache.observe_engine(engine("missing"), deleted=False, nudge=False)
    assert drain() == 2  # the Engine they name appeared


def test_an_operator_of_an_engine_selector_decides_only_its_own_lanes() -> None:
    # Its own: beside an Engine it serves, or labelled as its selector asks, but never beside
    # an Engine another operator serves (its GrantLedger is watched here), whatever its labels:
    # another operator's lane decided here too was told EngineNotFound here and Placed there.
    api = FakeKubeApi()
    cache = Cache()
    cache.observe_engine(engine("ours"), deleted=False, nudge=False)
    theirs = {"metadata": {"namespace": "ns", "name": "theirs", "resourceVersion": "7"}}
    cache.observe_ledger({**theirs, "status": {"grants": []}}, deleted=False, nudge=False)
    labelled, mislabelled = lane("labelled", "missing"), lane("mislabelled", "theirs")
    for body in (labelled, mislabelled):
        body["metadata"]["labels"] = {"shard": "a"}
    for body in (lane("beside-ours", "ours"), lane("beside-theirs", "theirs"), labelled,
                 mislabelled, lane("own-unlabelled", None)):  # fmt: skip
        api.add(body, "embedlanes")
        cache.observe_lane(body, deleted=False, nudge=False)
    fake: Any = api.aio
    lanes = LaneLoop(fake, OperatorSettings(), cache, lambda: NOW, {"shard": "a"})
    taken = lanes.keys()  # the kernel's keys, not a mapping's
    assert sorted(k[1] for k in taken) == ["beside-ours", "labelled"]
    asyncio.run(kernel.drain(lanes, cache.lane_queue, KernelSettings(), clock=lambda: NOW))
    written = sorted({c.path.split("/")[-2] for c in api.calls if c.method == "PATCH"})
    assert written == ["beside-ours", "labelled"]
    everyone = LaneLoop(fake, OperatorSettings(), cache, lambda: NOW)
    assert len(everyone.keys()) == 5  # no selector: every lane
