"""An agent's Lease of a node as the operator counts it: its last renewal counted on this
process's clock from when it was seen, never from the agent's `renewTime` against ours (as
client-go's leader election counts from `observedTime`), and whether a renewal came in time.
No API calls. Neighbours: `kube.state.cache` (records each Lease seen), `kube.state.occupancy`
(whether a board is vouched for now).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LeaseEntry", "renewal_counted_from", "renewed_in_time"]


@dataclass(frozen=True, slots=True)
class LeaseEntry:
    renew_time: float | None  # the agent's wall clock: compared only with its own earlier ones
    duration_seconds: float | None
    resource_version: str
    # When this process counts the last renewal from, on its own clock (`renewal_counted_from`);
    # None in an entry built by hand, which counts from `renew_time`.
    counted_from: float | None = None


def renewal_counted_from(
    known: LeaseEntry | None, renew_time: float | None, now: float
) -> float | None:
    """When this process counts a Lease's last renewal from, as client-go's leader election
    counts from `observedTime`: a renewal is counted from when it is seen, so an agent whose
    clock runs ahead of ours cannot keep a board fresh past its duration. `renewTime` is only
    compared with the same agent's earlier `renewTime`, both on its own clock. A Lease seen for
    the first time (or moved back) counts from its own `renewTime` if that is earlier than now:
    of its age only what its clock shows and no more than it could be, so a board an agent
    abandoned long ago is not believed on the operator's start; a clock behind ours makes the
    board stale early only until the agent's next renewal.
    """
    if renew_time is None:
        return None
    if known is not None and known.renew_time is not None and known.counted_from is not None:
        if renew_time > known.renew_time:
            return now  # renewed since we last saw it: counted from now
        if renew_time == known.renew_time:
            return known.counted_from  # the same renewal (a label, a resync)
    return min(now, renew_time)


def renewed_in_time(known: LeaseEntry, new: LeaseEntry, now: float) -> bool:
    """The Lease was renewed (its own clock moved on) and seen before it expired on ours, for as
    long as before: fresh all along."""
    if known.renew_time is None or new.renew_time is None or known.duration_seconds is None:
        return False
    if known.counted_from is None:
        return False
    return (
        new.duration_seconds == known.duration_seconds
        and known.renew_time <= new.renew_time
        and now <= known.counted_from + known.duration_seconds
    )
