"""What one pass of the grants loop (`kube.grants.loop`) reads once and decides per engine, and the
small helpers of its passes: the journals a dead leader did not log, appended before a pass
appends anything; the engine a failed Mind write takes again. No API calls. Neighbours:
`kube.grants.loop` (the loop), `kube.grants.quota_use` (the tokens held), `kube.ledger.journal`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from continuum_operator.kube.grants.ledger_facts import LedgerFacts
from continuum_operator.kube.grants.quota_use import QuotaUse
from continuum_operator.kube.ledger import grant_ledger, journal, routing
from continuum_operator.kube.ledger.transition_log import TransitionLog
from continuum_operator.kube.state.cache import EngineKey
from continuum_operator.kube.state.mind_cache import MindCache
from continuum_operator.model.json_body import object_at

__all__ = ["GrantWrites", "PassView", "engine_of_write", "recover_journals"]


@dataclass
class PassView:
    """What a pass reads once, at its start: the rules, every ledger's facts, the tokens held
    under each quota (kept up to date as the pass decides), the time the engines not due are
    stepped at, and how many due engines' writes are still to land."""

    classes: Mapping[str, routing.ClassFacts]
    default: str
    limits: Mapping[str, routing.QuotaLimit]
    facts: Mapping[EngineKey, LedgerFacts]
    quotas: QuotaUse
    at: float
    due_left: int = 0
    due_done: asyncio.Event = field(default_factory=asyncio.Event)
    due_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # due writes, in order
    rest_started: bool = False  # an engine not due was decided: no more are stepped as due


@dataclass(frozen=True)
class GrantWrites:
    """One engine's decision: the ledger step to write (None: it did not change), and the Minds
    whose projections and finalizers follow from it. `body` None: the Engine is gone."""

    body: Mapping[str, object] | None
    step: grant_ledger.LedgerStep | None
    now: float
    due: bool
    minds: Sequence[Mapping[str, object]]
    refused: Mapping[str, routing.Refused]


def recover_journals(
    log: TransitionLog, keys: Iterable[EngineKey], engines: Mapping[EngineKey, Mapping[str, object]]
) -> None:
    """Append the steps a dead leader wrote but did not log (each engine's journal). A journal
    is read (every line's times parsed) only where the log lacks its step."""
    for key in keys:
        engine = f"{key[0]}/{key[1]}"
        stored_journal = object_at(engines[key], "status").get(grant_ledger.STEP_FIELD)
        if not log.nothing_to_recover(engine, stored_journal):
            log.recover(engine, journal.read_journal(stored_journal))


def engine_of_write(key: str, minds: MindCache) -> EngineKey | None:
    """The engine whose pass queued a Mind write of this key (None: a TokenQuota's status)."""
    if key.startswith("engine:"):
        ns, _, name = key.removeprefix("engine:").partition("/")
        return (ns, name)
    if key.startswith("tokenquota:"):
        return None
    return minds.engine_of(key)
