"""The grants loop on the controller kernel (`kube.grants.loop`, `kube.base.kernel`): its decisions
one at a time, each assumed in the pass's quota use so that engines whose writes are in flight
together never overshoot a TokenQuota; a Mind's failed write taken again after a backoff; the full
pass as the kernel's resync; the Minds' writes as asyncio tasks (`kube.grants.write_queue`), one
Mind's in order, projections first; and the loop run by `kernel.run`, woken by the watches."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.grants.write_queue import FINALIZER_WRITE, PROJECTION_WRITE, MindWriter
from continuum_operator.model.json_body import object_at
from tests.support.builders import stored_ledger
from tests.support.grants_world import BASE, World, engine, mind, quota
from tests.support.waiting import until


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def test_quota_bound_engines_written_side_by_side_do_not_overshoot_the_quota(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)  # two writers
    for name in ("one", "two"):
        w.engine(engine("team-a", name, slots=2))
    w.quota(quota("team-a", "tokens", 3000))
    for i, name in enumerate(("one", "two")):
        for j in range(2):
            w.mind(mind("team-a", f"{name}-{j}", name, second=2 * i + j))
    # The two ledger writes wait for each other: they are in flight at once, so neither
    # decision could have waited for the other's write to land.
    together = asyncio.Barrier(2)
    real = w.api.aio.request

    async def request(method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        if method == "PUT":
            await asyncio.wait_for(together.wait(), 10)
        return await real(method, path, body, **kw)

    w.api.aio.request = request  # type: ignore[method-assign]
    w.loop.pass_once()
    held = [
        m
        for name in ("one", "two")
        for m, (s, _) in w.ledger("team-a", name).items()
        if s == "Granted"
    ]
    assert len(held) == 3  # 3 x 1000 tokens: the quota, over two engines; the fourth queued
    assert w.status("tokenquotas", "team-a", "tokens")["usedTokens"] == 3000


def test_a_release_assumed_in_a_pass_is_not_granted_on_until_its_write_lands(
    tmp_path: Path,
) -> None:
    """A step that gives tokens back counts them as held until its write lands: had the write
    failed, another engine would have granted tokens never given back."""
    w = World(tmp_path)
    w.engine(engine("team-a", "one", slots=1))
    w.engine(engine("team-a", "two", slots=1))
    w.quota(quota("team-a", "tokens", 1000))
    w.mind(mind("team-a", "ann", "one", second=1))
    w.loop.pass_once()
    use = w.loop.view
    assert use is not None
    quotas = use.quotas
    before = quotas.used("team-a")
    assert before == 1000
    quotas.assume(("team-a", "one"), [])  # a step releasing her, its write in flight
    assert quotas.used("team-a") == 1000
    quotas.stepped(("team-a", "one"), [])  # landed
    assert quotas.used("team-a") == 0 and quotas.freed == {"team-a"}


def test_a_minds_failed_projection_write_is_retried_after_the_backoff(tmp_path: Path) -> None:
    w = World(tmp_path)
    clock = Clock()
    w.loop.clock = clock
    w.engine(engine("team-a", "coder"))
    w.mind(mind("team-a", "ann", "coder"))
    real = w.api.merge_patch
    failures = [ApiError(500, "InternalError", "etcd is slow")]

    def flaky(path: str, patch: Any) -> dict[str, Any]:
        if "/minds/ann/status" in path and failures:
            raise failures.pop()
        return real(path, patch)

    w.api.merge_patch = flaky  # type: ignore[method-assign]
    w.loop.pass_once()
    assert w.ledger("team-a", "coder")["team-a/ann"][0] == "Granted"
    assert "grant" not in w.status("minds", "team-a", "ann")
    w.loop.pass_once()  # no event, the backoff not over
    assert "grant" not in w.status("minds", "team-a", "ann")
    clock.now += w.loop.kernel.retry_seconds
    w.loop.pass_once()
    assert w.status("minds", "team-a", "ann")["grant"]["state"] == "Granted"


def test_the_full_pass_is_the_kernels_resync(tmp_path: Path) -> None:
    w = World(tmp_path)
    assert w.loop.kernel == OperatorSettings(grants=w.loop.settings).kernels.grants
    assert w.loop.kernel.resync_seconds == OperatorSettings().loop.full_resync_seconds
    assert w.loop.queue is w.cache.queue and w.engines.grants_queue is w.loop.queue


def test_a_ledger_of_an_engine_this_operator_does_not_serve_wakes_no_pass(
    tmp_path: Path,
) -> None:
    # Another operator's ledgers (`--engine-selector`) are written ~100/s at scale: a pass
    # reads every engine, so each would cost one, for nothing this operator steps.
    w = World(tmp_path)
    w.engine(engine("team-a", "coder"))
    w.mind(mind("team-a", "ann", "coder"))
    w.loop.pass_once()
    queue = w.loop.queue
    theirs = {
        "metadata": {"namespace": "team-b", "name": "theirs", "resourceVersion": "7"},
        "status": {"grants": [{"mind": "team-b/bo", "state": "Granted", "slot": 0}]},
    }
    queue.changed.clear()
    w.engines.observe_ledger(theirs, deleted=False)
    assert not queue.changed.is_set()
    assert ("team-b", "theirs") in w.engines.ledgers  # kept, should its Engine come to this one
    mine = w.engines.ledgers[("team-a", "coder")]
    w.engines.observe_ledger(
        {**mine, "metadata": {**object_at(mine, "metadata"), "resourceVersion": "99999"}},
        deleted=False,
    )
    assert queue.changed.is_set()


def test_another_operators_ledger_wakes_a_pass_when_what_a_quota_counts_changed(
    tmp_path: Path,
) -> None:
    # A TokenQuota counts every Engine's holdings, the other operator's too: a release there
    # may let a Mind held back here be granted.
    w = World(tmp_path)
    w.engine(engine("team-a", "coder"))
    w.quota(quota("team-a", "tokens", 1000))
    w.loop.pass_once()
    queue = w.loop.queue

    def theirs(version: int, state: str, position: int | None = None) -> dict[str, Any]:
        entry = {"mind": "team-a/bo", "state": state, "slot": 0, "tokens": 1000}
        if position is not None:
            entry = {"mind": "team-a/bo", "state": state, "position": position}
        return {
            "metadata": {"namespace": "team-b", "name": "theirs", "resourceVersion": str(version)},
            "status": {"grants": [entry]},
        }

    for version, ledger, wakes in (
        (7, theirs(7, "Granted"), True),  # 1000 tokens held
        (8, theirs(8, "Granted"), False),  # the same held (a queue moved, say)
        (9, theirs(9, "Queued", position=1), True),  # released
    ):
        queue.changed.clear()
        w.engines.observe_ledger(ledger, deleted=False)
        assert queue.changed.is_set() is wakes, version


def test_a_replica_that_does_not_lead_writes_nothing(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.loop.may_write = lambda: False
    w.engine(engine("team-a", "coder"))
    w.mind(mind("team-a", "ann", "coder"))
    w.loop.pass_once()
    assert [c for c in w.api.calls if c.method != "GET"] == []
    w.loop.may_write = lambda: True  # leading now: the marks waited
    w.loop.pass_once()
    assert w.ledger("team-a", "coder")["team-a/ann"][0] == "Granted"


def test_the_mind_writer_keeps_one_minds_writes_in_order_and_projections_first() -> None:
    ran: list[str] = []

    async def scenario() -> None:
        first_may_end = asyncio.Event()
        writer = MindWriter(4, lambda: True)

        def write(name: str, wait: asyncio.Event | None = None) -> Any:
            async def run() -> None:
                ran.append(f"{name} start")
                if wait is not None:
                    await wait.wait()
                ran.append(f"{name} end")

            return run

        writer.submit(PROJECTION_WRITE, "ns/a", write("a1", first_may_end))
        await asyncio.sleep(0)
        # A later write of the same Mind waits for the one in flight; one not started yet is
        # replaced by a newer one of its kind.
        writer.submit(PROJECTION_WRITE, "ns/a", write("a2"))
        writer.submit(PROJECTION_WRITE, "ns/a", write("a3"))
        writer.submit(FINALIZER_WRITE, "ns/a", write("a-finalizer"))
        writer.submit(PROJECTION_WRITE, "ns/b", write("b1"))
        await asyncio.sleep(0.01)
        assert ran == ["a1 start", "b1 start", "b1 end"]
        first_may_end.set()
        await writer.drained()

    asyncio.run(scenario())
    assert ran[3:] == ["a1 end", "a3 start", "a3 end", "a-finalizer start", "a-finalizer end"]


def test_the_mind_writer_runs_projections_before_finalizers_when_full() -> None:
    ran: list[str] = []

    async def scenario() -> None:
        writer = MindWriter(1, lambda: True)

        def write(name: str) -> Any:
            async def run() -> None:
                ran.append(name)

            return run

        writer.submit(FINALIZER_WRITE, "ns/x", write("x finalizer"))  # starts at once
        writer.submit(FINALIZER_WRITE, "ns/y", write("y finalizer"))
        writer.submit(PROJECTION_WRITE, "ns/z", write("z projection"))
        await writer.drained()

    asyncio.run(scenario())
    assert ran == ["x finalizer", "z projection", "y finalizer"]


def test_the_loop_runs_on_the_kernel_seeded_first_and_woken_by_the_watches(
    tmp_path: Path,
) -> None:
    w = World(tmp_path)
    w.loop.clock = time.time
    w.engine(engine("team-a", "coder"))
    w.api.add(mind("team-a", "ann", "coder"), "minds")  # listed by the seed, not yet watched

    async def scenario() -> None:
        stop = asyncio.Event()
        run = asyncio.create_task(w.loop.run(stop))
        await until(lambda: w.ledger("team-a", "coder").get("team-a/ann") is not None, timeout=10.0)
        assert w.ledger("team-a", "coder")["team-a/ann"][0] == "Granted"
        body = mind("team-a", "bob", "coder", second=2)
        w.api.add(body, "minds")
        w.cache.observe_mind(body, deleted=False)  # her watch event wakes the loop
        await until(lambda: "grant" in w.status("minds", "team-a", "bob"), timeout=10.0)
        assert w.status("minds", "team-a", "bob")["grant"]["state"] == "Granted"
        stop.set()
        await run

    asyncio.run(scenario())
    assert f"{BASE}/team-a/engines/coder" in w.api.objects


def test_a_due_engines_release_is_logged_at_its_deadline_though_others_write_beside_it(
    tmp_path: Path,
) -> None:
    """The due engine's write is slow; the other engine's, decided after it, waits for it to
    land, so the release keeps its deadline as `t` (the log would put it no earlier than a
    later line written first)."""
    w = World(tmp_path)
    clock = Clock()
    w.loop.clock = clock
    w.engine(engine("team-a", "due", slots=1))
    w.engine(engine("team-a", "free", slots=2))
    w.mind(mind("team-a", "ann", "due"))
    w.loop.pass_once()
    gone = dict(w.api.objects[f"{BASE}/team-a/minds/ann"])
    gone["metadata"] = {**gone["metadata"], "deletionTimestamp": "2026-12-03T07:00:00Z",
                        "resourceVersion": "50"}  # fmt: skip
    w.api.add(gone, "minds")
    w.cache.observe_mind(gone, deleted=False)
    w.loop.pass_once()
    [entry] = stored_ledger(w.api.objects, "team-a", "due")["grants"]
    deadline = float(entry["deadline"])
    clock.now = deadline + 5
    w.mind(mind("team-a", "bob", "free", second=3))
    real = w.api.aio.request

    async def request(method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
        if method == "PUT" and "/grantledgers/due/" in path:
            await asyncio.sleep(0.3)
        return await real(method, path, body, **kw)

    w.api.aio.request = request  # type: ignore[method-assign]
    w.loop.pass_once()
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    released = [x for x in lines if x.get("mind") == "team-a/ann" and x.get("to") == "Released"]
    assert [x["t"] for x in released] == [deadline]
    arrived = [x for x in lines if x.get("mind") == "team-a/bob"]
    assert arrived and all(x["t"] == clock.now for x in arrived)
    assert [x["t"] for x in lines] == sorted(x["t"] for x in lines)
