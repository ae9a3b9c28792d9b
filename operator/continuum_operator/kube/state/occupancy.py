"""What holds a node's memory, as the operator's snapshot says: every engine's and EmbedLane's
leases, and whether a node's board is vouched for now. Read by the plan loop
(`kube.engines.reconcile`), the lanes' loop (`kube.lanes.loop`) and the pool gauges
(`kube.engines.pool_metrics`); it imports none of them, so neither loop reaches the other through
it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pydantic import ValidationError

from continuum_operator.core.placements import consumer_name, lane_placement_leases
from continuum_operator.core.pools import ConsumerKind, Lease
from continuum_operator.kube.state.cache import EngineKey, Snapshot, placed_leases
from continuum_operator.kube.state.lease_renewal import LeaseEntry
from continuum_operator.model.embedlane import EmbedLanePlacement
from continuum_operator.model.json_body import at

__all__ = [
    "LaneKey",
    "is_fresh",
    "lane_leases_in",
    "lease_is_fresh",
    "other_leases",
    "other_leases_and_assumed",
]

LaneKey = tuple[str, str]  # (namespace, name)


def is_fresh(snap: Snapshot, node: str, now: float, default_ttl: float) -> bool:
    return lease_is_fresh(snap.leases.get(node), now, default_ttl)


def lease_is_fresh(lease: LeaseEntry | None, now: float, default_ttl: float) -> bool:
    """Whether an agent Lease vouches for its board now (its own duration, else the default),
    counted from when this process saw it renewed (`lease_renewal.renewal_counted_from`), never from
    the agent's clock."""
    if lease is None:
        return False
    since = lease.counted_from if lease.counted_from is not None else lease.renew_time
    if since is None:
        return False
    ttl = lease.duration_seconds if lease.duration_seconds is not None else default_ttl
    return now - since <= ttl


def other_leases(
    snap: Snapshot, me: EngineKey, *, assumed_only: bool = False, node: str | None = None
) -> list[Lease]:
    """Leases of the other engines' placements and of every EmbedLane's (with `assumed_only`,
    only those whose pods or lane runtimes have not started yet); with `node`, only there.

    From the snapshot's index when it has one: each engine decided reads the leases of the
    engines on its own node, not a parse of every engine's placement (quadratic in engines).
    """
    leases: list[Lease] = []
    index, on = snap.engine_leases, snap.engines_on
    keys: Iterable[EngineKey]
    if index is None or on is None:  # no index: every engine's placement, parsed here
        index = {k: x for k, b in snap.engines.items() if (x := placed_leases(k, b)) is not None}
        keys = index.keys()
    else:
        keys = index.keys() if node is None else on.get(node, ())
    for key in keys:
        placed = index.get(key)
        if key == me or placed is None or (assumed_only and not placed.assumed):
            continue
        leases.extend(x for x in placed.leases if node is None or x.node == node)
    # EmbedLanes' bytes, charged where they reside (those not yet measured count as assumed).
    lanes = lane_leases_in(snap.lanes, assumed_only=assumed_only)
    leases.extend(x for x in lanes if node is None or x.node == node)
    return leases


def other_leases_and_assumed(snap: Snapshot, me: EngineKey) -> tuple[list[Lease], list[Lease]]:
    """`other_leases(snap, me)` and `other_leases(snap, me, assumed_only=True)`, in one walk
    over every engine's placement (a placement read both; each walk is over every engine)."""
    every: list[Lease] = []
    assumed: list[Lease] = []
    index = snap.engine_leases
    if index is None or snap.engines_on is None:  # as `other_leases` reads it
        index = {k: x for k, b in snap.engines.items() if (x := placed_leases(k, b)) is not None}
    for key, placed in index.items():
        if key == me or placed is None:
            continue
        every.extend(placed.leases)
        if placed.assumed:
            assumed.extend(placed.leases)
    every.extend(lane_leases_in(snap.lanes))
    assumed.extend(lane_leases_in(snap.lanes, assumed_only=True))
    return every, assumed


def lane_leases_in(
    lanes: Mapping[LaneKey, Mapping[str, object]],
    *,
    excluding: LaneKey | None = None,
    assumed_only: bool = False,
) -> list[Lease]:
    """The leases every lane's `status.placement` holds (a bad one is skipped, not guessed).

    `assumed_only`: only lanes whose runtime is not serving yet, whose bytes no board has
    measured (`core.bestfit.with_unmeasured` adds them to the measured usage).
    """
    leases: list[Lease] = []
    for key, body in lanes.items():
        if key == excluding:
            continue
        if assumed_only and at(body, "status", "runtime", "ready") is True:
            continue
        raw = at(body, "status", "placement")
        if not raw:
            continue
        try:
            placement = EmbedLanePlacement.model_validate(raw)
        except ValidationError:
            continue
        who = consumer_name(ConsumerKind.EMBED_LANE, key[0], key[1])
        leases.extend(lane_placement_leases(who, placement))
    return leases
