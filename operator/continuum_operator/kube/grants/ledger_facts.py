"""What a grants pass reads of every engine's ledger, not only of those it steps: the earliest
grace deadline (the engine is stepped then) and the entries (the tokens each namespace holds
under a TokenQuota are summed from them). Kept per Engine body and read again only once the body
is another object (bodies are replaced, never changed in place). No API calls. Neighbours:
`kube.grants.loop` (the pass), `kube.grants.quota_use` (the tokens held).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from continuum_operator.kube.ledger.grant_ledger import read_entries
from continuum_operator.kube.state.cache import EngineKey
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.json_body import object_at
from continuum_operator.model.mind import GrantState

__all__ = ["LedgerFacts", "grace_deadline"]


@dataclass(frozen=True)
class LedgerFacts:
    """What a pass reads of one engine's ledger, kept while the body is the same object."""

    body: Mapping[str, object]
    due: float | None  # the earliest grace deadline of its ledger
    entries: list[GrantEntry]

    @classmethod
    def of(cls, body: Mapping[str, object]) -> LedgerFacts:
        entries = read_entries(object_at(body, "status").get("grants"))
        return cls(body, grace_deadline(entries), entries)

    @staticmethod
    def of_each(
        old: Mapping[EngineKey, LedgerFacts], engines: Mapping[EngineKey, Mapping[str, object]]
    ) -> dict[EngineKey, LedgerFacts]:
        """Every engine's facts: those of `old` whose body is the same object, the rest read."""
        return {
            k: f if (f := old.get(k)) is not None and f.body is b else LedgerFacts.of(b)
            for k, b in engines.items()
        }


def grace_deadline(entries: Iterable[GrantEntry]) -> float | None:
    """The earliest grace deadline of a ledger's entries."""
    deadlines = [
        e.deadline for e in entries if e.state == GrantState.RECLAIMING and e.deadline is not None
    ]
    return min(deadlines) if deadlines else None
