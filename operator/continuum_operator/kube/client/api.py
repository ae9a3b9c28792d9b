"""What both adapters to the API server share (the request each verb sends, what an answer
means), and the blocking adapter (`KubeApi`), for the CLI and anything outside the event loop.

Raw paths and plain dicts, so objects built by `kube.workloads.engine_objects` go out as they are:
no generated model classes in between. `KubeApi` runs on the `kubernetes` client's transport (its
configuration, TLS and credentials from the kubeconfig); the operator's loops use
`kube.client.async_api.AsyncKubeApi`, the same verbs awaited on the event loop. Each verb is built
once here (`Request`) and each answer read once (`answer`), whichever transport carried it.

Errors: `ApiError` carries the HTTP status and the server's message; 404 and 409 are told apart
by `status` where a caller cares.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import quote

from kubernetes import client, config

from continuum_operator.model.json_body import object_at, text

__all__ = [
    "ApiError",
    "KubeApi",
    "Request",
    "answer",
    "continue_token",
    "crd_path",
    "document",
    "in_cluster",
    "login",
    "page_query",
    "path_of",
    "resource_of",
]

FIELD_MANAGER = "continuum-operator"
#: Seconds a request may take, answer read included.
TIMEOUT_SECONDS = 30
#: The one credential the adapters send: the kubeconfig's or the ServiceAccount's token (a
#: client certificate, when the kubeconfig has one, is the transport's).
AUTH_SETTINGS = ["BearerToken"]


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


def in_cluster(kubeconfig: str | None) -> bool:
    """Whether to log in as the pod's ServiceAccount: in a pod, with no kubeconfig named (the
    chart runs the operator so); else the kubeconfig (`--kubeconfig`, $KUBECONFIG, ~/.kube)."""
    in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    return kubeconfig is None and not os.environ.get("KUBECONFIG") and in_pod


def login(kubeconfig: str | None) -> client.Configuration:
    """Where the API server is and how to show who we are, for both adapters: as the pod's
    ServiceAccount (its token read again as the kubelet rotates it, through the configuration's
    refresh hook) or from the kubeconfig (its certificates written to files, an exec plugin
    run). Blocking: it may read files and run a plugin."""
    configuration = client.Configuration()
    try:
        if in_cluster(kubeconfig):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    except config.ConfigException as err:  # an OSError, as an unreachable server is
        raise ConnectionError(
            f"no API server to log in to: {err}; name a kubeconfig (--kubeconfig or "
            "$KUBECONFIG) or run in a pod"
        ) from err
    return configuration


class RequestMeter(Protocol):
    """What records the requests an adapter sends (the operator's metrics): each counted as it
    goes, and timed to its answer (an answer refused with a status too; not a transport
    failure)."""

    def record_api_request(self, verb: str, resource: str) -> None: ...

    def record_api_answer(self, verb: str, resource: str, seconds: float) -> None: ...


class KubeApi:
    """Blocking. `meter` records each request (the operator's metrics)."""

    def __init__(self, kubeconfig: str | None = None, meter: RequestMeter | None = None) -> None:
        self.meter = meter
        self._client = client.ApiClient(login(kubeconfig))

    def send(self, r: Request) -> object:
        resource = resource_of(r.path)
        if self.meter is not None:
            self.meter.record_api_request(r.method, resource)
        started = time.monotonic()
        prepared = self._client.param_serialize(
            r.method,
            r.path,
            query_params=list(r.query),
            header_params=r.headers,
            body=r.body,
            auth_settings=AUTH_SETTINGS,
        )
        response = self._client.call_api(*prepared, _request_timeout=TIMEOUT_SECONDS)
        response.read()
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
