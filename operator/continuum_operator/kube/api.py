"""The one adapter that talks to the API server for the operator's writes (kopf watches).

Raw paths and plain dicts, on the `kubernetes` client's transport (its configuration, TLS and
credentials from the kubeconfig), so objects built by `kube.objects` go out as they are: no
generated model classes in between. Calls are blocking; the loop runs them in a thread.

Errors: `ApiError` carries the HTTP status and the server's message; 404 and 409 are told apart
by `status` where a caller cares.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import quote

from kubernetes import client, config

__all__ = ["ApiError", "KubeApi", "crd_path", "resource_of"]

FIELD_MANAGER = "continuum-operator"


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


def path_of(obj: Mapping[str, Any], *, collection: bool = False) -> str:
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
        "ServiceAccount": "serviceaccounts",
        "Role": "roles",
        "RoleBinding": "rolebindings",
        "ClusterRoleBinding": "clusterrolebindings",
        "NetworkPolicy": "networkpolicies",
        "ResourceClaimTemplate": "resourceclaimtemplates",
        "MutatingWebhookConfiguration": "mutatingwebhookconfigurations",
    }[str(obj["kind"])]
    ns = obj["metadata"].get("namespace")
    path = f"{prefix}/namespaces/{quote(ns)}/{plural}" if ns else f"{prefix}/{plural}"
    return path if collection else f"{path}/{quote(obj['metadata']['name'])}"


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


class KubeApi:
    """`on_request(verb, resource)` is called before each request (the operator counts them)."""

    def __init__(
        self,
        kubeconfig: str | None = None,
        on_request: Callable[[str, str], None] | None = None,
    ) -> None:
        self.on_request = on_request
        configuration = client.Configuration()
        in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        if kubeconfig is None and not os.environ.get("KUBECONFIG") and in_pod:
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        # The client's default pool is 5 connections a CPU; the loops write from more threads
        # than that (`--write-workers` for ledgers, as many for Minds, the loop's own), and a
        # connection past the pool is dropped after one request: a TLS handshake for each.
        configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize, 64)
        self._client = client.ApiClient(configuration)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if self.on_request is not None:
            self.on_request(method, resource_of(path))
        request = self._client.param_serialize(
            method,
            path,
            query_params=list(query),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self._client.call_api(*request, _request_timeout=30)
        response.read()
        text = response.data.decode() if response.data else ""
        if not 200 <= response.status <= 299:
            try:
                doc = json.loads(text)
                raise ApiError(response.status, str(doc.get("reason")), str(doc.get("message")))
            except ValueError:
                raise ApiError(response.status, "Error", text) from None
        return json.loads(text) if text else {}

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply, forced: fields this operator dropped are removed."""
        return self.request(
            "PATCH",
            path_of(obj),
            dict(obj),
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, dict(patch), content_type="application/merge-patch+json")

    def delete(self, path: str) -> None:
        try:
            self.request("DELETE", path, query=[("propagationPolicy", "Background")])
        except ApiError as err:
            if err.status != 404:
                raise

    def text(self, path: str, query: Sequence[tuple[str, str]] = ()) -> str:
        """A plain-text answer (a pod's log)."""
        if self.on_request is not None:
            self.on_request("GET", resource_of(path))
        # JSON accepted too: the API server answers an error as a Status object, and with
        # text/plain alone it says only "406 Not Acceptable", hiding the error itself.
        request = self._client.param_serialize(
            "GET", path, query_params=list(query),
            header_params={"Accept": "text/plain, application/json"},
            auth_settings=["BearerToken"],
        )  # fmt: skip
        response = self._client.call_api(*request, _request_timeout=30)
        response.read()
        text = response.data.decode() if response.data else ""
        if not 200 <= response.status <= 299:
            reason, message = "Error", text[:500]
            with contextlib.suppress(ValueError, AttributeError):
                status = json.loads(text)
                reason = str(status.get("reason") or reason)
                message = str(status.get("message") or message)
            raise ApiError(response.status, reason, message)
        return text

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path_of(obj, collection=True), dict(obj))
