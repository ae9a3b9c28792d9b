"""An API server on this machine for the watches of `kube.client.async_api.follow`: one namespace's
custom objects, served as the real one serves them (GET, list with a `metadata.name` field
selector, watch from a resourceVersion, a merge patch of `status`, TokenReviews), every request
recorded, and the faults a watch must live through on demand: a stream ended (its timeout, a
dropped connection), a bookmark, a version compacted away (410 Gone)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.model.base import GROUP, VERSION
from tests.support.kube_login import kubeconfig

NS = "minds"
BASE = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}"


@dataclass
class Event:
    version: int
    plural: str
    type: str
    obj: dict[str, Any]


@dataclass
class FakeApiServer:
    version: int = 1
    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    #: A watch from a version older than this is answered 410 Gone (compacted away).
    oldest: int = 0
    #: (method, plural, query) of each request, a watch's method being WATCH.
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    #: The service account each token is, for the audiences it was issued with (TokenReviews).
    tokens: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    reviews: list[dict[str, Any]] = field(default_factory=list)
    _news: asyncio.Event = field(default_factory=asyncio.Event)
    _ended: int = 0  # streams opened before `end_streams` at this count end

    def put(self, plural: str, obj: dict[str, Any]) -> dict[str, Any]:
        """`obj` made (ADDED) or replaced (MODIFIED), at a new resourceVersion."""
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if (plural, name) in self.objects else "ADDED"
        self.version += 1
        stored = {**obj, "metadata": {**obj["metadata"], "namespace": NS,
                                      "resourceVersion": str(self.version)}}  # fmt: skip
        self.objects[plural, name] = stored
        self._tell(Event(self.version, plural, kind, stored))
        return stored

    def remove(self, plural: str, name: str) -> None:
        obj = self.objects.pop((plural, name))
        self.version += 1
        self._tell(Event(self.version, plural, "DELETED", obj))

    def bookmark(self, plural: str) -> int:
        """The collection's version moved on (another object changed, not selected): a
        BOOKMARK says how far."""
        self.version += 1
        mark = {"kind": "Bookmark", "metadata": {"resourceVersion": str(self.version)}}
        self._tell(Event(self.version, plural, "BOOKMARK", mark))
        return self.version

    def compact(self) -> None:
        """Every version before now forgotten: a watch from one is 410 Gone."""
        self.oldest = self.version

    def end_streams(self) -> None:
        """Every open watch ended, as at its timeout or a dropped connection."""
        self._ended += 1
        self._tell(None)

    def asked(self, method: str, plural: str) -> list[dict[str, str]]:
        return [q for m, p, q in self.requests if m == method and p == plural]

    def _tell(self, event: Event | None) -> None:
        if event is not None:
            self.events.append(event)
        self._news.set()
        self._news = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rest = request.path.removeprefix(BASE + "/").split("/")
        plural, name = rest[0], rest[1] if len(rest) > 1 else ""
        query = dict(request.query)
        watching = query.get("watch") == "1"
        self.requests.append(("WATCH" if watching else request.method, plural, query))
        if request.path == "/apis/authentication.k8s.io/v1/tokenreviews":
            return web.json_response(self._review(await request.json()))
        if watching:
            return await self._watch(request, plural, query)
        if request.method == "GET" and not name:
            selected = query.get("fieldSelector", "").removeprefix("metadata.name=")
            items = [o for (p, n), o in self.objects.items() if p == plural and n == selected]
            meta = {"resourceVersion": str(self.version)}
            return web.json_response({"kind": "List", "metadata": meta, "items": items})
        obj = self.objects.get((plural, name))
        if obj is None:
            return web.json_response({"kind": "Status", "reason": "NotFound"}, status=404)
        if request.method == "PATCH":
            patch = await request.json()
            obj = self.put(plural, {**obj, "status": {**obj.get("status", {}), **patch["status"]}})
        return web.json_response(obj)

    def _review(self, review: dict[str, Any]) -> dict[str, Any]:
        self.reviews.append(review)
        token, asked = reviewed_token(review)
        user, issued = self.tokens.get(token, ("", []))
        matched = [a for a in asked if a in issued]
        return review_answer(user if user and matched else None, matched)

    async def _watch(
        self, request: web.Request, plural: str, query: dict[str, str]
    ) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        since = int(query["resourceVersion"])
        if since < self.oldest:
            gone = {"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"}
            await response.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
            return response
        selected = query.get("fieldSelector", "").removeprefix("metadata.name=")
        ended = self._ended
        while ended == self._ended:
            news = self._news  # taken before the scan: what is told during a write is news
            for e in [e for e in self.events if e.version > since and e.plural == plural]:
                since = e.version
                if e.type == "BOOKMARK" or e.obj["metadata"]["name"] == selected:
                    line = json.dumps({"type": e.type, "object": e.obj}).encode() + b"\n"
                    await response.write(line)
            await news.wait()
        return response


@asynccontextmanager
async def served(tmp_path: Path) -> AsyncIterator[tuple[FakeApiServer, AsyncKubeApi]]:
    """The fake API server listening, and an adapter logged in to it."""
    fake = FakeApiServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fake.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    api = await AsyncKubeApi.connect(kubeconfig(tmp_path / "kubeconfig", port))
    try:
        yield fake, api
    finally:
        fake.end_streams()
        await api.close()
        await runner.cleanup()


def review_answer(username: str | None, audiences: list[str] | None = None) -> dict[str, Any]:
    """A TokenReview as the API server answers it: authenticated as `username` for
    `audiences`, or (None) not authenticated."""
    if username is None:
        return {"kind": "TokenReview", "status": {"authenticated": False}}
    status = {"authenticated": True, "user": {"username": username}, "audiences": audiences}
    return {"kind": "TokenReview", "status": status}


def reviewed_token(review: dict[str, Any]) -> tuple[str, list[str]]:
    """The token and the audiences a TokenReview sent asks about."""
    spec = review["spec"]
    return str(spec["token"]), list(spec.get("audiences") or [])
