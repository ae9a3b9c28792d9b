"""Each NodeBoard's `spec.placed` lists the engine and lane pods the operator placed on that node
(`kube.nodes.placed_pods`), so the node agent charges usage by pod UID without listing pods
itself."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import LIST_PAGE
from continuum_operator.kube.nodes.placed_pods import (
    CONSUMER_LABELS,
    PlacedPods,
    PodSeen,
    placed_by_node,
)
from continuum_operator.kube.state.cache import Cache
from continuum_operator.model.board import NodeBoardSpec
from tests.support.fakes import Awaited, FakeKubeApi
from tests.support.placed_pods import list_pods, pod
from tests.support.waiting import until

ENGINE = "continuum.dev/engine"
LANE = "continuum.dev/embedlane"


def test_each_node_gets_its_engine_and_lane_pods_by_uid_and_nothing_else() -> None:
    pods = [
        (ENGINE, "Engine", pod("team-a", "u2", "gpu-1", {ENGINE: "coder"})),
        (ENGINE, "Engine", pod("team-a", "u1", "gpu-1", {ENGINE: "coder"})),
        (LANE, "EmbedLane", pod("team-b", "u3", "gpu-2", {LANE: "search"})),
        (ENGINE, "Engine", pod("team-a", "u4", None, {ENGINE: "coder"})),  # not bound yet
        (ENGINE, "Engine", pod("team-a", "u5", "gpu-1", {ENGINE: "old"}, "Succeeded")),
        (ENGINE, "Engine", pod("team-a", "u6", "gpu-1", {})),  # the label's value names it
    ]
    by_node = placed_by_node((label, kind, PodSeen.of(p)) for label, kind, p in pods)
    assert by_node == {
        "gpu-1": [
            {"uid": "u1", "kind": "Engine", "namespace": "team-a", "name": "coder"},
            {"uid": "u2", "kind": "Engine", "namespace": "team-a", "name": "coder"},
        ],
        "gpu-2": [{"uid": "u3", "kind": "EmbedLane", "namespace": "team-b", "name": "search"}],
    }
    for placed in by_node.values():  # what the CRD admits
        NodeBoardSpec.model_validate({"placed": placed})


def round_of(publisher: PlacedPods) -> int:
    """A round as a new leader's first: each kind of pod listed, then the boards written."""

    async def listed_then_published() -> int:
        for label, kind in CONSUMER_LABELS:
            await list_pods(publisher, label, kind)
        return await publisher.publish_once()

    return asyncio.run(listed_then_published())


def board(name: str, placed: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": "1"},
            "spec": {"placed": placed} if placed is not None else {}}  # fmt: skip


def test_only_boards_whose_list_changed_are_written_and_a_missing_board_is_skipped() -> None:
    pods = [pod("team-a", "u1", "gpu-1", {ENGINE: "coder"}),
            pod("team-b", "u3", "gpu-2", {LANE: "search"})]  # fmt: skip
    # Pods listed by label; NodeBoards merge-patched (404 for a board that does not exist).
    api = FakeKubeApi(pods)
    for name in ("gpu-1", "gpu-3"):
        api.add(board(name), "nodeboards")
    cache = Cache()
    for name in ("gpu-1", "gpu-2", "gpu-3"):
        cache.observe_board(board(name), deleted=False)
    publisher = PlacedPods(api.aio, cache)  # type: ignore[arg-type]

    # gpu-1 gets its pod; gpu-2's board was deleted meanwhile (404, skipped); gpu-3 has none
    # and already says none.
    assert round_of(publisher) == 1
    assert api.patched == [(
        "/apis/continuum.dev/v1alpha1/nodeboards/gpu-1",
        {"spec": {"placed": [{"uid": "u1", "kind": "Engine", "namespace": "team-a",
                              "name": "coder"}]}},
    )]  # fmt: skip
    assert round_of(publisher) == 0  # nothing changed: nothing written

    pods[0]["status"]["phase"] = "Failed"  # its pod ended: the board says so
    assert round_of(publisher) == 1
    assert api.patched[-1][1] == {"spec": {"placed": []}}

    # The watch echo of the operator's own write compares equal.
    cache.observe_board(board("gpu-1", []), deleted=False)
    assert round_of(publisher) == 0


def test_pods_are_listed_a_page_at_a_time_and_kept_only_as_far_as_placement_reads() -> None:
    # More engine pods than a page: every one is kept, no answer carries more than a page,
    # and what is kept of a pod is its uid, namespace, labels, node and phase.
    n = LIST_PAGE + 7
    pods = [pod("team-a", f"u{i:03d}", f"gpu-{i % 3}", {ENGINE: f"e{i}"}) for i in range(n)]
    for p in pods:
        p["spec"]["containers"] = [{"name": "engine", "image": "continuum-engine", "args": ["-"]}]
    api = FakeKubeApi(pods)
    publisher = PlacedPods(api.aio, Cache())  # type: ignore[arg-type]

    asyncio.run(list_pods(publisher, ENGINE, "Engine"))

    asked = [dict(c.query) for c in api.calls if c.method == "GET"]
    assert [q.get("continue", "") for q in asked] == ["", str(LIST_PAGE)]
    assert all(q["limit"] == str(LIST_PAGE) and q["labelSelector"] == ENGINE for q in asked)
    kept = [p for _, _, p in publisher.pods.values()]
    assert sorted(p.uid for p in kept) == [f"u{i:03d}" for i in range(n)]
    assert sum(len(v) for v in placed_by_node(publisher.pods.values()).values()) == n


