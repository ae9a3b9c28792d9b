"""`continuum release-finalizers`: take the operator's finalizers off what it finalizes, so that
uninstalling it leaves nothing stuck `Terminating`.

The operator finalizes one kind of object: a Mind holding a grant carries `continuum.dev/grant`
(`kube.grants.mind_writes.FINALIZER`) until her grant is released through her engine's gateway. With
no operator left to release it, a Mind deleted later would wait for ever (and a namespace holding
her would never finish deleting). The chart runs this command as a `pre-delete` hook Job
(templates/uninstall-hook.yaml); it can be run by hand with a kubeconfig as well.

Order matters: a running operator adds the finalizer back to every holding Mind, so the command
first stops it (`--stop-operator NAMESPACE/NAME`: its Deployment scaled to 0, then waits until
none of its pods is left, terminating ones included), and only then takes the finalizers off.
Each removal is a merge patch of the Mind's whole finalizer list conditioned on her
resourceVersion: finalizers of others are kept, and a Mind changed meanwhile is read again.
A Mind that is not being deleted keeps running without her finalizer; an operator installed
later puts it back while she holds a grant.

Neighbours: `kube.grants.mind_writes` (adds and drops the finalizer), `kube.client.api` (the
adapter), `cli.py`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import quote

from continuum_operator.kube.client.api import (
    ApiError,
    continue_token,
    crd_path,
    page_query,
)
from continuum_operator.kube.client.body import bodies
from continuum_operator.model.base import label_selector
from continuum_operator.model.json_body import object_at, text

__all__ = [
    "FINALIZED",
    "Released",
    "StopTimeout",
    "release_finalizers",
    "stop_operator",
]

log = logging.getLogger("continuum.release")

#: (plural of a continuum.dev kind, the finalizer the operator puts on it): everything the
#: operator finalizes (a test greps the operator for finalizers to keep this list whole).
FINALIZED: tuple[tuple[str, str], ...] = (("minds", "continuum.dev/grant"),)

CONFLICT_RETRIES = 5
PAGE = 500


class Api(Protocol):
    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, object]: ...

    def merge_patch(self, path: str, patch: Mapping[str, object]) -> dict[str, object]: ...


@dataclass
class Released:
    """What one run did: objects seen and those it took a finalizer off ("kind ns/name")."""

    seen: int = 0
    released: list[str] = field(default_factory=list)


class StopTimeout(Exception):
    pass


def stop_operator(
    api: Api,
    namespace: str,
    name: str,
    *,
    timeout: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Scale the operator's Deployment to 0 and wait until none of its pods is left. Returns
    the pods it waited for; a Deployment that is not there is nothing to stop."""
    path = f"/apis/apps/v1/namespaces/{quote(namespace)}/deployments/{quote(name)}"
    try:
        deployment = api.merge_patch(path, {"spec": {"replicas": 0}})
    except ApiError as err:
        if err.status == 404:
            return 0
        raise
    labels = {
        k: str(v) for k, v in object_at(deployment, "spec", "selector", "matchLabels").items()
    }
    if not labels:
        raise ApiError(422, "Invalid", f"Deployment {namespace}/{name} has no matchLabels")
    selector = label_selector(labels)
    pods_path = f"/api/v1/namespaces/{quote(namespace)}/pods"
    deadline = clock() + timeout
    waited = 0
    while True:
        pods = api.request("GET", pods_path, query=[("labelSelector", selector)]).get("items")
        left = len(pods) if isinstance(pods, list) else 0
        waited = max(waited, left)
        if left == 0:
            return waited
        if clock() >= deadline:
            raise StopTimeout(
                f"Deployment {namespace}/{name}: {left} pod(s) still there after {timeout:.0f} s; "
                "the operator would put the finalizers back: try again, or raise --timeout"
            )
        sleep(1.0)


def _items(api: Api, path: str) -> list[Mapping[str, object]]:
    items: list[Mapping[str, object]] = []
    token = ""
    while True:
        page = api.request("GET", path, query=page_query((), PAGE, token))
        items += bodies(page.get("items"))
        token = continue_token(page)
        if not token:
            return items


def _release_one(api: Api, plural: str, finalizer: str, obj: Mapping[str, object]) -> bool:
    """Take `finalizer` off one object; False when it is gone or no longer has it."""
    meta = object_at(obj, "metadata")
    path = crd_path(plural, text(meta.get("namespace")), str(meta["name"]))
    for _ in range(CONFLICT_RETRIES):
        listed = meta.get("finalizers")
        finalizers = [str(f) for f in listed] if isinstance(listed, list) else []
        if finalizer not in finalizers:
            return False
        patch = {
            "metadata": {
                "finalizers": [f for f in finalizers if f != finalizer],
                "resourceVersion": meta.get("resourceVersion"),
            }
        }
        try:
            api.merge_patch(path, patch)
            return True
        except ApiError as err:
            if err.status == 404:
                return False
            if err.status != 409:
                raise
        try:
            meta = object_at(
                api.request("GET", path), "metadata"
            )  # changed meanwhile: read it again
        except ApiError as err:
            if err.status == 404:
                return False
            raise
    raise ApiError(409, "Conflict", f"{path}: changed under {CONFLICT_RETRIES} tries")


def release_finalizers(api: Api) -> Released:
    """Take the operator's finalizers off every object it finalizes, in every namespace."""
    done = Released()
    for plural, finalizer in FINALIZED:
        for obj in _items(api, crd_path(plural, None)):
            done.seen += 1
            if _release_one(api, plural, finalizer, obj):
                meta = object_at(obj, "metadata")
                done.released.append(f"{plural} {meta.get('namespace')}/{meta.get('name')}")
    return done
