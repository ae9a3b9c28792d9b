"""Minds, MindClasses and TokenQuotas as the watches last saw them, for the grants loop
(`kube.grants.loop`): Minds grouped by the Engine they name, and the engines whose minds changed
marked on the grants loop's work queue (`kube.base.kernel`). Neighbours: `kube.ledger.grant_ledger`
(a Mind's keys)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from continuum_operator.kube.base.kernel import WorkQueue
from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import AsyncKubeApi, pages, relist
from continuum_operator.kube.client.body import bodies
from continuum_operator.kube.client.kept import kept, newer, resource_version
from continuum_operator.kube.ledger import routing
from continuum_operator.kube.state.cache import EngineKey
from continuum_operator.model.base import GROUP, VERSION
from continuum_operator.model.json_body import items_at, name_of, object_at, text

__all__ = ["MindCache", "list_minds", "register", "seed"]

# --- watches ----------------------------------------------------------------------------------


@dataclass
class MindCache:
    """Minds, MindClasses and TokenQuotas as the watches last saw them; Minds also grouped by
    the Engine they name. The engines whose minds changed are marked on `queue`, the grants
    loop's work queue, so a pass steps only those; a class or quota changed wakes it (the loop
    compares them with those it last stepped with).

    Touched only from the event loop (the watches, the grants loop, the answers of its writes,
    awaited there): no lock."""

    minds: dict[str, dict[str, Any]] = field(default_factory=dict)  # "ns/name" -> body
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    quotas: dict[str, dict[str, Any]] = field(default_factory=dict)  # "ns/name" -> body
    groups: dict[EngineKey, dict[str, dict[str, Any]]] = field(default_factory=dict)
    queue: WorkQueue[EngineKey] = field(default_factory=WorkQueue)

    def observe_mind(self, obj: Mapping[str, object], deleted: bool, nudge: bool = True) -> None:
        """`nudge` False: the answer of our own write (or the leader's list): her engine is
        marked only if what the ledger reads of her changed; a watch event of a newer version
        marks it whatever changed (her status may need writing again)."""
        key = routing.mind_key(obj)
        body = None if deleted else kept(obj)
        known = self.minds.get(key)
        if body is None:
            if known is not None:
                self._put(key, known, None, nudge)
        elif newer(body, known):
            if (
                known is None
                or _demand_facts(known) != _demand_facts(body)
                or (nudge and resource_version(body) != resource_version(known))
            ):
                self._put(key, known, body, nudge)
            else:  # the same engine, nothing it reads changed
                self.minds[key] = body
                self.groups.setdefault(routing.engine_key_of(body), {})[key] = body

    def _put(
        self, key: str, old: Mapping[str, object] | None, new: dict[str, Any] | None, wake: bool
    ) -> None:
        """Replace a Mind, marking the engine she named and the one she names (`wake`: a pass
        soon; False leaves the marks to the next pass)."""
        if old is not None:
            was = routing.engine_key_of(old)
            self.queue.mark(was, wake=wake)
            group = self.groups.get(was)
            if group is not None:
                group.pop(key, None)
                if not group:
                    del self.groups[was]
        if new is None:
            self.minds.pop(key, None)
            return
        now = routing.engine_key_of(new)
        self.queue.mark(now, wake=wake)
        self.minds[key] = new
        self.groups.setdefault(now, {})[key] = new

    def forget(self, key: str) -> None:
        """Drop a Mind the API no longer has (deleted while no watch was looking)."""
        known = self.minds.get(key)
        if known is not None:
            self._put(key, known, None, wake=False)

    def engine_of(self, key: str) -> EngineKey | None:
        """The engine a Mind names, as the cache has her (None: she is not known)."""
        known = self.minds.get(key)
        return routing.engine_key_of(known) if known is not None else None

    def minds_of(self, keys: Iterable[EngineKey]) -> dict[EngineKey, list[dict[str, Any]]]:
        """The Minds naming each of these engines (those with any)."""
        return {k: list(g.values()) for k in keys if (g := self.groups.get(k))}

    def engine_keys(self) -> set[EngineKey]:
        """Every engine some Mind names."""
        return set(self.groups)

    def observe_class(self, obj: Mapping[str, object], deleted: bool) -> None:
        # (A class changes what every engine's minds demand: the loop compares the classes
        # it last stepped with and steps every engine when they differ.)
        name = text(obj, "metadata", "name") or ""
        if deleted:
            self.classes.pop(name, None)
        else:
            self.classes[name] = kept(obj)
        self.queue.wake()

    def observe_quota(self, obj: Mapping[str, object], deleted: bool, nudge: bool = True) -> None:
        key = routing.mind_key(obj)
        if deleted:
            self.quotas.pop(key, None)
        else:
            known = self.quotas.get(key)
            if newer(obj, known):
                self.quotas[key] = kept(obj)
        if nudge:
            self.queue.wake()


async def seed(api: AsyncKubeApi, cache: MindCache) -> None:
    """List MindClasses, TokenQuotas and Minds into the cache (a new leader, before its first
    step); watch events go on after. A page at a time: ten thousand Minds answered whole were
    a few hundred MB parsed at once, at each leader's start."""
    base = f"/apis/{GROUP}/{VERSION}"
    async for page in pages(api, f"{base}/mindclasses"):
        for obj in bodies(items_at(page, "items")):
            cache.classes[name_of(obj)] = kept(obj)
    try:
        async for page in pages(api, f"{base}/tokenquotas"):
            for obj in bodies(items_at(page, "items")):
                cache.observe_quota(obj, deleted=False, nudge=False)
    except ApiError as err:
        if err.status != 404:  # 404: the TokenQuota CRD is not installed; no quotas
            raise
    await list_minds(api, cache)


async def list_minds(api: AsyncKubeApi, cache: MindCache) -> None:
    """The Minds into the cache, those it has and the API no longer has dropped."""
    await relist(
        api,
        f"/apis/{GROUP}/{VERSION}/minds",
        lambda obj: cache.observe_mind(obj, deleted=False, nudge=False),
        routing.mind_key,
        cache.minds,
        cache.forget,
    )


def _demand_facts(mind: Mapping[str, object]) -> tuple[object, ...]:
    """What the ledger reads of a Mind (`routing.route_minds`, `routing.demands_of`) and what
    her projection and finalizer follow from: her engine, her deletion, class and size
    (compared as written, for a change)."""
    meta, spec = object_at(mind, "metadata"), object_at(mind, "spec")
    return (
        routing.engine_key_of(mind),
        bool(meta.get("deletionTimestamp")),
        spec.get("className"),
        spec.get("contextTokens"),
        meta.get("creationTimestamp"),
        meta.get("generation"),
    )


def register(registry: kopf.OperatorRegistry, minds: MindCache) -> None:
    """Watch Minds, MindClasses and TokenQuotas into `minds`."""

    @kopf.on.event(group=GROUP, version=VERSION, plural="minds", registry=registry)
    async def mind(event: kopf.RawEvent, **_: object) -> None:
        minds.observe_mind(event["object"], event.get("type") == "DELETED")

    @kopf.on.event(group=GROUP, version=VERSION, plural="mindclasses", registry=registry)
    async def mindclass(event: kopf.RawEvent, **_: object) -> None:
        minds.observe_class(event["object"], event.get("type") == "DELETED")

    @kopf.on.event(group=GROUP, version=VERSION, plural="tokenquotas", registry=registry)
    async def tokenquota(event: kopf.RawEvent, **_: object) -> None:
        minds.observe_quota(event["object"], event.get("type") == "DELETED")
