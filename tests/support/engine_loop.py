"""The Engines' loop against a fake API server: a world of nodes, boards, agent Leases and
engines (`World`), for the tests of what a pass marks and writes."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Mapping
from typing import Any

from continuum_operator.core.heartbeat import agent_lease_metadata
from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.base.settings import LoopSettings, OperatorSettings
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.client.merge_patch import merge_patch
from continuum_operator.kube.engines.loop import Loop
from continuum_operator.kube.state.cache import Cache, EngineKey
from tests.support.builders import board_body, engine_body
from tests.support.fakes import FakeKubeApi

GiB = 2**30


NOW = 1_800_000_000.0


NODES = ("n0", "n1", "n2", "n3")


PER_NODE = 2


class FakeApi(FakeKubeApi):
    """The API server as the loop sees it: status patches merged into the cached Engine (the
    engines live in the cache alone), every Deployment ready at once unless its engine is in
    `never_ready`; resourceVersions from one counter, as etcd's."""

    def __init__(self, cache: Cache) -> None:
        super().__init__()
        self.cache = cache
        self.rv = 100
        self.never_ready: set[str] = set()

    def next_version(self, old: str | None) -> str:
        self.rv += 1
        return str(self.rv)

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self._record("PATCH", path, patch)
        parts = path.split("/")
        known = self.cache.engines[(parts[-4], parts[-2])]
        body: dict[str, Any] = copy.deepcopy(merge_patch(known, {"status": patch["status"]}))
        body["metadata"]["resourceVersion"] = self.next_version(None)
        return body

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        answer = super().apply(obj)
        if obj["kind"] == "Deployment" and obj["metadata"]["name"] not in self.never_ready:
            answer["status"] = {
                "observedGeneration": answer["metadata"]["generation"],
                "readyReplicas": 1,
                "updatedReplicas": 1,
                "replicas": 1,
            }
        return answer


def agent_lease(node: str, renewed: float, duration: int = 3600, rv: int = 1) -> dict[str, Any]:
    return {
        "metadata": {**agent_lease_metadata(node), "resourceVersion": str(rv)},
        "spec": {"renewTime": format_seconds(renewed), "leaseDurationSeconds": duration},
    }


def node_board(node: str, used_gib: int = 0, rv: int = 1) -> dict[str, Any]:
    body = board_body(
        "discrete",
        [
            {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 4 * GiB},
            {"kind": "device", "device": 0, "capacityBytes": 80 * GiB,
             "usedBytes": used_gib * GiB},
        ],
        name=node,
    )  # fmt: skip
    body["metadata"]["resourceVersion"] = str(rv)
    return body


def engine_on(name: str, node: str, second: int) -> dict[str, Any]:
    body = engine_body(placement={"nodeSelector": {"node": node}})
    body["metadata"].update(
        name=name,
        uid=f"uid-{name}",
        resourceVersion="1",
        generation=1,
        creationTimestamp=f"2026-01-01T00:00:{second:02d}Z",
    )
    return body


class World:
    """Four nodes with two engines each, and one engine no node takes (quiet until a node's
    room changes)."""

    def __init__(self, short_lease: str | None = None, full_resync: float = 60.0) -> None:
        self.now = NOW
        self.cache = Cache(clock=lambda: self.now)  # the loop's clock (`kube.process.run`)
        self.api = FakeApi(self.cache)
        fake: Any = self.api.aio
        real: AsyncKubeApi = fake
        settings = OperatorSettings(loop=LoopSettings(full_resync_seconds=full_resync))
        self.loop = Loop(real, settings, self.cache, clock=lambda: self.now)
        for node in NODES:
            self.cache.observe_node(
                {"metadata": {"name": node, "labels": {"node": node}},
                 "status": {"allocatable": {"nvidia.com/gpu": "1"}}},
                deleted=False,
            )  # fmt: skip
            self.cache.observe_board(node_board(node), deleted=False)
            duration = 20 if node == short_lease else 3600
            self.cache.observe_lease(agent_lease(node, NOW - 1, duration), deleted=False)
        self.on: dict[str, set[EngineKey]] = {n: set() for n in NODES}
        for i, node in enumerate(n for n in NODES for _ in range(PER_NODE)):
            body = engine_on(f"e{i}", node, i)
            self.cache.observe_engine(body, deleted=False)
            self.on[node].add(("ns", f"e{i}"))
        self.nowhere: EngineKey = ("ns", "nowhere")
        self.cache.observe_engine(engine_on("nowhere", "no-such-node", 59), deleted=False)
        self.decided: list[EngineKey] = []

    def pass_once(self) -> set[EngineKey]:
        self.decided.clear()
        asyncio.run(self.loop.pass_once())
        return set(self.decided)

    def settle(self) -> None:
        """Passes until every placed engine serves and a pass writes nothing."""
        for _ in range(4):
            self.pass_once()
        assert all(self.ready(k) for keys in self.on.values() for k in keys)
        self.api.calls.clear()

    def ready(self, key: EngineKey) -> bool:
        return any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in self.cache.engines[key]["status"].get("conditions", [])
        )

    def condition(self, key: EngineKey, kind: str) -> dict[str, Any]:
        conditions = self.cache.engines[key]["status"]["conditions"]
        found: dict[str, Any] = next(c for c in conditions if c["type"] == kind)
        return found
