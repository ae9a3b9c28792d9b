"""Minds, MindClasses and TokenQuotas as the watches last saw them, for the grants loop
(`kube.minds`): Minds grouped by the Engine they name, and the engines whose minds changed
since the loop last took them. Neighbours: `kube.ledger` (a Mind's keys)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from continuum_operator.kube import routing
from continuum_operator.kube.cache import EngineKey
from continuum_operator.kube.kept import kept
from continuum_operator.model.base import GROUP, VERSION

__all__ = ["MindCache", "register", "resource_version"]

# --- watches ----------------------------------------------------------------------------------


@dataclass
class MindCache:
    """Minds, MindClasses and TokenQuotas as the watches last saw them; Minds also grouped by
    the Engine they name, and the engines whose minds changed since the grants loop last took
    them (`take_dirty`), so a pass steps only those.

    Minds are observed from the event loop (watches) and from the writer threads (the answers
    of our own writes): the groups and the dirty set under one lock. `minds` itself is read
    without it (a dict's get is atomic; bodies are replaced, never changed in place)."""

    minds: dict[str, dict[str, Any]] = field(default_factory=dict)  # "ns/name" -> body
    classes: dict[str, dict[str, Any]] = field(default_factory=dict)
    quotas: dict[str, dict[str, Any]] = field(default_factory=dict)  # "ns/name" -> body
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    groups: dict[EngineKey, dict[str, dict[str, Any]]] = field(default_factory=dict)
    dirty: set[EngineKey] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def observe_mind(self, obj: Mapping[str, Any], deleted: bool, nudge: bool = True) -> None:
        """`nudge` False: the answer of our own write (or the leader's list): her engine is
        marked only if what the ledger reads of her changed; a watch event of a newer version
        marks it whatever changed (her status may need writing again)."""
        key = routing.mind_key(obj)
        body = None if deleted else kept(obj)  # (outside the lock)
        with self.lock:
            known = self.minds.get(key)
            if body is None:
                if known is not None:
                    self._put(key, known, None)
            elif known is None or resource_version(body) >= resource_version(known):
                if (
                    known is None
                    or _demand_facts(known) != _demand_facts(body)
                    or (nudge and resource_version(body) != resource_version(known))
                ):
                    self._put(key, known, body)
                else:  # the same engine, nothing it reads changed
                    self.minds[key] = body
                    self.groups.setdefault(routing.engine_key_of(body), {})[key] = body
        if nudge:
            self.changed.set()

    def _put(self, key: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """Replace a Mind (under the lock), marking the engine she named and the one she names."""
        if old is not None:
            was = routing.engine_key_of(old)
            self.dirty.add(was)
            group = self.groups.get(was)
            if group is not None:
                group.pop(key, None)
                if not group:
                    del self.groups[was]
        if new is None:
            self.minds.pop(key, None)
            return
        now = routing.engine_key_of(new)
        self.dirty.add(now)
        self.minds[key] = new
        self.groups.setdefault(now, {})[key] = new

    def forget(self, key: str) -> None:
        """Drop a Mind the API no longer has (deleted while no watch was looking)."""
        with self.lock:
            known = self.minds.get(key)
            if known is not None:
                self._put(key, known, None)

    def mark(self, keys: Iterable[EngineKey]) -> None:
        """Mark engines to be stepped at the next pass (a write that failed, a pass cut short)."""
        with self.lock:
            self.dirty.update(keys)

    def mark_mind(self, key: str) -> None:
        """Mark the engine a Mind names (a write of hers failed: the next pass redoes it)."""
        with self.lock:
            known = self.minds.get(key)
            if known is not None:
                self.dirty.add(routing.engine_key_of(known))

    def take_dirty(self) -> set[EngineKey]:
        """The engines marked since the last call; the mark is cleared."""
        with self.lock:
            dirty, self.dirty = self.dirty, set()
        return dirty

    def minds_of(self, keys: Iterable[EngineKey]) -> dict[EngineKey, list[dict[str, Any]]]:
        """The Minds naming each of these engines (those with any)."""
        with self.lock:
            return {k: list(g.values()) for k in keys if (g := self.groups.get(k))}

    def engine_keys(self) -> set[EngineKey]:
        """Every engine some Mind names."""
        with self.lock:
            return set(self.groups)

    def observe_class(self, obj: Mapping[str, Any], deleted: bool) -> None:
        # (A class changes what every engine's minds demand: the loop compares the classes
        # it last stepped with and steps every engine when they differ.)
        name = str(obj["metadata"]["name"])
        if deleted:
            self.classes.pop(name, None)
        else:
            self.classes[name] = kept(obj)
        self.changed.set()

    def observe_quota(self, obj: Mapping[str, Any], deleted: bool, nudge: bool = True) -> None:
        key = routing.mind_key(obj)
        if deleted:
            self.quotas.pop(key, None)
        else:
            known = self.quotas.get(key)
            if known is None or resource_version(obj) >= resource_version(known):
                self.quotas[key] = kept(obj)
        if nudge:
            self.changed.set()


def _demand_facts(mind: Mapping[str, Any]) -> tuple[Any, ...]:
    """What the ledger reads of a Mind (`routing.route_minds`, `routing.demands_of`) and what
    her projection and finalizer follow from: her engine, her deletion, class and size."""
    meta = mind["metadata"]
    spec = mind.get("spec") or {}
    return (
        routing.engine_key_of(mind),
        bool(meta.get("deletionTimestamp")),
        spec.get("className"),
        spec.get("contextTokens"),
        meta.get("creationTimestamp"),
        meta.get("generation"),
    )


def resource_version(obj: Mapping[str, Any]) -> int:
    try:
        return int(obj["metadata"].get("resourceVersion", 0))
    except (TypeError, ValueError):
        return 0


def register(registry: kopf.OperatorRegistry, minds: MindCache) -> None:
    """Watch Minds, MindClasses and TokenQuotas into `minds`."""

    @kopf.on.event(group=GROUP, version=VERSION, plural="minds", registry=registry)
    async def mind(event: kopf.RawEvent, **_: Any) -> None:
        minds.observe_mind(cast(dict[str, Any], event["object"]), event.get("type") == "DELETED")

    @kopf.on.event(group=GROUP, version=VERSION, plural="mindclasses", registry=registry)
    async def mindclass(event: kopf.RawEvent, **_: Any) -> None:
        minds.observe_class(cast(dict[str, Any], event["object"]), event.get("type") == "DELETED")

    @kopf.on.event(group=GROUP, version=VERSION, plural="tokenquotas", registry=registry)
    async def tokenquota(event: kopf.RawEvent, **_: Any) -> None:
        minds.observe_quota(cast(dict[str, Any], event["object"]), event.get("type") == "DELETED")
