"""Each engine's whole ledger as this leader last decided it. The Engine object keeps the
holders and the head of a long queue (`grant_ledger.bounded`); the entries it leaves out are kept
here, for the next step and for the Minds' projections, and for a new leader (nothing kept yet) they
are read from the transition log or, with no log, from the Minds' own status. No API calls.
Neighbours: `kube.grants.loop` (the loop that steps), `kube.grants.ledger_write` (remembers each
write), `kube.ledger.grant_ledger` (the entries).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from continuum_operator.core.grants import Grant, MindDemand
from continuum_operator.kube.ledger import grant_ledger
from continuum_operator.kube.ledger.transition_log import TransitionLog
from continuum_operator.kube.state.cache import EngineKey
from continuum_operator.kube.state.mind_cache import MindCache
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.json_body import integer, object_at

__all__ = ["LedgerTails"]


@dataclass(frozen=True)
class _Tail:
    """An engine's ledger as this leader last decided it, for the step whose journal has `seq`:
    the grants its object leaves out, and every entry (the projections read them) where it
    leaves any out (None: the object holds them all, and they are read from it: typed entries
    kept for every engine were thousands more objects for each garbage collection to walk)."""

    seq: int
    grants: dict[str, Grant]
    entries: list[GrantEntry] | None


class LedgerTails:
    """What each engine's object leaves out of its ledger, by engine. `log`: the loop's
    transition log as it is now (a new leader opens it again)."""

    def __init__(self, log: Callable[[], TransitionLog], minds: MindCache) -> None:
        self._log = log
        self._minds = minds
        self._tails: dict[EngineKey, _Tail] = {}

    def entries_of(
        self,
        key: EngineKey,
        body: Mapping[str, object],
        stored: list[GrantEntry] | None = None,
    ) -> list[GrantEntry]:
        """The engine's whole ledger: as this leader last decided it for this body's step, else
        the entries its object holds."""
        status = object_at(body, "status")
        tail = self._tails.get(key)
        if tail is not None and tail.entries is not None and tail.seq == _seq(status):
            return tail.entries
        return stored if stored is not None else grant_ledger.read_entries(status.get("grants"))

    def tail_of(
        self,
        key: EngineKey,
        body: Mapping[str, object],
        demands: Mapping[str, MindDemand],
        entries: list[GrantEntry] | None = None,
    ) -> dict[str, Grant]:
        """The entries the Engine object left out (`status.grantQueue`): from this leader's
        memory of the step it last decided there; else as the transition log leaves them (its
        next lines then follow from the log's, whatever a crash left unwritten); else, with no
        log, from the Minds' own status. `entries`: the object's, where the caller read them."""
        status = object_at(body, "status")
        if entries is None:
            entries = grant_ledger.read_entries(status.get("grants"))
        stored = {e.mind for e in entries}
        tail = self._tails.get(key)
        if tail is not None and tail.seq == _seq(status):
            return {m: g for m, g in tail.grants.items() if m not in stored}
        waiting = self._log().waiting(f"{key[0]}/{key[1]}")
        if waiting is not None:
            return grant_ledger.tail_from_log(waiting, stored)
        if status.get(grant_ledger.QUEUE_FIELD) is None:
            return {}  # nothing was left out
        return grant_ledger.tail_from_minds(
            self._minds.minds_of([key]).get(key, []), stored, demands
        )

    def remember(
        self, key: EngineKey, body: Mapping[str, object], s: grant_ledger.LedgerStep
    ) -> None:
        """What `body`'s object leaves out of the ledger `s` decided, kept for the next step."""
        kept = {e.mind for e in s.kept}
        left_out = {m: g for m, g in s.grants.items() if m not in kept}
        entries = s.entries if left_out else None
        self._tails[key] = _Tail(_seq(object_at(body, "status")), left_out, entries)

    def forget(self, key: EngineKey) -> None:
        """The engine is gone: nothing of its ledger is kept."""
        self._tails.pop(key, None)


def _seq(status: Mapping[str, object]) -> int:
    """The journal's seq of the ledger an Engine's GrantLedger holds (0: never written)."""
    return integer(status, grant_ledger.STEP_FIELD, "seq") or 0
