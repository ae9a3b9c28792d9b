"""The operator's two loops in-process, against an API server kept in memory: the CPU of their
passes as they run now (only what changed decided) and as every pass ran before (every engine).

`bench/scale.py --decide-only` runs `run` and prints its figures;
tests/unit/core/test_scale_paths.py runs it at a tiny size and checks that a pass at rest decides
fewer engines than a full pass.

1. The plan loop (`kube.engines.loop.Loop.pass_once`, on a real `kube.state.cache.Cache`):
   placing every engine; a pass at rest (nothing changed); a pass after one NodeBoard changed;
   a pass after one Engine's spec changed; a full pass (every engine decided, as every pass was
   before the dirty set; the loop runs one every `full_resync_seconds`).
2. The grants loop (`kube.grants.loop.GrantsLoop.pass_once`, on `kube.base.kernel` too) over
   the engines the plan loop placed:
   the first pass, granting every Mind; a pass after one Mind created; a pass with nothing
   changed; a full pass (every engine's ledger stepped, as every pass was before).

CPU is `time.process_time` around the pass alone: every thread of this process (the loops' API
calls are awaited on the event loop, `kube.client.async_api`'s surface over the in-memory server
(`tests.support.fakes.Awaited`), whose work is included).
The watch events that the writes cause (their echoes) are handed to the caches between passes,
as kopf would, untimed. A grants pass here waits for the Mind writes (projections, finalizers)
it queued (`GrantsLoop.drain`), so they are in the pass's figure.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.kube_bench import GROUP, VERSION, micro, mind_body
from bench.scale import KINDS, _engine, _nodes
from tests.support.fakes import Awaited

from continuum_operator.core.heartbeat import LEASE_NAMESPACE, NODE_ANNOTATION, lease_name
from continuum_operator.kube.base.grant_settings import GrantSettings
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.api import ApiError, crd_path, path_of
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.client.merge_patch import merge_patch
from continuum_operator.kube.engines.loop import Loop
from continuum_operator.kube.grants.loop import GrantsLoop
from continuum_operator.kube.process.run import join_caches
from continuum_operator.kube.state.cache import Cache, EngineKey
from continuum_operator.kube.state.mind_cache import MindCache

NS = "ns"
CLASSES = (("low", 0), ("mid", 5), ("high", 10))


@dataclass(frozen=True)
class Figure:
    """One pass: its CPU, how many engines it decided (or stepped) and how many it wrote."""

    what: str
    cpu_s: float
    decided: int
    written: int


@dataclass
class Figures:
    plan: dict[str, Figure] = field(default_factory=dict)
    grants: dict[str, Figure] = field(default_factory=dict)
    engines_placed: int = 0
    minds_granted: int = 0


class MemoryApi:
    """The API server as the loops use it (`KubeApi`'s calls), objects kept by path: merge
    patches (RFC 7386; a status patch changes only the status; a `metadata.resourceVersion` in
    the patch is a precondition), server-side applies, creates, deletes and PUTs conditioned on
    the resourceVersion (409 when it is not the stored one). Every Deployment applied is ready
    at once. Each write's answer is queued in `echoes`: the watch events the caches get next."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.echoes: list[dict[str, Any]] = []
        self.rv = itertools.count(1000)
        self.writes = 0
        self.events = 0

    def add(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body["metadata"]["resourceVersion"] = str(next(self.rv))
        self.objects[path] = body
        return copy.deepcopy(body)

    def _stored(self, path: str) -> tuple[str, dict[str, Any], bool]:
        status = path.endswith("/status")
        base = path.removesuffix("/status")
        obj = self.objects.get(base)
        if obj is None:
            raise ApiError(404, "NotFound", f"{base} not found")
        return base, obj, status

    def replace(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Store a new version of the object (another writer's update)."""
        body["metadata"]["resourceVersion"] = str(next(self.rv))
        self.objects[path] = body
        self.writes += 1
        self.echoes.append(body)
        return copy.deepcopy(body)

    def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        base, obj, status = self._stored(path)
        want = (patch.get("metadata") or {}).get("resourceVersion")
        if want is not None and want != obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f"{base} was changed")
        if status:
            new = {**obj, "status": merge_patch(obj.get("status") or {}, patch.get("status"))}
        else:
            meta = {k: v for k, v in (patch.get("metadata") or {}).items()}
            meta.pop("resourceVersion", None)
            new = merge_patch(obj, {**patch, "metadata": meta})
        return self.replace(base, copy.deepcopy(new))

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        path = path_of(obj)
        body = copy.deepcopy(obj)
        body["metadata"]["generation"] = 1
        if obj["kind"] == "Deployment":
            body["status"] = {"observedGeneration": 1, "readyReplicas": 1, "updatedReplicas": 1,
                              "replicas": 1}  # fmt: skip
        return self.replace(path, body)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        if obj["kind"] == "Event":
            self.events += 1
            return obj
        path = path_of(obj)
        if path in self.objects:
            raise ApiError(409, "AlreadyExists", f"{path} exists")
        return self.replace(path, copy.deepcopy(obj))

    def delete(self, path: str) -> None:
        self.objects.pop(path, None)

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        if method == "GET":
            return copy.deepcopy(self._stored(path)[1])
        if method == "PUT":
            base, obj, status = self._stored(path)
            if body["metadata"].get("resourceVersion") != obj["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f"{base} was changed")
            new = {**obj, "status": copy.deepcopy(body["status"])} if status else body
            return self.replace(base, copy.deepcopy(new))
        if method == "POST":
            return self.create(body)
        raise ApiError(405, "MethodNotAllowed", f"{method} {path}")

    def text(self, path: str) -> str:
        raise ApiError(404, "NotFound", path)

    def deliver(self, cache: Cache, minds: MindCache | None = None) -> None:
        """The watch events of the writes since the last call, into the caches."""
        echoes, self.echoes = self.echoes, []
        for obj in echoes:
            kind = obj.get("kind")
            if kind == "Engine":
                cache.observe_engine(obj, deleted=False)
            elif kind == "GrantLedger":
                cache.observe_ledger(obj, deleted=False)
            elif kind == "Deployment":
                cache.observe_deployment(obj, deleted=False)
            elif kind == "NodeBoard":
                cache.observe_board(obj, deleted=False)
            elif kind == "Service":
                cache.observe_service(obj, deleted=False)
            elif kind == "Mind" and minds is not None:
                minds.observe_mind(obj, deleted=False)


class CountingLoop(Loop):
    """The plan loop, counting the engines each pass decides."""

    last_decided = 0

    def _order(self, only: set[EngineKey] | None = None) -> list[EngineKey]:
        keys = super()._order(only)
        self.last_decided = len(keys)
        return keys


class CountingGrants(GrantsLoop):
    """The grants loop, counting the engines each pass steps."""

    stepped = 0

    def decide(self, key: EngineKey, now: float) -> Any:
        self.stepped += 1
        return super().decide(key, now)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _timed(what: str, run: Callable[[], int], writes: Callable[[], int]) -> Figure:
    before = writes()
    t = time.process_time()
    decided = run()
    return Figure(what, time.process_time() - t, decided, writes() - before)


def run(
    nodes: int,
    engines: int,
    minds: int,
    slots: int = 8,
    out: Callable[[str], None] = print,
) -> Figures:
    figures = Figures()
    api = MemoryApi()
    cache, loop, clock = _plan_world(api, nodes, engines, slots)

    def plan_pass() -> int:
        asyncio.run(loop.pass_once())
        return loop.last_decided

    def settle() -> int:
        """Passes (untimed) until one writes nothing: every engine's own writes echoed back,
        its Deployment ready, its Ready condition written."""
        for n in range(1, 11):
            clock.now += 1
            api.deliver(cache)
            before = api.writes
            plan_pass()
            if api.writes == before and not api.echoes:
                return n
        return n

    def plan(what: str) -> None:
        clock.now += 1
        api.deliver(cache)
        figures.plan[what] = f = _timed(what, plan_pass, lambda: api.writes)
        out(f"  {what}: {f.cpu_s * 1000:.0f} ms CPU, {f.decided} engines decided, "
            f"{f.written} writes")  # fmt: skip

    out(f"plan loop (kube.engines.loop.Loop.pass_once), {nodes} nodes, {engines} engines:")
    plan("placing every engine")
    passes = settle()
    placed = [b for b in cache.engines.values() if (b.get("status") or {}).get("placement")]
    figures.engines_placed = len(placed)
    out(f"    ({len(placed)} of {engines} placed; {passes} passes more until one wrote nothing)")
    plan("a pass at rest (nothing changed)")
    board = next(iter(sorted(cache.boards)))
    _change_board(api, board)
    api.deliver(cache)
    plan(f"a pass after one NodeBoard changed ({len(cache.engines_on.get(board, ()))} "
         f"engines on its node)")  # fmt: skip
    settle()
    key = sorted(cache.engines)[len(cache.engines) // 2]
    _change_spec(api, key)
    plan("a pass after one Engine's spec changed")
    settle()
    loop.queue.resynced_at = None  # the next pass decides every engine
    plan("the full pass (every engine decided, as every pass was before)")

    # The grants loop, over the engines as the plan loop left them.
    out(f"grants loop (kube.grants.loop.GrantsLoop.pass_once), {engines} engines, {minds} minds:")
    with tempfile.TemporaryDirectory(prefix="bench-decide-") as tmp:
        glog = Path(tmp) / "transitions.jsonl"
        grants, mcache = _grants_world(api, cache, glog, minds, engines, clock)

        def grants_pass() -> int:
            grants.stepped = 0
            grants.pass_once()
            return grants.stepped

        def grant(what: str) -> None:
            clock.now += 1
            api.deliver(cache, mcache)
            figures.grants[what] = f = _timed(what, grants_pass, lambda: api.writes)
            out(f"  {what}: {f.cpu_s * 1000:.0f} ms CPU, {f.decided} engines stepped, "
                f"{f.written} writes")  # fmt: skip

        grant("the first pass, granting every mind")
        figures.minds_granted = granted(api.objects)
        out(f"    ({figures.minds_granted} of {minds} minds granted)")
        clock.now += 1
        api.deliver(cache, mcache)
        grants_pass()  # the echoes of the first pass's writes (untimed)
        api.deliver(cache, mcache)
        _add_mind(api, mcache, minds, engines)  # (as its watch event)
        grant("a pass after one Mind created")
        grant("a pass with nothing changed")
        grants.queue.resynced_at = None  # the next pass steps every engine
        grant("the full pass (every engine stepped, as every pass was before)")
    return figures


def _plan_world(
    api: MemoryApi, nodes: int, engines: int, slots: int
) -> tuple[Cache, CountingLoop, Clock]:
    clock = Clock(time.time())
    cache = Cache(clock=clock)  # the loop's clock, as `kube.process.run` gives both
    sync: Any = api
    fake: Any = Awaited(sync)
    real: AsyncKubeApi = fake
    loop = CountingLoop(real, OperatorSettings(), cache, clock=clock)
    for name, kind in _nodes("d", nodes):
        labels = {"bench": "d", "bench-kind": kind}
        cap = {"cpu": "1000", **KINDS[kind][1]}
        cache.observe_node({"metadata": {"name": name, "labels": labels},
                            "status": {"allocatable": cap}}, deleted=False)  # fmt: skip
        board = api.add(f"/apis/{GROUP}/{VERSION}/nodeboards/{name}",
                        {"apiVersion": f"{GROUP}/{VERSION}", "kind": "NodeBoard",
                         "metadata": {"name": name}, "status": KINDS[kind][0]})  # fmt: skip
        cache.observe_board(board, deleted=False)
        cache.observe_lease({"metadata": {"namespace": LEASE_NAMESPACE, "name": lease_name(name),
                                          "resourceVersion": "1",
                                          "annotations": {NODE_ANNOTATION: name}},
                             "spec": {"renewTime": micro(), "leaseDurationSeconds": 3600}},
                            deleted=False)  # fmt: skip
    for i in range(engines):
        body = _engine("d", NS, i, slots)
        body["metadata"].update(
            uid=f"u{i}", generation=1, creationTimestamp=f"2026-01-01T00:00:{i % 60:02d}Z"
        )
        name = body["metadata"]["name"]
        cache.observe_engine(api.add(crd_path("engines", NS, name), body), deleted=False)
    return cache, loop, clock


def _change_board(api: MemoryApi, node: str) -> None:
    """The node's agent measured one more GiB used on its first pool."""
    path = f"/apis/{GROUP}/{VERSION}/nodeboards/{node}/status"
    status = api.objects[path.removesuffix("/status")]["status"]
    pools = copy.deepcopy(status["pools"])
    pools[0]["usedBytes"] += 2**30
    api.merge_patch(path, {"status": {"pools": pools}})


def _change_spec(api: MemoryApi, key: EngineKey) -> None:
    """A user halved the engine's context per mind (a new generation)."""
    path = crd_path("engines", *key)
    body = copy.deepcopy(api.objects[path])
    body["spec"]["contextTokensPerMind"] //= 2
    body["metadata"]["generation"] = int(body["metadata"].get("generation") or 1) + 1
    api.replace(path, body)


def _grants_world(
    api: MemoryApi, cache: Cache, glog: Path, minds: int, engines: int, clock: Clock
) -> tuple[CountingGrants, MindCache]:
    mcache = MindCache()
    join_caches(cache, mcache)
    for cls, priority in CLASSES:
        mcache.observe_class({"metadata": {"name": f"d-{cls}"},
                              "spec": {"priority": priority, "protectionWindowSeconds": 300}},
                             deleted=False)  # fmt: skip
    sync: Any = api
    fake: Any = Awaited(sync)
    real: AsyncKubeApi = fake
    grants = CountingGrants(real, GrantSettings(transition_log=glog), cache, mcache, clock=clock)
    for i in range(minds):
        _add_mind(api, mcache, i, engines)
    return grants, mcache


def _add_mind(api: MemoryApi, mcache: MindCache, i: int, engines: int) -> None:
    body: dict[str, Any] = mind_body(f"m{i:05d}", f"e{i % engines:04d}",
                                     f"d-{CLASSES[i % len(CLASSES)][0]}")  # fmt: skip
    body["metadata"].update(namespace=NS, uid=f"mu{i}", generation=1,
                            creationTimestamp=f"2026-01-01T00:01:{i % 60:02d}Z")  # fmt: skip
    mcache.observe_mind(api.add(crd_path("minds", NS, body["metadata"]["name"]), body),
                        deleted=False)  # fmt: skip


def granted(objects: Mapping[str, dict[str, Any]]) -> int:
    return sum(
        1
        for path, m in objects.items()
        if "/minds/" in path
        and ((m.get("status") or {}).get("grant") or {}).get("state") == "Granted"
    )
