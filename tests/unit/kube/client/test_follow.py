"""`kube.client.async_api.follow`, the watch the engine's and the lane's processes keep of their one
object, against an API server on this machine (`tests.support.fake_apiserver`): listed once, then
watched; a stream that ends is watched again from the last version seen, a bookmark's
included, never listed again; a version compacted away (410 Gone) is listed again at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from continuum_operator.kube.client import async_api
from continuum_operator.kube.client.async_api import AsyncKubeApi
from tests.support.fake_apiserver import BASE, FakeApiServer, served
from tests.support.waiting import until

PLURAL = "grantledgers"


def thing(name: str, note: str) -> dict[str, Any]:
    return {"kind": "GrantLedger", "metadata": {"name": name}, "status": {"note": note}}


class Followed:
    """What `follow` handed over: each list's items and each event, as (type, note)."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self.events: list[tuple[str, str]] = []

    async def listed(self, items: AsyncIterator[dict[str, Any]]) -> None:
        self.lists.append([i["status"]["note"] async for i in items])

    def changed(self, event: dict[str, Any]) -> None:
        self.events.append((event["type"], event["object"]["status"]["note"]))


def run(
    tmp_path: Path, body: Callable[[FakeApiServer, AsyncKubeApi, Followed], Awaitable[None]]
) -> Followed:
    followed = Followed()

    async def main() -> None:
        async with served(tmp_path) as (fake, api):
            fake.put(PLURAL, thing("mine", "one"))
            fake.put(PLURAL, thing("other", "not mine"))
            task = asyncio.create_task(
                async_api.follow(
                    api,
                    f"{BASE}/{PLURAL}",
                    [("fieldSelector", "metadata.name=mine")],
                    followed.listed,
                    followed.changed,
                    what="mine",
                    retry_seconds=0.01,
                )
            )
            try:
                await until(lambda: len(fake.asked("WATCH", PLURAL)) == 1)
                await body(fake, api, followed)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    return followed


def test_a_stream_that_ends_is_watched_again_from_the_last_version_not_listed(
    tmp_path: Path,
) -> None:
    async def body(fake: FakeApiServer, api: AsyncKubeApi, followed: Followed) -> None:
        assert followed.lists == [["one"]]
        first = fake.asked("WATCH", PLURAL)[0]
        assert first["resourceVersion"] == "3" and first["allowWatchBookmarks"] == "true"
        changed = fake.put(PLURAL, thing("mine", "two"))
        await until(lambda: followed.events == [("MODIFIED", "two")])
        fake.end_streams()  # the server's timeout, or a dropped connection
        await until(lambda: len(fake.asked("WATCH", PLURAL)) == 2)
        again = fake.asked("WATCH", PLURAL)[1]
        assert again["resourceVersion"] == changed["metadata"]["resourceVersion"]
        fake.remove(PLURAL, "mine")
        await until(lambda: followed.events[-1:] == [("DELETED", "two")])

    followed = run(tmp_path, body)
    assert followed.lists == [["one"]]  # listed once: every change came by the watch


def test_a_bookmark_moves_the_version_watched_from_and_is_not_an_event(tmp_path: Path) -> None:
    async def body(fake: FakeApiServer, api: AsyncKubeApi, followed: Followed) -> None:
        marked = fake.bookmark(PLURAL)
        await asyncio.sleep(0.05)
        fake.end_streams()
        await until(lambda: len(fake.asked("WATCH", PLURAL)) == 2)
        assert fake.asked("WATCH", PLURAL)[1]["resourceVersion"] == str(marked)
        # The bookmark's version is still the server's after a compaction that made the last
        # event's too old: watched from it, no list is needed.
        fake.compact()
        fake.put(PLURAL, thing("mine", "two"))
        await until(lambda: followed.events == [("MODIFIED", "two")])

    followed = run(tmp_path, body)
    assert followed.lists == [["one"]]


def test_a_version_compacted_away_is_listed_again_then_watched_from_the_new_list(
    tmp_path: Path,
) -> None:
    async def body(fake: FakeApiServer, api: AsyncKubeApi, followed: Followed) -> None:
        fake.end_streams()
        await until(lambda: len(fake.asked("WATCH", PLURAL)) == 2)
        fake.end_streams()  # down while the object changed, and the history was compacted
        fake.put(PLURAL, thing("mine", "changed while down"))
        fake.compact()
        await until(lambda: len(followed.lists) == 2)
        assert followed.lists[1] == ["changed while down"]  # the 410 relisted it
        await until(lambda: fake.asked("WATCH", PLURAL)[-1]["resourceVersion"] == str(fake.version))
        fake.put(PLURAL, thing("mine", "after"))
        await until(lambda: followed.events[-1:] == [("MODIFIED", "after")])

    followed = run(tmp_path, body)
    assert len(followed.lists) == 2  # one relist, no more


def test_a_server_that_answers_410_to_each_new_list_is_not_listed_in_a_loop(
    tmp_path: Path,
) -> None:
    """A 410 right after a list (a server whose history is gone at once) waits before the next
    list: one list a `retry_seconds`, not as many as the loop can send."""

    async def body(fake: FakeApiServer, api: AsyncKubeApi, followed: Followed) -> None:
        fake.oldest = 10**9  # every version too old
        fake.end_streams()
        await asyncio.sleep(0.3)

    followed = run(tmp_path, body)
    assert 2 <= len(followed.lists) <= 1 + 0.3 / 0.01 + 1  # retry_seconds apart at most
