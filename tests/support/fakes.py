"""Test doubles shared by the unit tests: one API server in memory (`FakeKubeApi`).

It answers the calls `kube.client.api.KubeApi` makes (`request`, `merge_patch`, `apply`, `create`,
`delete`, `text`) on objects kept by their REST path, as the API server does in the ways the
operator relies on: 404 for what is not there, a write carrying a stale `resourceVersion` refused
with 409, every write bumping the object's `resourceVersion`, lists by label and by page. Each
call is logged (`calls`) for the tests' assertions.

A test that needs the server to do something else (a flaky write, pods that go while it waits)
subclasses it; an API of another shape (the node agent's, a TokenReview client) is not this one.

The loops take the async adapter (`kube.client.async_api.AsyncKubeApi`): `Awaited` is its surface
over this one's (or any object with `KubeApi`'s calls: the benches' server in memory), each call
answered at once on the event loop, as a fast server would; `FakeKubeApi.aio` is it.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from continuum_operator.kube.client.api import ApiError, path_of
from continuum_operator.kube.client.async_api import refuse_unless_leading
from continuum_operator.model.base import API_VERSION

__all__ = ["Awaited", "Call", "FakeKubeApi", "collection_path", "object_path"]

T = TypeVar("T")

APPLY_PATCH = "application/apply-patch+yaml"


@dataclass
class Call:
    """One call as the double received it; `status` is what it answered (200, or the error's)."""

    method: str  # GET, PUT, POST, PATCH (a merge patch), APPLY, DELETE
    path: str
    body: Any = None
    query: tuple[tuple[str, str], ...] = ()
    status: int = 200


#: The plurals of kinds `kube.client.api.path_of` does not name (it names those the operator
# builds).
PLURALS = {
    "Pod": "pods",
    "Engine": "engines",
    "Mind": "minds",
    "MindClass": "mindclasses",
    "TokenQuota": "tokenquotas",
    "NodeBoard": "nodeboards",
    "EmbedLane": "embedlanes",
}


def collection_path(body: Mapping[str, Any], plural: str | None = None) -> str:
    """The REST path of the list an object is created in, by its kind or by the `plural` given
    (for bodies that carry no apiVersion or kind: continuum.dev's, then)."""
    kind = str(body.get("kind") or "")
    if plural is None and kind not in PLURALS:
        return path_of(body, collection=True)
    api_version = str(body.get("apiVersion") or API_VERSION)
    prefix = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    ns = body["metadata"].get("namespace")
    plural = plural or PLURALS[kind]
    return f"{prefix}/namespaces/{ns}/{plural}" if ns else f"{prefix}/{plural}"


def object_path(body: Mapping[str, Any], plural: str | None = None) -> str:
    """The REST path of an object (see `collection_path`)."""
    return f"{collection_path(body, plural)}/{body['metadata']['name']}"


def _split(path: str) -> tuple[str, list[str]]:
    """A path as its group-version prefix and what follows: `/apis/g/v`, [namespaces, ns, ...]."""
    parts = [p for p in path.split("/") if p]
    cut = 2 if parts[:1] == ["api"] else 3
    return "/" + "/".join(parts[:cut]), parts[cut:]


def _collections_of(path: str) -> tuple[str, ...]:
    """The lists an object's path is an item of: its namespace's and every namespace's."""
    prefix, rest = _split(path)
    if rest[:1] == ["namespaces"] and len(rest) == 4:
        return (f"{prefix}/namespaces/{rest[1]}/{rest[2]}", f"{prefix}/{rest[2]}")
    if len(rest) == 2:
        return (f"{prefix}/{rest[0]}",)
    return ()


def _is_collection(path: str) -> bool:
    _, rest = _split(path)
    if rest[:1] == ["namespaces"] and len(rest) > 2:
        rest = rest[2:]
    return len(rest) == 1


def _selects(selector: str, labels: Mapping[str, str]) -> bool:
    """A label selector's `key=value` and `key` (exists) terms; the few the operator sends."""
    for term in filter(None, selector.split(",")):
        key, eq, value = term.partition("=")
        if eq and labels.get(key) != value.removeprefix("="):
            return False
        if not eq and key not in labels:
            return False
    return True


def _merge_into(target: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """A JSON merge patch (RFC 7386) applied in place, so a test's handle on the object sees it."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(target.get(key), dict):
            _merge_into(target[key], value)
        elif isinstance(value, Mapping):
            target[key] = {}
            _merge_into(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class Awaited:
    """`kube.client.async_api.AsyncKubeApi`'s surface over a double's blocking calls: each awaited
    call is the double's, answered at once on the event loop (no thread, no await inside), so
    what the double does (its store, its log of calls, a subclass's failures) is the answer."""

    def __init__(self, api: FakeKubeApi) -> None:
        self.api = api  # or any object with its calls (the benches' server in memory)
        self._may_write: Callable[[], bool] | None = None

    def writing_while(self, may_write: Callable[[], bool]) -> Awaited:
        """As `AsyncKubeApi.writing_while`: each write refused (`NotLeading`) once not leading."""
        gated = Awaited(self.api)
        gated._may_write = may_write
        return gated

    def _gate(self, method: str, path: str) -> None:
        refuse_unless_leading(method, path, self._may_write)

    async def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        self._gate(method, path)
        return self.api.request(method, path, body, query=query, content_type=content_type)

    async def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        self._gate("PATCH", path)
        return self.api.merge_patch(path, patch)

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self._gate("PATCH", path_of(obj))
        return self.api.apply(obj)

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        self._gate("POST", path_of(obj, collection=True))
        return self.api.create(obj)

    async def delete(self, path: str) -> None:
        self._gate("DELETE", path)
        self.api.delete(path)

    async def text(self, path: str, query: Sequence[tuple[str, str]] = ()) -> str:
        return self.api.text(path, query)


class FakeKubeApi:
    """An API server in memory, objects by path (`objects`), every call logged (`calls`).

    `add` stores the body itself, not a copy: a test may keep its handle on the object and read
    what the writes did to it (writes change the stored object in place). Answers are copies.
    """

    def __init__(self, objects: Iterable[dict[str, Any]] = ()) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[Call] = []
        #: A pod's log by its path (`.../pods/NAME/log`); any other is 404.
        self.logs: dict[str, str] = {}
        self._meanwhile: dict[str, list[Callable[[dict[str, Any]], None]]] = {}
        self._names = itertools.count(1)
        self._uids = itertools.count(1)
        #: The same server, as the loops' async adapter answers.
        self.aio = Awaited(self)
        for obj in objects:
            self.add(obj)

    # --- the test's side ----------------------------------------------------------------------

    def add(self, body: dict[str, Any], plural: str | None = None) -> str:
        """Store an object as it is, at its path (returned)."""
        path = object_path(body, plural)
        self.objects[path] = body
        return path

    def meanwhile(self, path: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Another writer: `change` runs on the object once, just before the next write to it
        (or its status) lands, and bumps its resourceVersion, as that write would have."""
        self._meanwhile.setdefault(path, []).append(change)

    def next_version(self, old: str | None) -> str:
        """The resourceVersion an object written over `old` gets: one more, per object."""
        return str(int(old or 0) + 1)

    @property
    def requests(self) -> list[tuple[str, str]]:
        return [(c.method, c.path) for c in self.calls]

    @property
    def gets(self) -> list[str]:
        return [c.path for c in self.calls if c.method == "GET"]

    @property
    def puts(self) -> list[Any]:
        return [c.body for c in self.calls if c.method == "PUT"]

    @property
    def patches(self) -> list[tuple[str, Any]]:
        """Every merge patch sent, landed or not."""
        return [(c.path, c.body) for c in self.calls if c.method == "PATCH"]

    @property
    def patched(self) -> list[tuple[str, Any]]:
        """The merge patches that landed."""
        return [(c.path, c.body) for c in self.calls if c.method == "PATCH" and c.status == 200]

    @property
    def applied(self) -> list[Any]:
        return [c.body for c in self.calls if c.method == "APPLY"]

    @property
    def created(self) -> list[Any]:
        return [c.body for c in self.calls if c.method == "POST"]

    @property
    def deleted(self) -> list[str]:
        return [c.path for c in self.calls if c.method == "DELETE"]

    # --- KubeApi's surface --------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        query: Sequence[tuple[str, str]] = (),
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if method == "PATCH" and content_type == APPLY_PATCH:
            return self.apply(body)
        if method == "PATCH":
            return self.merge_patch(path, body)
        if method == "DELETE":
            self._answer(self._record(method, path), self._delete, path)
            return {}
        call = self._record(method, path, body, query)
        if method == "GET":
            return self._answer(call, self._get, path, query)
        if method == "PUT":
            return self._answer(call, self._put, path, body)
        if method == "POST":
            return self._answer(call, self._create, path, body)
        raise AssertionError(f"unexpected {method} {path}")

    def merge_patch(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        return self._answer(self._record("PATCH", path, patch), self._merge, path, patch)

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        return self._answer(self._record("APPLY", object_path(obj), obj), self._apply, obj)

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        path = collection_path(obj)
        return self._answer(self._record("POST", path, obj), self._create, path, obj)

    def delete(self, path: str) -> None:
        """As `KubeApi.delete`: what is already gone is not an error."""
        try:
            self._answer(self._record("DELETE", path), self._delete, path)
        except ApiError as err:
            if err.status != 404:
                raise

    def text(self, path: str, query: Sequence[tuple[str, str]] = ()) -> str:
        call = self._record("GET", path, None, query)
        if path not in self.logs:
            call.status = 404
            raise ApiError(404, "NotFound", path)
        return self.logs[path]

    # --- the server ---------------------------------------------------------------------------

    def _record(
        self, method: str, path: str, body: Any = None, query: Sequence[tuple[str, str]] = ()
    ) -> Call:
        # A copy: the caller may change its body after the call; the log keeps what was sent.
        call = Call(method, path, copy.deepcopy(body), tuple(query))
        self.calls.append(call)
        return call

    def _answer(self, call: Call, serve: Callable[..., T], *args: Any) -> T:
        try:
            return serve(*args)
        except ApiError as err:
            call.status = err.status
            raise

    def _stored(self, path: str) -> dict[str, Any]:
        if path not in self.objects:
            raise ApiError(404, "NotFound", path)
        return self.objects[path]

    def _bump(self, obj: dict[str, Any]) -> None:
        meta = obj.setdefault("metadata", {})
        meta["resourceVersion"] = self.next_version(meta.get("resourceVersion"))

    def _land(self, path: str, sent: Mapping[str, Any] | None) -> dict[str, Any]:
        """The object a write to `path` changes, once others' writes meanwhile landed; 409 if
        the write carries a resourceVersion that is no longer the object's."""
        obj = self._stored(path)
        for change in self._meanwhile.pop(path, []):
            change(obj)
            self._bump(obj)
        wanted = ((sent or {}).get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != obj["metadata"].get("resourceVersion"):
            raise ApiError(409, "Conflict", "the object has been modified")
        return obj

    def _get(self, path: str, query: Sequence[tuple[str, str]]) -> dict[str, Any]:
        if path in self.objects:
            return copy.deepcopy(self.objects[path])
        if not _is_collection(path):
            raise ApiError(404, "NotFound", path)
        asked = dict(query)
        selector = asked.get("labelSelector", "")
        items = [
            obj
            for p, obj in self.objects.items()
            if path in _collections_of(p)
            and _selects(selector, obj["metadata"].get("labels") or {})
        ]
        start = int(asked.get("continue") or 0)
        end = start + int(asked["limit"]) if "limit" in asked else len(items)
        more = end < len(items)
        return {
            "items": copy.deepcopy(items[start:end]),
            "metadata": {"continue": str(end) if more else ""},
        }

    def _put(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if path.endswith("/status"):  # the status subresource: the rest is not written
            obj = self._land(path.removesuffix("/status"), body)
            obj["status"] = copy.deepcopy(body.get("status"))
        else:
            obj = self._land(path, body)
            kept = obj["metadata"].get("resourceVersion")
            obj.clear()
            obj.update(copy.deepcopy(dict(body)))
            obj["metadata"]["resourceVersion"] = kept
        self._bump(obj)
        return copy.deepcopy(obj)

    def _merge(self, path: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        obj = self._land(path.removesuffix("/status"), patch)
        patch = copy.deepcopy(dict(patch))
        if isinstance(patch.get("metadata"), dict):
            patch["metadata"].pop("resourceVersion", None)  # a precondition, not a change
        _merge_into(obj, patch)
        self._bump(obj)
        return copy.deepcopy(obj)

    def _apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply, forced: the object as sent, its status kept; the generation moves
        when the spec does."""
        path = object_path(obj)
        new = copy.deepcopy(dict(obj))
        old = self.objects.get(path)
        if old is None:
            new["metadata"]["generation"] = 1
        else:
            old = self._land(path, None)
            if "status" in old:
                new["status"] = old["status"]
            changed = old.get("spec") != new.get("spec")
            new["metadata"]["generation"] = old["metadata"].get("generation", 1) + changed
            new["metadata"]["resourceVersion"] = old["metadata"].get("resourceVersion")
        self._bump(new)
        self.objects[path] = new
        return copy.deepcopy(new)

    def _create(self, collection: str, body: Mapping[str, Any]) -> dict[str, Any]:
        new = copy.deepcopy(dict(body))
        meta = new["metadata"]
        if not meta.get("name"):
            meta["name"] = f"{meta['generateName']}{next(self._names):05d}"
        path = f"{collection}/{meta['name']}"
        if path in self.objects:
            raise ApiError(409, "AlreadyExists", path)
        meta.pop("resourceVersion", None)
        meta.setdefault("uid", f"uid-{next(self._uids)}")  # as the API server: one per object
        self._bump(new)
        self.objects[path] = new
        return copy.deepcopy(new)

    def _delete(self, path: str) -> None:
        self._stored(path)
        del self.objects[path]
