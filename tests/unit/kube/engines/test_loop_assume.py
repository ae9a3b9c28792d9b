"""Placement without a round trip per engine: each status patch is assumed in the cache at once
(`Cache.assume_status`), the next engine decided against it while the patch is in flight, and a
failed patch dropped (`Cache.settle_status`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.client.merge_patch import merge_patch
from continuum_operator.kube.engines.loop import Loop
from continuum_operator.kube.state.cache import Cache
from tests.support.builders import tree
from tests.support.engine_loop import NOW, FakeApi, agent_lease, engine_on, node_board
from tests.support.fakes import Awaited

GiB = 2**30
FREE_FROM = 60  # GiB of the GPU used before any engine


def device_leased(cache: Cache) -> int:
    """Bytes leased on the GPU by every engine, as the cache holds them."""
    return sum(
        p["bytes"]
        for b in cache.engines.values()
        for p in ((b.get("status") or {}).get("placement") or {}).get("pools", [])
        if p["pool"] == "device/0"
    )


class SideBySideApi(Awaited):
    """Status patches wait together until `parties` of them are in flight at once (a loop that
    awaits each patch before deciding the next never gets there: the wait gives up, and
    `broken` says so); the patch of each engine in `failing` fails."""

    def __init__(self, cache: Cache, parties: int, failing: set[str]) -> None:
        self.server = FakeApi(cache)
        super().__init__(self.server)
        self.parties = parties
        self.failing = failing
        self.broken = False
        self._barrier: tuple[asyncio.AbstractEventLoop, asyncio.Barrier] | None = None

    def barrier(self) -> asyncio.Barrier:
        """One barrier per event loop (each `asyncio.run` is a loop of its own)."""
        loop = asyncio.get_running_loop()
        if self._barrier is None or self._barrier[0] is not loop:
            self._barrier = (loop, asyncio.Barrier(self.parties))
        return self._barrier[1]

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        if self.parties > 1:
            try:
                await asyncio.wait_for(self.barrier().wait(), 10)
            except (asyncio.BrokenBarrierError, TimeoutError):
                self.broken = True
        name = path.split("/")[-2]
        if name in self.failing:
            raise ApiError(500, "InternalError", "etcd is away")
        return await super().merge_patch(path, patch)


def world(engines: int, parties: int, failing: set[str]) -> tuple[Loop, Cache, SideBySideApi]:
    cache = Cache(clock=lambda: NOW)
    api = SideBySideApi(cache, parties, failing)
    fake: Any = api
    real: AsyncKubeApi = fake
    loop = Loop(real, OperatorSettings(), cache, clock=lambda: NOW)
    cache.observe_node(
        {"metadata": {"name": "n0", "labels": {"node": "n0"}},
         "status": {"allocatable": {"nvidia.com/gpu": "1"}}},
        deleted=False,
    )  # fmt: skip
    # 20 GiB of the GPU's 80 free: less than two of these engines' full plans (11.8 GiB each).
    cache.observe_board(node_board("n0", used_gib=FREE_FROM), deleted=False)
    cache.observe_lease(agent_lease("n0", NOW - 1), deleted=False)
    for i in range(engines):
        cache.observe_engine(engine_on(f"e{i}", "n0", i), deleted=False)
        # Pods never start: every lease stays assumed, its bytes counted over the board's (a
        # running pod's are in the board, which this world never measures again).
        api.server.never_ready.add(f"e{i}")
    return loop, cache, api


def placed(cache: Cache) -> list[str]:
    return sorted(
        k[1] for k, b in cache.engines.items() if (b.get("status") or {}).get("placement")
    )


def test_status_patches_go_out_side_by_side_and_never_lease_the_same_bytes() -> None:
    loop, cache, api = world(engines=4, parties=4, failing=set())
    asyncio.run(loop.pass_once())
    assert not api.broken  # four patches were in flight at once
    # Each decided against the leases assumed before it: together they fit in what was free,
    # where four decisions against the same cache would each have taken 11.8 GiB.
    assert placed(cache)
    assert device_leased(cache) <= (80 - FREE_FROM) * GiB


def test_a_failed_status_patch_drops_its_lease_and_the_next_pass_places_again() -> None:
    loop, cache, api = world(engines=3, parties=3, failing={"e0"})
    asyncio.run(loop.pass_once())
    assert not api.broken
    assert "e0" not in placed(cache)  # assumed while e1 and e2 were decided, then dropped
    assert device_leased(cache) <= (80 - FREE_FROM) * GiB
    assert ("ns", "e0") in cache.engine_queue.take(cache.engines, 0)  # decided again
    api.failing.clear()
    api.parties = 1
    asyncio.run(loop.pass_once())
    assert "e0" in placed(cache) or "Insufficient" in str(cache.engines[("ns", "e0")]["status"])
    assert device_leased(cache) <= (80 - FREE_FROM) * GiB


def test_a_watch_event_while_a_patch_is_in_flight_keeps_the_patch() -> None:
    cache = Cache()
    body = engine_on("a", "n0", 1)
    cache.observe_engine(body, deleted=False)
    lease = {"node": "n0", "assumed": True, "pools": [{"pool": "device/0", "bytes": GiB}]}
    cache.assume_status(("ns", "a"), {"status": {"placement": lease}})
    assert cache.engines_on == {"n0": frozenset({("ns", "a")})}
    # Meanwhile the runtime wrote the Engine (a newer body, without the placement) and the grants
    # loop its GrantLedger.
    other = tree(merge_patch(body, {"metadata": {"resourceVersion": "7"},
                                    "status": {"runtime": {"slotReleases": []}}}))  # fmt: skip
    cache.observe_engine(other, deleted=False)
    ledger = {"metadata": {"namespace": "ns", "name": "a", "resourceVersion": "8"},
              "status": {"grants": []}}  # fmt: skip
    cache.observe_ledger(ledger, deleted=False)
    held = cache.engines[("ns", "a")]
    assert held["status"]["placement"] == lease and held["status"]["grants"] == []
    assert held["status"]["runtime"] == {"slotReleases": []}
    cache.settle_status(("ns", "a"), None)  # the patch failed
    assert cache.engines[("ns", "a")]["status"] == {**other["status"], "grants": []}
    assert cache.engines_on == {}


def test_the_answer_of_an_assumed_patch_replaces_it() -> None:
    cache = Cache()
    body = engine_on("a", "n0", 1)
    cache.observe_engine(body, deleted=False)
    patch = {"status": {"plan": {"node": "n0"}}}
    cache.assume_status(("ns", "a"), patch)
    answer = merge_patch(body, {"metadata": {"resourceVersion": "2"}, **patch})
    cache.settle_status(("ns", "a"), answer)
    assert cache.engines[("ns", "a")] == answer
    older = merge_patch(body, {"metadata": {"resourceVersion": "1"}})
    cache.observe_engine(older, deleted=False)  # a late watch event of before
    assert cache.engines[("ns", "a")] == answer


def test_a_merge_patch_removes_nulls_and_merges_objects() -> None:
    target = {"a": {"b": 1, "c": 2}, "d": [1, 2], "e": 3}
    assert merge_patch(target, {"a": {"b": None, "x": 5}, "d": [3], "e": None}) == {
        "a": {"c": 2, "x": 5},
        "d": [3],
    }
    assert target == {"a": {"b": 1, "c": 2}, "d": [1, 2], "e": 3}


def test_a_status_patch_that_raises_no_api_error_is_not_assumed_past_it() -> None:
    loop, cache, api = world(engines=1, parties=1, failing=set())

    async def broken(path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        raise ConnectionResetError("the API server went away")

    api.merge_patch = broken  # type: ignore[method-assign]
    asyncio.run(loop.pass_once())  # the kernel catches it: the other engines go on
    assert placed(cache) == []
    # Taken again after the kernel's backoff (a second), as any failed write.
    retry = cache.engine_queue.next_retry()
    assert retry is not None and ("ns", "e0") in cache.engine_queue.take(cache.engines, retry)