def test_watch_events_keep_the_pods_current_and_nothing_is_written_before_both_lists() -> None:
    api = FakeKubeApi([pod("team-a", "u1", "gpu-1", {ENGINE: "coder"})])
    api.add(board("gpu-1"), "nodeboards")
    api.add(board("gpu-2"), "nodeboards")
    cache = Cache()
    for name in ("gpu-1", "gpu-2"):
        cache.observe_board(board(name), deleted=False)
    publisher = PlacedPods(api.aio, cache)  # type: ignore[arg-type]

    async def scenario() -> None:
        await list_pods(publisher, ENGINE, "Engine")
        # The lanes' pods not listed yet: an empty list of them is not news.
        assert await publisher.publish_once() == 0
        await list_pods(publisher, LANE, "EmbedLane")
        assert await publisher.publish_once() == 1  # gpu-1 gets u1
        moved = pod("team-a", "u2", "gpu-2", {ENGINE: "coder"})
        publisher.observe(ENGINE, "Engine", {"type": "ADDED", "object": moved})
        publisher.observe(ENGINE, "Engine", {"type": "DELETED", "object": pod(
            "team-a", "u1", "gpu-1", {ENGINE: "coder"})})  # fmt: skip
        publisher.observe(ENGINE, "Engine", {"type": "BOOKMARK", "object": {
            "metadata": {"resourceVersion": "9"}}})  # fmt: skip
        assert await publisher.publish_once() == 2

    asyncio.run(scenario())
    assert api.patched[-2:] == [
        ("/apis/continuum.dev/v1alpha1/nodeboards/gpu-1", {"spec": {"placed": []}}),
        ("/apis/continuum.dev/v1alpha1/nodeboards/gpu-2", {"spec": {"placed": [
            {"uid": "u2", "kind": "Engine", "namespace": "team-a", "name": "coder"}]}}),
    ]  # fmt: skip


def test_a_pod_or_a_board_that_changed_marks_its_node_alone_and_a_new_board_is_filled() -> None:
    # On the kernel: a pass decides only the nodes marked, and a board made after the pods were
    # listed (its agent started late) is written when its watch event marks it.
    api = FakeKubeApi([pod("team-a", "u1", "gpu-1", {ENGINE: "coder"}),
                       pod("team-a", "u3", "gpu-3", {ENGINE: "coder"})])  # fmt: skip
    api.add(board("gpu-1"), "nodeboards")
    cache = Cache()
    cache.observe_board(board("gpu-1"), deleted=False)
    publisher = PlacedPods(api.aio, cache)  # type: ignore[arg-type]
    assert round_of(publisher) == 1  # gpu-1; gpu-3 has no board yet
    publisher.observe(ENGINE, "Engine", {"type": "ADDED", "object": pod(
        "team-b", "u2", "gpu-2", {ENGINE: "other"})})  # fmt: skip
    assert cache.placed_queue.take(publisher.keys(), 0.0) == ["gpu-2"]
    api.add(board("gpu-3"), "nodeboards")
    cache.observe_board(board("gpu-3"), deleted=False)
    assert asyncio.run(publisher.publish_once()) == 1
    assert api.patched[-1] == (
        "/apis/continuum.dev/v1alpha1/nodeboards/gpu-3",
        {"spec": {"placed": [{"uid": "u3", "kind": "Engine", "namespace": "team-a",
                              "name": "coder"}]}},
    )  # fmt: skip


class Watching(Awaited):
    """The fake API server's pods listed, and each watch of the engines' pods as `streams`
    says, in order: each step an event sent, a change to the store (a callable), or an error
    raised; with no stream left, a watch stays open and silent. The lanes' watch is silent."""

    def __init__(self, api: FakeKubeApi, streams: list[list[Any]]) -> None:
        super().__init__(api)
        self.streams = streams
        self.watched: list[tuple[str, float]] = []  # each engine watch's `since`, and when

    async def watch(
        self, path: str, query: Any, since: str, seconds: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        if dict(query)["labelSelector"] == ENGINE:
            self.watched.append((since, asyncio.get_running_loop().time()))
            for step in self.streams.pop(0) if self.streams else []:
                if isinstance(step, Exception):
                    raise step
                if callable(step):
                    step()
                else:
                    yield step
        await asyncio.Event().wait()


def test_after_a_410_the_pods_are_listed_again_at_once_and_those_gone_meanwhile_dropped() -> None:
    # The watch resumes as every follower's does (`kube.client.async_api.follow`): a version
    # compacted away lists again at once, not after a second's pause, and the list drops the
    # pod deleted while no watch told of it.
    gone = pod("team-a", "u1", "gpu-1", {ENGINE: "coder"})
    api = FakeKubeApi([gone])
    came = pod("team-a", "u2", "gpu-2", {ENGINE: "coder"})
    compacted = ApiError(410, "Expired", "too old resource version")
    bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "7"}}}
    watching = Watching(api, [[
        lambda: api.add(came), {"type": "ADDED", "object": came}, bookmark,
        lambda: api.objects.pop("/api/v1/namespaces/team-a/pods/p-u1"), compacted,
    ]])  # fmt: skip
    publisher = PlacedPods(watching, Cache())  # type: ignore[arg-type]

    async def scenario() -> float:
        stop = asyncio.Event()
        running = asyncio.create_task(publisher.run(stop))
        await until(lambda: len(watching.watched) == 2)
        stop.set()
        await running
        return watching.watched[1][1] - watching.watched[0][1]

    took = asyncio.run(scenario())
    assert sorted(publisher.pods) == ["u2"]
    lists = [c for c in api.calls if c.method == "GET" and dict(c.query)["labelSelector"] == ENGINE]
    assert len(lists) == 2  # the first list, and the one after the 410
    assert took < 0.5
