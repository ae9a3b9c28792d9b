"""Leadership is asked at each write, not once a pass: a replica that loses its Lease in the
middle of a pass sends no write after (another replica may lead by then, and both would write).
One test per reconciler that writes only while leading (docs/design.md, "Who writes what"):
the kernel itself, the Engines', the lanes' and the grants' loops, and the placed pods. The
kernel asks before each key's writes: a key whose writes had begun sends the rest of them (its
status, then its event), the keys after it none; the process's adapter (`writing_while`, as
`kube.process.run` wires it) asks again at each call, so that key sends none after either."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from continuum_operator.kube.base import kernel
from continuum_operator.kube.base.kernel import KernelSettings, PassHooks, WorkQueue
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.engines.loop import Loop
from continuum_operator.kube.lanes.loop import LaneLoop
from continuum_operator.kube.nodes.placed_pods import CONSUMER_LABELS, PlacedPods
from continuum_operator.kube.state.cache import Cache
from tests.support.builders import engine_body, observe_with_ledger
from tests.support.fakes import FakeKubeApi
from tests.support.grants_world import World, engine, mind
from tests.support.lanes import lane
from tests.support.placed_pods import list_pods, pod

NOW = 1_000.0
ENGINES = "/apis/continuum.dev/v1alpha1/namespaces/ns/engines"
LEDGERS = "/apis/continuum.dev/v1alpha1/namespaces/ns/grantledgers"


class Lease:
    """Leads until the first write has gone out: the Lease is lost right after it."""

    def __init__(self) -> None:
        self.held = True

    def __call__(self) -> bool:
        return self.held


def loses_the_lease_at_its_first_write(api: FakeKubeApi, lease: Lease) -> list[str]:
    """The fake API server's first write (anything but a read) costs the replica its Lease;
    the paths of every write that went out, returned (filled as they go)."""
    real, written = api._record, list[str]()

    def record(method: str, path: str, *args: Any) -> Any:
        if method != "GET":
            written.append(path)
            lease.held = False
        return real(method, path, *args)

    api._record = record  # type: ignore[method-assign,assignment]
    return written


class Writer(PassHooks[str]):
    def __init__(self, lease: Lease) -> None:
        self.lease, self.written = lease, list[str]()

    def keys(self) -> list[str]:
        return ["a", "b", "c"]

    def decide(self, key: str, now: float) -> str:
        return key

    async def write(self, key: str, writes: str) -> None:
        self.written.append(key)
        self.lease.held = False


def test_the_kernel_sends_no_write_after_the_lease_is_lost_mid_pass() -> None:
    lease, queue = Lease(), WorkQueue[str]()
    writer = Writer(lease)
    settings = KernelSettings(writers=3)
    asyncio.run(kernel.drain(writer, queue, settings, may_write=lease, clock=lambda: NOW))
    assert writer.written == ["a"]
    # The keys not written wait, marked, for this replica to lead again.
    lease.held = True
    asyncio.run(kernel.drain(writer, queue, settings, may_write=lease, clock=lambda: NOW))
    assert writer.written == ["a", "b"]  # its write lost the Lease again
    assert queue.take(writer.keys(), NOW) == ["c"]


def engines_loop_losing_the_lease(*, gated: bool) -> tuple[Loop, list[str]]:
    """The Engines' loop over engines a and b, whose first write costs the Lease; its API
    adapter `gated` as `kube.process.run` wires it (asking the Lease at each call) or not.
    The paths written, filled as they go."""
    lease = Lease()
    api = FakeKubeApi()
    written = loses_the_lease_at_its_first_write(api, lease)
    cache = Cache(clock=lambda: NOW)
    for name in ("a", "b"):
        body = engine_body()
        body["metadata"]["name"] = name
        api.add(body, "engines")
        observe_with_ledger(cache, body)
    fake: Any = api.aio.writing_while(lease) if gated else api.aio
    return Loop(fake, OperatorSettings(), cache, clock=lambda: NOW, may_write=lease), written


def test_the_engines_loop_sends_no_write_after_the_lease_is_lost_mid_pass() -> None:
    loop, written = engines_loop_losing_the_lease(gated=False)
    asyncio.run(loop.pass_once())
    # Engine a's writes (its status, Unschedulable: no node; its event), none of engine b's.
    assert written == [f"{ENGINES}/a/status", "/api/v1/namespaces/ns/events"]


def test_with_the_processs_gated_adapter_a_key_sends_no_write_after_the_lease_is_lost() -> None:
    # As `kube.process.run` wires it: the adapter asks at each call, so engine a's event,
    # after its status lost the Lease, is not sent either; the key waits, marked, not failed.
    loop, written = engines_loop_losing_the_lease(gated=True)
    asyncio.run(loop.pass_once())
    assert written == [f"{ENGINES}/a/status"]
    assert loop.queue.next_retry() is None  # no backoff: not a failure
    assert ("ns", "a") in loop.queue.take([("ns", "a"), ("ns", "b")], NOW)


def test_the_lanes_loop_sends_no_write_after_the_lease_is_lost_mid_pass() -> None:
    lease = Lease()
    api = FakeKubeApi()
    written = loses_the_lease_at_its_first_write(api, lease)
    cache = Cache(clock=lambda: NOW)
    for name in ("a", "b"):
        body = lane(name, "missing")
        api.add(body, "embedlanes")
        cache.observe_lane(body, deleted=False, nudge=False)
    fake: Any = api.aio
    lanes = LaneLoop(fake, OperatorSettings(), cache, lambda: NOW, may_write=lease)
    asyncio.run(lanes.pass_once())
    # Lane a's writes (no pod: its Deployment deleted; its status, EngineNotFound; its event),
    # none of lane b's.
    assert written == [
        "/apis/apps/v1/namespaces/ns/deployments/embedlane-a",
        "/apis/continuum.dev/v1alpha1/namespaces/ns/embedlanes/a/status",
        "/api/v1/namespaces/ns/events",
    ]


def test_the_grants_loop_sends_no_write_after_the_lease_is_lost_mid_pass(tmp_path: Path) -> None:
    lease = Lease()
    w = World(tmp_path)
    w.loop.may_write = lease
    for name in ("a", "b"):
        w.engine(engine("ns", name))
        w.mind(mind("ns", f"ann-{name}", name))
    written = loses_the_lease_at_its_first_write(w.api, lease)
    w.loop.pass_once()
    # Engine a's ledger (made, then its status written), nothing of engine b's or any Mind's.
    assert written == [f"{LEDGERS}", f"{LEDGERS}/a/status"]


def test_the_placed_pods_send_no_write_after_the_lease_is_lost_mid_pass() -> None:
    lease = Lease()
    pods = [pod("ns", f"u{i}", f"gpu-{i}", {"continuum.dev/engine": "coder"}) for i in (1, 2)]
    api = FakeKubeApi(pods)
    cache = Cache()
    for node in ("gpu-1", "gpu-2"):
        body = {"metadata": {"name": node, "resourceVersion": "1"}, "spec": {}}
        api.add(body, "nodeboards")
        cache.observe_board(body, deleted=False)
    written = loses_the_lease_at_its_first_write(api, lease)
    publisher = PlacedPods(api.aio, cache, may_write=lease)  # type: ignore[arg-type]

    async def listed_then_published() -> int:
        for label, kind in CONSUMER_LABELS:
            await list_pods(publisher, label, kind)
        return await publisher.publish_once()

    assert asyncio.run(listed_then_published()) == 1
    assert written == ["/apis/continuum.dev/v1alpha1/nodeboards/gpu-1"]
