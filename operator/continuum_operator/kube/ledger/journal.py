"""The journal of an Engine's last ledger step (`status.grantStep`), written in the same replace
as the ledger: its transition log lines, so that a leader that died between the ledger write and
the log append has its step logged by the next one (docs/transition-log.md). No API calls.
Neighbours: `kube.ledger.grant_ledger` (the step and its lines), `kube.grants.ledger_write` (writes
the journal), `kube.ledger.transition_log` (appends it).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from continuum_operator.core import rfc3339
from continuum_operator.core.grants import GrantReason
from continuum_operator.model.mind import HOLDING_STATES

__all__ = ["DEPARTED_KEPT", "journal", "read_journal", "rfc3339_exact", "unix_of"]

#: Departures (MindDeleted) of minds beyond the object's head journaled in one step, at most.
DEPARTED_KEPT = 256

# The ledger's times: microseconds in the entries (`model.grant.iso_micro`), exact (read back as
# the same float) in the journaled step, so that a step is logged with the times it was decided at.
rfc3339_exact = rfc3339.format_exact
unix_of = rfc3339.parse_exact


# Times in a journaled step's lines: RFC 3339 in the GrantLedger, Unix seconds in the log.
_JOURNAL_TIMES = ("t", "deadline")


def journal(
    seq: int, t: float, lines: Iterable[Mapping[str, object]], kept: Collection[str] | None = None
) -> dict[str, object]:
    """`status.grantStep`: a step's seq, time and log lines, times as RFC 3339 for a reader of
    the Engine (the log keeps Unix seconds; `read_journal` turns them back exactly).

    With `kept` (the minds the object keeps entries of), the lines of the others (queued or
    refused beyond the object's head, whose entries are not in it either) are counted
    (`omitted`), not kept: a leader that appends this step after a crash appends what the
    object holds, and the minds beyond are decided again from what the log holds (docs/grants.md,
    "Bounded"). A mind who held a slot in the step (a holder released, deleted or preempted) is
    journaled whether the object keeps her or not: she leaves the object as she leaves her
    slot, and nothing else would tell the log (at most one such mind a slot); so is a deleted
    mind's departure (the first `DEPARTED_KEPT`), which nothing would decide again."""

    def text(line: Mapping[str, object]) -> dict[str, object]:
        return {
            k: rfc3339_exact(v) if k in _JOURNAL_TIMES and isinstance(v, int | float) else v
            for k, v in line.items()
        }

    every = list(lines)
    shown = every
    if kept is not None:
        journaled = set(kept) | {
            x.get("mind")
            for x in every
            if x.get("from") in HOLDING_STATES or x.get("to") in HOLDING_STATES
        }
        # A deleted mind leaves the object in the step that logs it, queued or not, and a step
        # whose only lines were departures would leave no line of its seq after a crash (a gap
        # the log's checker refuses): the first DEPARTED_KEPT of them are journaled too.
        departed = [
            x.get("mind")
            for x in every
            if x.get("event") == "transition"
            and x.get("reason") == GrantReason.MIND_DELETED
            and x.get("mind") not in journaled
        ]
        journaled.update(departed[:DEPARTED_KEPT])
        shown = [x for x in every if x.get("event") != "transition" or x.get("mind") in journaled]
        if not shown and every:
            # A step of lines beyond the head only (arrivals, a queue reordered) still leaves
            # its seq in the log after a crash: one line of it is journaled. Any part of the
            # omitted lines may be: the next leader decides every mind the log is behind on
            # from the log as it stands.
            shown = every[:1]
    doc: dict[str, object] = {"seq": seq, "t": rfc3339_exact(t), "lines": [text(x) for x in shown]}
    if len(shown) < len(every):
        doc["omitted"] = len(every) - len(shown)
    return doc


def read_journal(doc: object) -> dict[str, object] | None:
    """The journaled step with the log's Unix seconds again, or None when it cannot be read."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("lines"), list):
        return None
    lines = []
    for x in doc["lines"]:
        if not isinstance(x, Mapping) or unix_of(x.get("t")) is None:
            return None
        lines.append({k: unix_of(v) if k in _JOURNAL_TIMES and v is not None else v
                      for k, v in x.items()})  # fmt: skip
    return {**doc, "t": unix_of(doc.get("t")), "lines": lines}
