"""What both adapters to the API server share (the request each verb sends, what an answer
means), and the blocking adapter (`KubeApi`), for the CLI and anything outside the event loop.

Raw paths and plain dicts, so objects built by `kube.workloads.engine_objects` go out as they are:
no generated model classes in between. `KubeApi` runs on urllib3 (a pool of connections, with the
TLS and credentials of `kube.client.login`); the operator's loops use
`kube.client.async_api.AsyncKubeApi`, the same verbs awaited on the event loop. Each verb is built
once here (`Request`) and each answer read once (`answer`), whichever transport carried it.

Errors: `ApiError` carries the HTTP status and the server's message; 404 and 409 are told apart
by `status` where a caller cares. A transport failure (refused, reset, timed out) is an `OSError`
in both adapters, and so is a failed login (`kube.client.login.LoginError`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote, urlencode

import urllib3

from continuum_operator.kube.client.login import Login, login
from continuum_operator.model.json_body import object_at, text

__all__ = [
    "ApiError",
    "KubeApi",
    "Request",
    "answer",
    "continue_token",
    "crd_path",
    "document",
    "page_query",
    "path_of",
    "resource_of",
]

FIELD_MANAGER = "continuum-operator"
#: Seconds a request may take, answer read included.
TIMEOUT_SECONDS = 30


class ApiError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(f"{status} {reason}: {message}")


def crd_path(plural: str, namespace: str | None, name: str | None = None, sub: str = "") -> str:
    base = "/apis/continuum.dev/v1alpha1"
    path = f"{base}/namespaces/{quote(namespace)}/{plural}" if namespace else f"{base}/{plural}"
    if name:
        path += f"/{quote(name)}"
    return path + (f"/{sub}" if sub else "")


def path_of(obj: Mapping[str, object], *, collection: bool = False) -> str:
    """The REST path of a built object (core, grouped, namespaced or cluster-scoped)."""
    api_version = str(obj["apiVersion"])
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    plural = {
        "Deployment": "deployments",
        "Service": "services",
        "PriorityClass": "priorityclasses",
        "Event": "events",
        "Lease": "leases",
        "Node": "nodes",
        "Job": "jobs",
        "GrantLedger": "grantledgers",
        "ServiceAccount": "serviceaccounts",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "ClusterRoleBinding": "clusterrolebindings",
        "NetworkPolicy": "networkpolicies",
        "ResourceClaimTemplate": "resourceclaimtemplates",
        "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
        "TokenReview": "tokenreviews",
    }[str(obj["kind"])]
    meta = object_at(obj, "metadata")
    ns = text(meta.get("namespace"))
    path = f"{prefix}/namespaces/{quote(ns)}/{plural}" if ns else f"{prefix}/{plural}"
    return path if collection else f"{path}/{quote(str(meta['name']))}"


def page_query(query: Sequence[tuple[str, str]], limit: int, token: str) -> list[tuple[str, str]]:
    """One page of a list: `query` with `limit`, and the `continue` token the page before gave
    ("" for the first page). Both adapters' pagers ask with it (`continue_token` reads the
    answer)."""
    return [*query, ("limit", str(limit)), *([("continue", token)] if token else [])]


def continue_token(page: Mapping[str, object]) -> str:
    """The token of a list's next page ("": that was the last)."""
    return str(object_at(page, "metadata").get("continue") or "")


