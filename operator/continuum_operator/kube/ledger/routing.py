"""Which Engine each Mind goes to, with what demand, under which quota (docs/tenancy.md).

- `route_minds`: each Mind to her Engine (`spec.engineNamespace`, else her own), or refused
  with a reason: her class does not exist, or the Engine does not serve her namespace
  (`spec.allowedNamespaces`).
- `demands_of`: the minds that want grants, with their class's priority, window, limit and
  namespaces (the allocator refuses a mind her class does not allow: `ClassNotAllowed`).
- `quota_limits` / `tokens_held`: TokenQuotas by namespace (the tightest wins) and the tokens
  each namespace holds in the ledgers.

No API calls: plain objects in, plain facts out. Neighbours: `kube.ledger.grant_ledger` (steps the
ledger with these demands), `kube.grants.loop` (the loop).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from continuum_operator.core import rfc3339
from continuum_operator.core.grants import MindDemand
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.json_body import integer, object_at
from continuum_operator.model.mind import HOLDING_STATES

__all__ = [
    "ClassFacts",
    "QuotaLimit",
    "Refused",
    "RouteReason",
    "classes_of",
    "demands_of",
    "engine_key_of",
    "engine_serves",
    "mind_key",
    "quota_limits",
    "route_minds",
    "tokens_held",
]


class RouteReason(StrEnum):
    """Why a Mind is not put to her Engine's allocator at all (docs/tenancy.md)."""

    ENGINE_NOT_ALLOWED = "EngineNotAllowed"
    CLASS_NOT_FOUND = "ClassNotFound"
    ENGINE_NOT_FOUND = "EngineNotFound"


@dataclass(frozen=True, slots=True)
class ClassFacts:
    priority: int = 0
    protection_window: float = 300.0
    max_tokens: int | None = None
    # spec.allowedNamespaces; None: every namespace (an empty list allows none).
    allowed_namespaces: frozenset[str] | None = None


def _namespaces(value: object) -> frozenset[str] | None:
    if not isinstance(value, list):
        return None
    return frozenset(str(n) for n in value)


def classes_of(mindclasses: Iterable[Mapping[str, object]]) -> tuple[dict[str, ClassFacts], str]:
    """MindClasses by name, and the name of the default class ('' when none is marked)."""
    out: dict[str, ClassFacts] = {}
    default = ""
    for mc in sorted(mindclasses, key=lambda m: str(object_at(m, "metadata")["name"])):
        spec = object_at(mc, "spec")
        name = str(object_at(mc, "metadata")["name"])
        max_tokens = spec.get("maxTokens")
        window = spec.get("protectionWindowSeconds", 300)
        out[name] = ClassFacts(
            integer(spec, "priority") or 0,
            float(window) if isinstance(window, int | float) else 300.0,
            int(max_tokens) if isinstance(max_tokens, int) and max_tokens > 0 else None,
            _namespaces(spec.get("allowedNamespaces")),
        )
        if spec.get("default") and not default:
            default = name
    return out, default


def mind_key(mind: Mapping[str, object]) -> str:
    """ "namespace/name" of a namespaced object (a Mind, a TokenQuota)."""
    meta = object_at(mind, "metadata")
    return f"{meta['namespace']}/{meta['name']}"


def engine_key_of(mind: Mapping[str, object]) -> tuple[str, str]:
    """(namespace, name) of the Engine a Mind names: `spec.engineNamespace`, else her own."""
    spec = object_at(mind, "spec")
    ns = spec.get("engineNamespace") or object_at(mind, "metadata")["namespace"]
    return str(ns), str(spec.get("engine"))


def engine_serves(engine: Mapping[str, object], namespace: str) -> bool:
    """Whether an Engine serves Minds of `namespace`: its own always, others it lists in
    `spec.allowedNamespaces` ('*': every namespace)."""
    if object_at(engine, "metadata").get("namespace") == namespace:
        return True
    allowed = object_at(engine, "spec").get("allowedNamespaces")
    return isinstance(allowed, list) and ("*" in allowed or namespace in allowed)


