"""The adapter the operator's loops talk to the API server through, on the event loop: the verbs
of `kube.client.api.KubeApi` (request, apply, merge_patch, delete, text, create), awaited. The
engine's and the lane's processes talk through it too, one each, and keep their one object with
`follow` (a list, then a watch resumed from the last version seen).

The transport is an aiohttp session (kopf's HTTP stack, so no second one) with the login the
blocking adapter has too (`kube.client.login.login`): the server, its TLS and server name, the
proxy, and the token, read at each request (the pod's ServiceAccount token is read again as the
kubelet rotates it). The request each verb sends and what an answer means are `kube.client.api`'s,
shared with the blocking adapter. Neither imports the `kubernetes` package.

Not `kubernetes_asyncio`: kopf imports its generated client whenever it is installed, and that
was 32 MiB of the operator's memory for a transport that sends plain dicts (docs/architecture.md).

A transport failure (refused, reset, timed out) is raised as an `OSError`, as the blocking
adapter's socket errors are, so the callers' `except (ApiError, OSError)` holds for both.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Mapping,
    Sequence,
)
from typing import TypeVar

import aiohttp

from continuum_operator.kube.client.api import (
    TIMEOUT_SECONDS,
    ApiError,
    Request,
    RequestMeter,
    answer,
    apply_request,
    call,
    continue_token,
    create_request,
    delete_request,
    document,
    merge_patch_request,
    page_query,
    resource_of,
    text_request,
)
from continuum_operator.kube.client.body import bodies
from continuum_operator.kube.client.kept import resource_version
from continuum_operator.kube.client.login import Login, login
from continuum_operator.model.json_body import integer, items_at, object_at, text

__all__ = [
    "LIST_PAGE",
    "AsyncKubeApi",
    "NotLeading",
    "follow",
    "pages",
    "refuse_unless_leading",
    "relist",
]

log = logging.getLogger(__name__)

#: Connections to the API server at once: the loops' writes in flight (the Engines' 8, the
#: grants loop's ledgers and Minds' writes, `--write-workers` each, the lanes', the seeds');
#: a request past it waits for one, it is not refused.
CONNECTIONS = 64

#: Objects a list asks for at once. A list answered whole is parsed whole: every engine pod of
#: a 2,000-engine cluster was the operator's largest allocation, about 250 MB of parsed JSON
#: every five seconds (`bench/scale.py --memray`, docs/performance.md); a page at a time, a
#: caller keeps what it reads of each page and lets the page go.
LIST_PAGE = 250


class NotLeading(Exception):
    """A write refused before it was sent: this replica no longer leads (`writing_while`)."""


def refuse_unless_leading(method: str, path: str, may_write: Callable[[], bool] | None) -> None:
    """Raise `NotLeading` for a write (any method but GET) once `may_write()` says this replica
    no longer leads; reads, and an adapter without a gate, pass."""
    if method != "GET" and may_write is not None and not may_write():
        raise NotLeading(f"{method} {path} not sent: this replica no longer leads")


class AsyncKubeApi:
    """`meter` records each request (the operator's metrics). Made by `connect` (on the running
    loop, where its session lives); `close` ends it."""

    #: Asked before each write where set (`writing_while`); reads are never gated.
    _may_write: Callable[[], bool] | None = None

    def __init__(
        self, credentials: Login, session: aiohttp.ClientSession, meter: RequestMeter | None = None
    ) -> None:
        self.login = credentials
        self._session = session
        self.meter = meter

    @classmethod
    async def connect(
        cls, kubeconfig: str | None = None, meter: RequestMeter | None = None
    ) -> AsyncKubeApi:
        # In a thread: the loader reads files.
        credentials = await asyncio.to_thread(login, kubeconfig)
        connector = aiohttp.TCPConnector(limit=CONNECTIONS, ssl=credentials.tls or False)
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)
        session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return cls(credentials, session, meter)

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> AsyncKubeApi:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def writing_while(self, may_write: Callable[[], bool]) -> AsyncKubeApi:
        """The same connection, whose writes go out only while `may_write()`: asked at each API
        call, so a Lease lost in the middle of a key's writes stops the ones after it (another
        replica may lead by then). A refused write raises `NotLeading`."""
        gated = copy.copy(self)
        gated._may_write = may_write
        return gated

    @contextlib.asynccontextmanager
    async def _opened(
        self, r: Request, timeout: aiohttp.ClientTimeout | None = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """`r` sent (within the session's deadline, or `timeout`), its answer open to be read
        inside; a transport failure, sending or reading, raised as an `OSError`."""
        body = None if r.body is None else json.dumps(r.body).encode()
        try:
            async with self._session.request(
                r.method,
                self.login.server + r.path,
                params=list(r.query),
                data=body,
                headers={**r.headers, **self.login.headers()},
                proxy=self.login.proxy,
                server_hostname=self.login.tls_server_name,
                timeout=timeout or self._session.timeout,
            ) as response:
                yield response
        except aiohttp.ClientError as err:
            if isinstance(err, OSError):
                raise
            raise ConnectionError(f"{r.method} {r.path}: {err!r}") from err

    async def send(self, r: Request, seconds: float | None = None) -> object:
        """`r`'s answer; within `seconds` where given, else the session's deadline."""
        refuse_unless_leading(r.method, r.path, self._may_write)
        resource = resource_of(r.path)
        if self.meter is not None:
            self.meter.record_api_request(r.method, resource)
        started = time.monotonic()
        timeout = None if seconds is None else aiohttp.ClientTimeout(total=seconds)
        async with self._opened(r, timeout) as response:
            data = await response.read()
        if self.meter is not None:
            self.meter.record_api_answer(r.method, resource, time.monotonic() - started)
        return answer(r, response.status, data)

    async def watch(
        self, path: str, query: Sequence[tuple[str, str]], since: str, seconds: int = 300
    ) -> AsyncIterator[dict[str, object]]:
        """A collection's changes after resourceVersion `since`, an event (`type`, `object`)
        at a time, bookmarks included, until the server ends the stream (after `seconds`).
        An `ERROR` event is raised as `ApiError` with its code (410: `since` is too old; list
        again)."""
        if self.meter is not None:
            self.meter.record_api_request("WATCH", resource_of(path))
        asked = (*query, ("watch", "1"), ("resourceVersion", since),
                 ("allowWatchBookmarks", "true"), ("timeoutSeconds", str(seconds)))  # fmt: skip
        r = Request("GET", path, query=asked, content_type=None)
        # No total deadline: the stream is meant to stay open; a silent one is cut.
        timeout = aiohttp.ClientTimeout(sock_connect=TIMEOUT_SECONDS, sock_read=seconds + 30)
        async with self._opened(r, timeout) as response:
            if response.status != 200:
                answer(r, response.status, await response.read())
            # Lines split here, not by the reader's readline: its line limit (64 KiB) is
            # smaller than an object may be.
            rest = b""
            async for chunk in response.content.iter_any():
                *lines, rest = (rest + chunk).split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _event(line)

    async def request(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, object]:
        # Loosely typed: the rooms that read these answers narrow them (`model.json_body`).
        return document(await self.send(call(method, path, body, query, content_type)))

    async def apply(self, obj: Mapping[str, object]) -> dict[str, object]:
        """Server-side apply, forced: fields this operator dropped are removed."""
        return document(await self.send(apply_request(obj)))

    async def merge_patch(self, path: str, patch: Mapping[str, object]) -> dict[str, object]:
        return document(await self.send(merge_patch_request(path, patch)))

    async def delete(self, path: str) -> None:
        await self.send(delete_request(path))

    async def text(self, path: str, query: Sequence[tuple[str, str]] = ()) -> str:
        """A plain-text answer (a pod's log)."""
        return str(await self.send(text_request(path, query)))

    async def create(
        self, obj: Mapping[str, object], *, seconds: float | None = None
    ) -> dict[str, object]:
        """`obj` made (a TokenReview: reviewed); answered within `seconds` where given."""
        return document(await self.send(create_request(obj), seconds))


def _event(line: bytes) -> dict[str, object]:
    event = document(json.loads(line))
    if event.get("type") == "ERROR":
        status = object_at(event.get("object"))
        raise ApiError(
            integer(status, "code") or 500,
            str(status.get("reason")),
            str(status.get("message")),
        )
    return event


async def pages(
    api: AsyncKubeApi, path: str, query: Sequence[tuple[str, str]] = (), limit: int = LIST_PAGE
) -> AsyncIterator[dict[str, object]]:
    """A collection's list, a page at a time (`limit` and `continue`): each page is one answer
    with `items` and `metadata`; all pages are of one snapshot (the first page's
    resourceVersion)."""
    token = ""
    while True:
        page = await api.request("GET", path, query=page_query(query, limit, token))
        yield page
        token = continue_token(page)
        if not token:
            return


K = TypeVar("K", bound=Hashable)


async def relist(
    api: AsyncKubeApi,
    path: str,
    observe: Callable[[dict[str, object]], None],
    key_of: Callable[[Mapping[str, object]], K],
    known: Mapping[K, Mapping[str, object]],
    forget: Callable[[K], None],
) -> None:
    """A collection listed into a cache, a page at a time (`observe` each object), as a new
    leader does before its first pass; then what the cache (`known`) has and the list has not,
    and is no newer than the list, `forget`: deleted before the list was taken. (A newer one
    came from a watch event after the list: kept.)"""
    listed: set[K] = set()
    version = 0
    async for page in pages(api, path):
        version = resource_version(page) or version
        for obj in bodies(page.get("items")):
            item = dict(obj)
            observe(item)
            listed.add(key_of(item))
    for key in set(known) - listed:
        had = known.get(key)
        if had is not None and resource_version(had) <= version:
            forget(key)


async def follow(
    api: AsyncKubeApi,
    path: str,
    query: Sequence[tuple[str, str]],
    listed: Callable[[AsyncIterator[dict[str, object]]], Awaitable[None]],
    changed: Callable[[dict[str, object]], None],
    *,
    what: str,
    retry_seconds: float = 1.0,
    seconds: int = 300,
) -> None:
    """A collection followed until cancelled, as an informer does: listed (`listed` with its
    items, read a page at a time, so that what a caller keeps of each item is all that stays of
    a long list), then watched from the list's resourceVersion, `changed` with each ADDED,
    MODIFIED or DELETED event. A stream the server ends (at `seconds`) or that drops is watched
    again from the last resourceVersion seen, a bookmark's included, so nothing is listed again; a
    version the server no longer has (410 Gone) is listed again at once (after `retry_seconds`
    where the version was a list's own, so a server in that state is not listed in a loop).
    Any other failure (`listed`'s too) is logged, naming `what`, and listed again after
    `retry_seconds`."""
    since = ""
    while True:
        fresh = not since  # watched from a list just taken
        try:
            if fresh:
                since = await _listed(api, path, query, listed)
            async for event in api.watch(path, query, since, seconds):
                since = text(event, "object", "metadata", "resourceVersion") or since
                fresh = False
                if event.get("type") != "BOOKMARK":
                    changed(event)
        except ApiError as err:
            since = ""
            if err.status != 410:
                log.warning("watching %s failed, listing again: %s", what, err)
            if err.status != 410 or fresh:  # a list's own version gone: not in a loop
                await asyncio.sleep(retry_seconds)
        except OSError as err:  # the connection dropped: watched again from `since`
            log.warning("watching %s failed, watching again: %s", what, err)
            await asyncio.sleep(retry_seconds)


async def _listed(
    api: AsyncKubeApi,
    path: str,
    query: Sequence[tuple[str, str]],
    listed: Callable[[AsyncIterator[dict[str, object]]], Awaitable[None]],
) -> str:
    """The collection listed and handed to `listed`, a page at a time; the list's
    resourceVersion (the pages `listed` left unread are read through for it)."""
    version = ""

    async def items() -> AsyncGenerator[dict[str, object], None]:
        nonlocal version
        async for page in pages(api, path, query):
            version = text(page, "metadata", "resourceVersion") or version
            for item in items_at(page, "items"):
                if isinstance(item, dict):
                    yield item

    each = items()
    try:
        await listed(each)
        async for _ in each:
            pass
    finally:
        await each.aclose()
    return version