def resource_of(path: str) -> str:
    """The resource a REST path names, with its subresource: `engines/status`, `pods/log`."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    if parts[:1] == ["api"]:
        parts = parts[2:]
    elif parts[:1] == ["apis"]:
        parts = parts[3:]
    if parts[:1] == ["namespaces"] and len(parts) > 2:
        parts = parts[2:]
    if not parts:
        return "-"
    return parts[0] + (f"/{parts[2]}" if len(parts) > 2 else "")


@dataclass(frozen=True, slots=True)
class Request:
    """One call as either adapter sends it. `content_type` None: no body (its header is left
    out); `gone_ok`: a 404 is the answer wanted (a delete of what is already gone)."""

    method: str
    path: str
    body: object = None
    query: tuple[tuple[str, str], ...] = ()
    content_type: str | None = "application/json"
    accept: str = "application/json"
    gone_ok: bool = False

    @property
    def headers(self) -> dict[str, str]:
        headers = {"Accept": self.accept}
        if self.content_type is not None:
            headers["Content-Type"] = self.content_type
        return headers

    @property
    def plain(self) -> bool:
        """The answer is text (a pod's log), not a JSON document."""
        return not self.accept.startswith("application/json")


def call(
    method: str,
    path: str,
    body: object = None,
    query: Sequence[tuple[str, str]] = (),
    content_type: str = "application/json",
) -> Request:
    return Request(method, path, body, tuple(query), content_type)


def apply_request(obj: Mapping[str, object]) -> Request:
    """Server-side apply, forced: fields this operator dropped are removed."""
    query = (("fieldManager", FIELD_MANAGER), ("force", "true"))
    return Request("PATCH", path_of(obj), dict(obj), query, "application/apply-patch+yaml")


def merge_patch_request(path: str, patch: Mapping[str, object]) -> Request:
    return Request("PATCH", path, dict(patch), content_type="application/merge-patch+json")


def delete_request(path: str) -> Request:
    """A delete in the background; what is already gone is not an error."""
    return Request("DELETE", path, query=(("propagationPolicy", "Background"),), gone_ok=True)


def text_request(path: str, query: Sequence[tuple[str, str]] = ()) -> Request:
    """A plain-text answer (a pod's log). JSON accepted too: the API server answers an error as
    a Status object, and with text/plain alone it says only "406 Not Acceptable", hiding it."""
    return Request("GET", path, None, tuple(query), None, "text/plain, application/json")


def create_request(obj: Mapping[str, object]) -> Request:
    return Request("POST", path_of(obj, collection=True), dict(obj))


def answer(request: Request, status: int, data: bytes | None) -> object:
    """What a request's answer means: the document (or the text, for `text_request`), or the
    `ApiError` the server's Status object says."""
    decoded = data.decode() if data else ""
    if 200 <= status <= 299:
        if request.plain:
            return decoded
        parsed: object = json.loads(decoded) if decoded else {}
        return parsed
    if status == 404 and request.gone_ok:
        return {}
    reason, message = "Error", decoded[:500]
    with contextlib.suppress(ValueError):
        doc = object_at(json.loads(decoded))
        reason = str(doc.get("reason") or reason)
        message = str(doc.get("message") or message)
    raise ApiError(status, reason, message)


def document(answer: object) -> dict[str, object]:
    """An answer that must be a JSON object (an object's body, a list's page)."""
    if not isinstance(answer, dict):
        raise ApiError(500, "InvalidAnswer", f"expected a JSON object, got {type(answer).__name__}")
    return answer


class RequestMeter(Protocol):
    """What records the requests an adapter sends (the operator's metrics): each counted as it
    goes, and timed to its answer (an answer refused with a status too; not a transport
    failure)."""

    def record_api_request(self, verb: str, resource: str) -> None: ...

    def record_api_answer(self, verb: str, resource: str, seconds: float) -> None: ...


def pool_for(credentials: Login) -> urllib3.PoolManager:
    """Connections to the API server with `credentials`' TLS, through its proxy where it names
    one."""
    tls, name = credentials.tls, credentials.tls_server_name
    if credentials.proxy:
        return urllib3.ProxyManager(
            credentials.proxy, ssl_context=tls, server_hostname=name, retries=False
        )
    return urllib3.PoolManager(ssl_context=tls, server_hostname=name, retries=False)


class KubeApi:
    """Blocking. `meter` records each request (the operator's metrics). Logs in as it is made
    (`kube.client.login.login`: a `LoginError` where it cannot)."""

    def __init__(self, kubeconfig: str | None = None, meter: RequestMeter | None = None) -> None:
        self.meter = meter
        self.login = login(kubeconfig)
        self._pool = pool_for(self.login)

    def send(self, r: Request) -> object:
        resource = resource_of(r.path)
        if self.meter is not None:
            self.meter.record_api_request(r.method, resource)
        started = time.monotonic()
        url = self.login.server + r.path + (f"?{urlencode(r.query)}" if r.query else "")
        try:
            response = self._pool.request(
                r.method,
                url,
                body=None if r.body is None else json.dumps(r.body).encode(),
                headers={**r.headers, **self.login.headers()},
                timeout=urllib3.Timeout(total=TIMEOUT_SECONDS),
                redirect=False,
            )
        except urllib3.exceptions.HTTPError as err:  # as the async adapter's: an OSError
            raise ConnectionError(f"{r.method} {r.path}: {err!r}") from err
        if self.meter is not None:
            self.meter.record_api_answer(r.method, resource, time.monotonic() - started)
        return answer(r, response.status, response.data)

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, object]:
        return document(self.send(call(method, path, body, query, content_type)))

    def apply(self, obj: Mapping[str, object]) -> dict[str, object]:
        """Server-side apply, forced: fields this operator dropped are removed."""
        return document(self.send(apply_request(obj)))

    def merge_patch(self, path: str, patch: Mapping[str, object]) -> dict[str, object]:
        return document(self.send(merge_patch_request(path, patch)))

    def delete(self, path: str) -> None:
        self.send(delete_request(path))

    def text(self, path: str, query: Sequence[tuple[str, str]] = ()) -> str:
        """A plain-text answer (a pod's log)."""
        return str(self.send(text_request(path, query)))

    def create(self, obj: Mapping[str, object]) -> dict[str, object]:
        return document(self.send(create_request(obj)))