@dataclass(frozen=True, slots=True)
class Refused:
    """A Mind kept out of her Engine's allocator, and what to tell her."""

    reason: RouteReason
    message: str


def route_minds(
    minds: Iterable[Mapping[str, object]],
    engines: Mapping[tuple[str, str], Mapping[str, object]],
    classes: Mapping[str, ClassFacts],
    default_class: str,
) -> tuple[dict[tuple[str, str], list[Mapping[str, object]]], dict[str, Refused]]:
    """Minds by the Engine they name, and those of them refused before the allocator.

    A Mind naming a class that does not exist, or an Engine that does not serve her namespace,
    is listed under her Engine (her finalizer and projection are written from there) but wants
    no grant. A Mind of an Engine nobody serves is listed and not refused: nothing holds her.
    """
    by_engine: dict[tuple[str, str], list[Mapping[str, object]]] = {}
    refused: dict[str, Refused] = {}
    for body in minds:
        key = engine_key_of(body)
        by_engine.setdefault(key, []).append(dict(body))
        ns = str(object_at(body, "metadata")["namespace"])
        named = object_at(body, "spec").get("className")
        engine = engines.get(key)
        if named and named not in classes:
            refused[mind_key(body)] = Refused(
                RouteReason.CLASS_NOT_FOUND,
                f"MindClass {named} does not exist; create it or name an existing class in "
                "spec.className (kubectl get mindclasses)",
            )
        elif engine is not None and not engine_serves(engine, ns):
            refused[mind_key(body)] = Refused(
                RouteReason.ENGINE_NOT_ALLOWED,
                f"Engine {key[0]}/{key[1]} does not serve namespace {ns}; add {ns} to the "
                "Engine's spec.allowedNamespaces, or name an Engine of your own namespace",
            )
    return by_engine, refused


def demands_of(
    minds: Iterable[Mapping[str, object]],
    classes: Mapping[str, ClassFacts],
    default_class: str,
    refused: Collection[str] = (),
) -> dict[str, MindDemand]:
    """Minds that want a grant (not being deleted, not refused), with their class; place in
    line by creation."""
    out: dict[str, MindDemand] = {}
    for m in minds:
        meta = object_at(m, "metadata")
        if meta.get("deletionTimestamp"):
            continue
        name = mind_key(m)
        if name in refused:
            continue
        spec = object_at(m, "spec")
        cls = classes.get(str(spec.get("className") or default_class)) or ClassFacts()
        out[name] = MindDemand(
            name=name,
            priority=cls.priority,
            arrival=rfc3339.parse(meta.get("creationTimestamp")) or 0.0,
            context_tokens=integer(spec, "contextTokens") or 1,
            protection_window=cls.protection_window,
            max_tokens=cls.max_tokens,
            class_namespaces=cls.allowed_namespaces,
        )
    return out


# --- token quotas -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class QuotaLimit:
    """The tightest TokenQuota of a namespace: the limit, and the quota that sets it."""

    max_tokens: int
    quota: str  # "namespace/name"


def quota_limits(quotas: Iterable[Mapping[str, object]]) -> dict[str, QuotaLimit]:
    """Namespaces' token limits: of several TokenQuotas in a namespace, the smallest applies."""
    out: dict[str, QuotaLimit] = {}
    for q in sorted(quotas, key=mind_key):
        value = object_at(q, "spec").get("maxTokens")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            continue
        ns = str(object_at(q, "metadata")["namespace"])
        if ns not in out or value < out[ns].max_tokens:
            out[ns] = QuotaLimit(value, mind_key(q))
    return out


def tokens_held(entries: Iterable[GrantEntry]) -> dict[str, int]:
    """Tokens each namespace holds in one ledger (`status.grants`): Granted and Reclaiming."""
    out: dict[str, int] = {}
    for e in entries:
        if e.state not in HOLDING_STATES:
            continue
        ns = e.mind.partition("/")[0]
        out[ns] = out.get(ns, 0) + e.tokens
    return out
