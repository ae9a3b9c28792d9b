"""Tokens each namespace under a TokenQuota holds, over every engine's ledger, as a grants pass
steps engines, and the TokenQuota's status from it (docs/tenancy.md). Neighbours: `kube.grants.loop`
(the loop that keeps it up to date), `kube.ledger.grant_ledger` (the limits)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from continuum_operator.core.grants import GrantReason, MindDemand
from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.client.body import bodies
from continuum_operator.kube.ledger import routing
from continuum_operator.kube.state.cache import EngineKey
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.json_body import object_at
from continuum_operator.model.mind import HOLDING_STATES

__all__ = ["ClassNotes", "QuotaConditionType", "QuotaUse", "quota_status"]


class QuotaUse:
    """Tokens each namespace under a TokenQuota holds, over every engine's ledger, kept up to
    date as the pass decides engines: a decision is assumed at once (`assume`: the next
    decision of the pass sees it, though its write is still in flight), and what its write
    landed replaces it (`stepped`). Touched only from the event loop: no lock."""

    def __init__(
        self,
        limits: Mapping[str, routing.QuotaLimit],
        entries: Mapping[EngineKey, list[GrantEntry]],
        *,
        quotas: bool = True,
    ) -> None:
        """`quotas`: whether any TokenQuota exists (one whose limit is unreadable too: its
        status still counts its namespace's minds, `minds`)."""
        self.limits = dict(limits)
        # The entries are kept only where a TokenQuota reads them (`held_back`, `minds`):
        # every engine's typed entries held through a pass were tens of thousands of objects
        # for the garbage collector to promote and walk, for nothing without one.
        self.keeps_entries = quotas or bool(self.limits)
        self.entries = dict(entries) if self.keeps_entries else {}
        # Summed only where a quota reads them (without quotas, nothing does).
        self.by_engine = (
            {k: routing.tokens_held(e) for k, e in entries.items() if e} if self.limits else {}
        )
        self.totals: dict[str, int] = {}
        for held in self.by_engine.values():
            for ns, n in held.items():
                self.totals[ns] = self.totals.get(ns, 0) + n
        self.freed: set[str] = set()  # namespaces a landed write left holding less than assumed

    def binds(self, demands: Mapping[str, MindDemand]) -> bool:
        return any(d.namespace in self.limits for d in demands.values())

    def used(self, namespace: str) -> int:
        return self.totals.get(namespace, 0)

    def left(self, key: EngineKey) -> dict[str, int] | None:
        """What each quota'd namespace may hold on this engine: its limit less what it holds on
        the others (possibly below zero: a quota lowered under use reclaims nothing)."""
        if not self.limits:
            return None
        mine = self.by_engine.get(key, {})
        return {
            ns: lim.max_tokens - (self.totals.get(ns, 0) - mine.get(ns, 0))
            for ns, lim in self.limits.items()
        }

    def assume(self, key: EngineKey, entries: list[GrantEntry]) -> None:
        """A step decided and not yet written: until its write lands, the engine holds, in each
        namespace, the more of what it held and what the step holds. A grant counts at once; a
        release only once written (should the write fail, nobody granted on tokens that were
        never given back)."""
        held = routing.tokens_held(entries) if self.limits else {}
        before = self.by_engine.get(key, {})
        self._put(key, {ns: max(n, before.get(ns, 0)) for ns, n in {**before, **held}.items()})
        if self.keeps_entries:
            self.entries[key] = entries

    def stepped(self, key: EngineKey, entries: list[GrantEntry]) -> None:
        """The engine's whole ledger as written (not only what its object keeps)."""
        held = routing.tokens_held(entries) if self.limits else {}
        before = self.by_engine.get(key, {})
        self.freed.update(ns for ns, n in before.items() if held.get(ns, 0) < n)
        self._put(key, held)
        if self.keeps_entries:
            self.entries[key] = entries

    def _put(self, key: EngineKey, held: dict[str, int]) -> None:
        for ns, n in self.by_engine.get(key, {}).items():
            self.totals[ns] -= n
        for ns, n in held.items():
            self.totals[ns] = self.totals.get(ns, 0) + n
        self.by_engine[key] = held

    def held_back(self, namespaces: set[str]) -> set[EngineKey]:
        """The engines with a mind of these namespaces queued by their quota."""
        return {
            key
            for key, entries in self.entries.items()
            for e in entries
            if e.reason is GrantReason.QUOTA_EXCEEDED and e.mind.partition("/")[0] in namespaces
        }

    def minds(self, namespace: str) -> tuple[int, list[str]]:
        """Minds of the namespace holding a grant, and those the quota holds back (by name)."""
        held, queued = 0, []
        for entries in self.entries.values():
            for e in entries:
                ns, _, name = e.mind.partition("/")
                if ns != namespace:
                    continue
                if e.state in HOLDING_STATES:
                    held += 1
                elif e.reason is GrantReason.QUOTA_EXCEEDED:
                    queued.append(name)
        return held, sorted(queued)


@dataclass(frozen=True)
class ClassNotes:
    """What a Mind's message says of her class's limit and her namespace's quota."""

    classes: Mapping[str, routing.ClassFacts]
    default: str
    quotas: QuotaUse

    def class_note(self, mind: Mapping[str, object]) -> str:
        name = str(object_at(mind, "spec").get("className") or self.default)
        facts = self.classes.get(name)
        if facts is None or facts.max_tokens is None:
            return "her class allows fewer"
        return f"MindClass {name} allows at most {facts.max_tokens}"

    def namespace_note(self, mind: Mapping[str, object]) -> str:
        """Her class and the namespaces it allows (for `ClassNotAllowed`)."""
        name = str(object_at(mind, "spec").get("className") or self.default)
        facts = self.classes.get(name)
        allowed = sorted(facts.allowed_namespaces or ()) if facts is not None else []
        namespace = object_at(mind, "metadata").get("namespace")
        return (
            f"MindClass {name} may not be used by Minds of namespace "
            f"{namespace}; it allows namespaces: {', '.join(allowed) or 'none'}"
        )

    def quota_note(self, namespace: str) -> str:
        limit = self.quotas.limits.get(namespace)
        if limit is None:
            return f"namespace {namespace} is at its token quota"
        return (
            f"TokenQuota {limit.quota} allows namespace {namespace} {limit.max_tokens} tokens "
            f"and its minds hold {self.quotas.used(namespace)}"
        )


class QuotaConditionType(StrEnum):
    LIMITING = "Limiting"


def quota_status(
    quota: Mapping[str, object], use: QuotaUse, now: float
) -> dict[str, object] | None:
    """A TokenQuota's new status, or None when hers already says it. Every TokenQuota of a
    namespace reports the namespace's use; the one that limits is the tightest."""
    meta = object_at(quota, "metadata")
    ns = str(meta["namespace"])
    held, queued = use.minds(ns)
    used = use.used(ns)
    limit = use.limits.get(ns)
    tightest = limit is not None and limit.quota == routing.mind_key(quota)
    limiting = bool(queued) and tightest
    if limiting and limit is not None:
        reason = "MindsQueued"
        message = f"{len(queued)} mind(s) held back: {used} of {limit.max_tokens} tokens held"
    elif not tightest and limit is not None:
        reason, message = "Looser", f"TokenQuota {limit.quota} is tighter and applies"
    else:
        reason, message = "WithinQuota", f"{used} tokens held"
    old = object_at(quota, "status")
    prev = {c.get("type"): c for c in bodies(old.get("conditions"))}.get(
        QuotaConditionType.LIMITING
    )
    status = "True" if limiting else "False"
    generation = meta.get("generation")
    condition: dict[str, object] = {
        "type": QuotaConditionType.LIMITING.value,
        "status": status,
        "reason": reason,
        "message": message,
        # Kept while the status holds; a condition that lacks one (written by hand, or before
        # the time was kept) gets now rather than a null.
        "lastTransitionTime": (
            (prev or {}).get("lastTransitionTime") if (prev or {}).get("status") == status else None
        )
        or format_seconds(now),
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    new: dict[str, object] = {
        "usedTokens": used,
        "mindsHeld": held,
        "mindsQueued": len(queued),
        "queued": queued[:64],
        "conditions": [condition],
    }
    if generation is not None:
        new["observedGeneration"] = generation
    if {k: old.get(k) for k in new} == new:
        return None
    return new
