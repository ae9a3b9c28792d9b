"""`AsyncKubeApi` against an HTTP server on this machine: each verb sends what the blocking
adapter sends (method, path, query, headers, the token), on the event loop, and an answer
means the same (the server's Status raised as `ApiError`, a 404 on a delete taken as done, a
log as text); a server that cannot be reached is an `OSError`."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import AsyncKubeApi, NotLeading
from tests.support.kube_login import TOKEN, Meter, kubeconfig

# Each request the server saw: method, path, query, headers, body.
Seen = list[tuple[str, str, dict[str, str], Mapping[str, str], str]]


BIG = "x" * 100_000  # an object larger than aiohttp's readline takes


async def serve(request: web.Request, seen: Seen) -> web.StreamResponse:
    body = await request.text()
    seen.append((request.method, request.path, dict(request.query), request.headers, body))
    if request.query.get("watch") == "1":
        return await stream_events(request)
    status = {"kind": "Status", "reason": "Conflict", "message": "the object has been modified"}
    if request.path.endswith("/log"):
        return web.Response(text="line one\n", content_type="text/plain")
    if request.method == "DELETE":
        return web.json_response({"kind": "Status", "reason": "NotFound"}, status=404)
    if request.method == "PUT":
        return web.json_response(status, status=409)
    return web.json_response({"kind": "Thing", "echo": json.loads(body) if body else None})


async def stream_events(request: web.Request) -> web.StreamResponse:
    """Two events, the second split across writes and larger than a readline; then 410."""
    response = web.StreamResponse()
    await response.prepare(request)
    added = {"type": "ADDED", "object": {"metadata": {"uid": "u1", "resourceVersion": "5"}}}
    modified = {
        "type": "MODIFIED",
        "object": {"metadata": {"uid": "u1", "resourceVersion": "6"}, "note": BIG},
    }
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410, "reason": "Expired",
                                        "message": "too old resource version"}}  # fmt: skip
    await response.write(json.dumps(added).encode() + b"\n")
    line = json.dumps(modified).encode() + b"\n"
    await response.write(line[:70_000])
    await response.write(line[70_000:])
    await response.write(json.dumps(gone).encode() + b"\n")
    await response.write_eof()
    return response


@asynccontextmanager
async def server(tmp_path: Path) -> AsyncIterator[tuple[AsyncKubeApi, Seen, list[str]]]:
    seen: Seen = []

    async def handler(request: web.Request) -> web.StreamResponse:
        return await serve(request, seen)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    counted: list[str] = []
    api = await AsyncKubeApi.connect(kubeconfig(tmp_path / "kubeconfig", port), Meter(counted))
    try:
        yield api, seen, counted
    finally:
        await api.close()
        await runner.cleanup()


def run(
    tmp_path: Path, body: Callable[[AsyncKubeApi, Seen, list[str]], Coroutine[Any, Any, None]]
) -> None:
    async def main() -> None:
        async with server(tmp_path) as (api, seen, counted):
            await body(api, seen, counted)

    asyncio.run(main())


def test_each_verb_sends_what_the_blocking_adapter_sends(tmp_path: Path) -> None:
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns"},
    }

    async def body(api: AsyncKubeApi, seen: Seen, counted: list[str]) -> None:
        applied = await api.apply(deployment)
        assert applied["echo"] == deployment
        await api.merge_patch("/apis/continuum.dev/v1alpha1/namespaces/ns/engines/e/status",
                              {"status": {"x": 1}})  # fmt: skip
        await api.create({**deployment, "kind": "Deployment"})
        listed = await api.request("GET", "/api/v1/pods", query=[("labelSelector", "a=b")])
        assert listed["kind"] == "Thing"
        await api.delete("/apis/apps/v1/namespaces/ns/deployments/d")  # 404: already gone
        assert await api.text("/api/v1/namespaces/ns/pods/p/log") == "line one\n"
        methods = [(m, p) for m, p, *_ in seen]
        assert methods == [
            ("PATCH", "/apis/apps/v1/namespaces/ns/deployments/d"),
            ("PATCH", "/apis/continuum.dev/v1alpha1/namespaces/ns/engines/e/status"),
            ("POST", "/apis/apps/v1/namespaces/ns/deployments"),
            ("GET", "/api/v1/pods"),
            ("DELETE", "/apis/apps/v1/namespaces/ns/deployments/d"),
            ("GET", "/api/v1/namespaces/ns/pods/p/log"),
        ]
        apply_query, apply_headers = seen[0][2], seen[0][3]
        assert apply_query == {"fieldManager": "continuum-operator", "force": "true"}
        assert apply_headers["Content-Type"] == "application/apply-patch+yaml"
        assert seen[1][3]["Content-Type"] == "application/merge-patch+json"
        assert seen[3][2] == {"labelSelector": "a=b"}
        assert seen[4][2] == {"propagationPolicy": "Background"}
        assert seen[5][3]["Accept"] == "text/plain, application/json"
        assert {h["Authorization"] for *_, h, _ in seen} == {f"Bearer {TOKEN}"}
        # Each counted as it went and timed to its answer (the DELETE's 404 is an answer too).
        sent = ["PATCH deployments", "PATCH engines/status", "POST deployments", "GET pods",
                "DELETE deployments", "GET pods/log"]  # fmt: skip
        assert counted == [x for each in sent for x in (each, f"answered {each}")]

    run(tmp_path, body)


def test_a_gated_adapter_sends_no_write_once_the_replica_no_longer_leads(
    tmp_path: Path,
) -> None:
    leading = [True]
    path = "/apis/continuum.dev/v1alpha1/namespaces/ns/engines/e/status"

    async def body(api: AsyncKubeApi, seen: Seen, counted: list[str]) -> None:
        gated = api.writing_while(lambda: leading[0])
        await gated.merge_patch(path, {"status": {"x": 1}})
        leading[0] = False
        for write in (
            gated.merge_patch(path, {"status": {"x": 2}}),
            gated.apply(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {"name": "s", "namespace": "ns"},
                }
            ),
            gated.delete("/apis/apps/v1/namespaces/ns/deployments/d"),
            gated.request("PUT", path, {}),
        ):
            with pytest.raises(NotLeading, match="no longer leads"):
                await write
        await gated.request("GET", "/api/v1/pods")  # reads are every replica's
        await api.merge_patch(path, {"status": {"x": 3}})  # the ungated one (the webhook's)
        assert [(m, p) for m, p, *_ in seen] == [
            ("PATCH", path),
            ("GET", "/api/v1/pods"),
            ("PATCH", path),
        ]

    run(tmp_path, body)


def test_a_watch_yields_each_event_and_raises_the_servers_error(tmp_path: Path) -> None:
    async def body(api: AsyncKubeApi, seen: Seen, counted: list[str]) -> None:
        events: list[dict[str, Any]] = []
        with pytest.raises(ApiError) as raised:
            async for event in api.watch("/api/v1/pods", [("labelSelector", "a")], "4"):
                events.append(event)
        assert [e["type"] for e in events] == ["ADDED", "MODIFIED"]
        assert events[1]["object"]["note"] == BIG
        assert raised.value.status == 410
        query = seen[0][2]
        assert query["resourceVersion"] == "4" and query["labelSelector"] == "a"
        assert query["watch"] == "1" and query["allowWatchBookmarks"] == "true"
        assert counted == ["WATCH pods"]

    run(tmp_path, body)


def test_the_servers_status_is_raised_with_its_code_and_reason(tmp_path: Path) -> None:
    async def body(api: AsyncKubeApi, seen: Seen, counted: list[str]) -> None:
        with pytest.raises(ApiError) as raised:
            await api.request("PUT", "/apis/coordination.k8s.io/v1/namespaces/n/leases/l", {})
        assert raised.value.status == 409
        assert raised.value.reason == "Conflict"
        assert "has been modified" in str(raised.value)

    run(tmp_path, body)


def test_a_server_that_cannot_be_reached_is_an_os_error(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def main() -> None:
        api = await AsyncKubeApi.connect(kubeconfig(tmp_path / "kubeconfig", port))
        try:
            with pytest.raises(OSError):
                await api.request("GET", "/api/v1/pods")
        finally:
            await api.close()

    asyncio.run(main())
