"""The node's ledger derived from consumers' placements, never stored as a second copy.

Each Engine's `status.placement` (written by the operator as an assumed lease before its pod
exists) is the only record of the bytes it holds; the leases of a node are read off them. An
EmbedLane's `status.placement` is read the same way: one lease per pool it is charged in, with
the pool's floor (`core.embed`), so an engine planned on that node sees the lane's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

from continuum_operator.core.plan import ServingPlan
from continuum_operator.core.pools import ConsumerKind, Lease
from continuum_operator.model.base import ObjectMeta
from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
from continuum_operator.model.engine import Engine, EnginePlacement, EnginePoolBytes

_P = TypeVar("_P", EnginePlacement, EmbedLanePlacement)


def consumer_name(kind: ConsumerKind, namespace: str | None, name: str) -> str:
    return f"{kind}/{namespace}/{name}" if namespace else f"{kind}/{name}"


def _leases_of(
    kind: ConsumerKind,
    placed: Iterable[tuple[ObjectMeta, _P | None]],
    leases_of: Callable[[str, _P], list[Lease]],
) -> list[Lease]:
    """The leases of every consumer of `kind` that has a placement, named as the ledger names
    them (`consumer_name`); `placed`: each one's metadata and placement."""
    leases: list[Lease] = []
    for meta, placement in placed:
        if placement is not None:
            leases.extend(leases_of(consumer_name(kind, meta.namespace, meta.name), placement))
    return leases


def _engine_placement_leases(consumer: str, placement: EnginePlacement) -> list[Lease]:
    """The leases of one engine's placement: its bytes per pool."""
    return [
        Lease(consumer, ConsumerKind.ENGINE, placement.node, part.pool, part.bytes)
        for part in placement.pools
    ]


def engine_leases(engines: Iterable[Engine]) -> list[Lease]:
    return _leases_of(
        ConsumerKind.ENGINE,
        ((e.metadata, e.status.placement) for e in engines),
        _engine_placement_leases,
    )


def placement_of(plan: ServingPlan) -> EnginePlacement:
    """The assumed lease a plan makes: what the operator writes before creating the pod."""
    return EnginePlacement(
        node=plan.node,
        gpus=list(plan.gpus),
        pools=[EnginePoolBytes(pool=pool, bytes=n) for pool, n in plan.charges],
        assumed=True,
    )


def lane_placement_leases(consumer: str, placement: EmbedLanePlacement) -> list[Lease]:
    """The leases of one lane's placement: its bytes per pool, never below the pool's floor."""
    return [
        Lease(
            consumer,
            ConsumerKind.EMBED_LANE,
            placement.node,
            part.pool,
            max(part.bytes, part.floor_bytes),
            part.floor_bytes,
        )
        for part in placement.pools
        if max(part.bytes, part.floor_bytes) > 0
    ]


def embedlane_leases(lanes: Iterable[EmbedLane]) -> list[Lease]:
    return _leases_of(
        ConsumerKind.EMBED_LANE,
        ((lane.metadata, lane.status.placement) for lane in lanes),
        lane_placement_leases,
    )
