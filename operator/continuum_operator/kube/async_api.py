"""The adapter the operator's loops talk to the API server through, on the event loop: the verbs
of `kube.api.KubeApi` (request, apply, merge_patch, delete, text, create), awaited.

The transport is `kubernetes_asyncio`'s (the asyncio port of the `kubernetes` client, on aiohttp
as kopf is): its configuration, TLS, credentials and their refresh (a ServiceAccount token read
again as the kubelet rotates it, an exec plugin's run without blocking the loop), and its
connection pool. Only its `ApiClient.call_api` is used, with the answer left unread
(`_preload_content=False`): the request each verb sends and what an answer means are
`kube.api`'s, shared with the blocking adapter, so no generated model class comes in between.

A transport failure (refused, reset, timed out) is raised as an `OSError`, as the blocking
adapter's socket errors are, so the callers' `except (ApiError, OSError)` holds for both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config

from continuum_operator.kube.api import (
    AUTH_SETTINGS,
    TIMEOUT_SECONDS,
    Request,
    answer,
    apply_request,
    call,
    create_request,
    delete_request,
    in_cluster,
    merge_patch_request,
    resource_of,
    text_request,
)

__all__ = ["AsyncKubeApi", "login"]

#: Connections to the API server at once: the loops' writes in flight (the Engines' 8, the
#: grants loop's ledgers and Minds' writes, `--write-workers` each, the lanes', the seeds');
#: a request past it waits for one, it is not refused.
CONNECTIONS = 64


async def login(kubeconfig: str | None) -> Any:
    """The client's configuration: as the pod's ServiceAccount or from the kubeconfig, as the
    blocking adapter decides (`kube.api.in_cluster`)."""
    configuration = client.Configuration()
    if in_cluster(kubeconfig):
        config.load_incluster_config(client_configuration=configuration)
    else:
        await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    return configuration


class AsyncKubeApi:
    """`on_request(verb, resource)` is called before each request (the operator counts them).
    Made by `connect` (the configuration loads, and the session opens, on the running loop);
    `close` ends the session."""

    def __init__(
        self, api_client: Any, on_request: Callable[[str, str], None] | None = None
    ) -> None:
        self._client = api_client
        self.on_request = on_request

    @classmethod
    async def connect(
        cls, kubeconfig: str | None = None, on_request: Callable[[str, str], None] | None = None
    ) -> AsyncKubeApi:
        configuration = await login(kubeconfig)
        configuration.connection_pool_maxsize = CONNECTIONS
        return cls(client.ApiClient(configuration), on_request)

    async def close(self) -> None:
        await self._client.close()

    async def send(self, r: Request) -> Any:
        if self.on_request is not None:
            self.on_request(r.method, resource_of(r.path))
        try:
            response = await self._client.call_api(
                r.path,
                r.method,
                query_params=list(r.query),
                header_params=r.headers,
                body=r.body,
                auth_settings=AUTH_SETTINGS,
                _preload_content=False,
                _request_timeout=TIMEOUT_SECONDS,
            )
            async with response:
                data = await response.read()
        except aiohttp.ClientError as err:
            if isinstance(err, OSError):
                raise
            raise ConnectionError(f"{r.method} {r.path}: {err!r}") from err
        return answer(r, response.status, data)

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self.send(call(method, path, body, query, content_type))
        return result

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply, forced: fields this operator dropped are removed."""
        result: dict[str, Any] = await self.send(apply_request(obj))
        return result

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.send(merge_patch_request(path, patch))
        return result

    async def delete(self, path: str) -> None:
        await self.send(delete_request(path))

    async def text(self, path: str, query: Sequence[tuple[str, str]] = ()) -> str:
        """A plain-text answer (a pod's log)."""
        return str(await self.send(text_request(path, query)))

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.send(create_request(obj))
        return result
