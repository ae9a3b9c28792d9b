"""Crash points: the operator exits at once, as SIGKILL would, at a named point between writes.

For the tests that show a crash anywhere loses or doubles no grant (docs/design.md rule 9). With
`CONTINUUM_CRASH_AT=<point>` (or `<point>@<n>`: at its n-th passage) the process calls
`os._exit` when it reaches that point: no cleanup, no flush of anything not yet written, no
Lease released. The points are listed in docs/crash-points.md; `CrashPoint` is their one list.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from enum import StrEnum

__all__ = ["CRASH_ENV", "EXIT_CODE", "CrashPoint", "reached"]

CRASH_ENV = "CONTINUUM_CRASH_AT"
#: The exit status of a crash point: 128 + SIGKILL, what a killed process reports.
EXIT_CODE = 137


class CrashPoint(StrEnum):
    LEADER_ACQUIRED = "leader-acquired"
    """The Lease was won; nothing written yet as leader."""
    BEFORE_LEDGER_WRITE = "before-ledger-write"
    """An allocation step was decided; the GrantLedger's status.grants not yet replaced."""
    AFTER_LEDGER_WRITE = "after-ledger-write"
    """status.grants (and the step's journal) written; the transition log not yet appended."""
    AFTER_LOG = "after-log"
    """The step's lines appended to the transition log; no Mind's projection written yet."""
    MID_PROJECTIONS = "mid-projections"
    """One Mind's status.grant written, the others of the step not yet."""
    BEFORE_FINALIZER_REMOVAL = "before-finalizer-removal"
    """A deleted Mind is out of the ledger; her finalizer not yet removed."""


_passages: Counter[str] = Counter()


def _target() -> tuple[str, int] | None:
    raw = os.environ.get(CRASH_ENV, "")
    if not raw:
        return None
    name, _, nth = raw.partition("@")
    return name, int(nth) if nth.isdigit() and int(nth) > 0 else 1


def reached(point: CrashPoint) -> None:
    """Exit at once if this is the point (and the passage) `CONTINUUM_CRASH_AT` names."""
    target = _target()
    if target is None or target[0] != point.value:
        return
    _passages[point.value] += 1
    if _passages[point.value] >= target[1]:
        sys.stderr.write(f"continuum: crash point {point.value} reached: exiting at once\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)
