"""Grant policies that break rule 7 on purpose, each in one way, so the simulator can show that
`continuum check-log` flags what each breaks (docs/simulate.md, `policy:` in a scenario file).
The operator never uses them: it allocates with `grants.PriorityPolicy`.

- `UnprotectedPolicy`: preempts grants within their protection windows (the checker's
  invariant 5, no-thrash).
- `ReclaimsUncounted`: preemptors ignore the slots already being reclaimed, so slots are
  reclaimed that nobody is waiting for (invariant 7, no-needless-reclaim).
- `NoGraceDeadline`: a reclaim has no deadline; only the gateway's release ends it (invariant
  3, reclaim-within-grace, once a release is late).

The last two wrap any policy; `weakened` combines them as a scenario's switches ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from continuum_operator.core.grants import (
    Grant,
    GrantPolicy,
    MindDemand,
    PriorityPolicy,
)


@dataclass(frozen=True, slots=True)
class UnprotectedPolicy(PriorityPolicy):
    """The priority policy with no protection window: any grant of lower priority is a victim
    (so no window's end is ever a time to allocate again: `preemptible_at` is None)."""

    def protected_until(self, g: Grant, m: MindDemand, now: float) -> float | None:
        return None


@dataclass(frozen=True, slots=True)
class _Wrapped:
    """`inner`'s decisions, each override aside.

    Whatever a subclass does not define is looked up on `inner` (`__getattr__` is asked only
    for what the wrapper lacks), so every decision of the `GrantPolicy` protocol, and any it
    gains, is `inner`'s with its own signature, not a copy of it kept in step by hand."""

    inner: GrantPolicy

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass(frozen=True, slots=True)
class ReclaimsUncounted(_Wrapped):
    """`inner`, but every queued mind without a free slot may preempt, however many slots are
    already being reclaimed."""

    def served_by_reclaims(self, reclaiming: int) -> int:
        return 0


@dataclass(frozen=True, slots=True)
class NoGraceDeadline(_Wrapped):
    """`inner`, but a reclaim waits for the gateway's release however long it takes."""

    def reclaim_deadline(self, now: float) -> float | None:
        return None


def weakened(
    grace_seconds: float,
    *,
    protection: bool = True,
    count_reclaiming: bool = True,
    grace_deadline: bool = True,
) -> GrantPolicy:
    """The priority policy with the safeguards passed False taken away (all True: the
    operator's own)."""
    policy: GrantPolicy = (
        PriorityPolicy(grace_seconds) if protection else UnprotectedPolicy(grace_seconds)
    )
    if not count_reclaiming:
        policy = ReclaimsUncounted(policy)
    if not grace_deadline:
        policy = NoGraceDeadline(policy)
    return policy
