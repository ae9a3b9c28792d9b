"""Per node and pool figures as Prometheus gauges: capacity, measured use, leased (by consumer
kind), floors, available, and each node's memory mode.

Every figure is derived at each pass of the decision loop (`kube.engines.loop`) from the snapshot it
decided against: the boards the agents wrote and the leases read off the consumers' placements
(`core.pools.BoardLeases`, `kube.state.occupancy.other_leases`), never stored a second time.
`pool_rows` is pure (a snapshot in, rows out); `PoolMetrics` only sets gauges, and drops the
series of pools and nodes that are gone. Served from the operator's registry (`kube.base.metrics`);
docs/metrics.md lists the names.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Gauge

from continuum_operator.core.pools import BoardLeases, ConsumerKind, Lease
from continuum_operator.kube.state.cache import Snapshot
from continuum_operator.kube.state.occupancy import other_leases
from continuum_operator.metric_families import MetricSet, gauge
from continuum_operator.model.board import MemoryMode

__all__ = ["PoolMetrics", "PoolRow", "pool_rows"]

Labels = tuple[str, ...]

#: A pool's series: by node and pool key.
_POOL = ["node", "pool"]


@dataclass(frozen=True, slots=True)
class PoolRow:
    node: str
    pool: str  # `unified`, `host` or `device/<gpu>`
    capacity_bytes: int
    used_bytes: int | None  # None until the agent has sampled it
    available_bytes: int | None
    floor_bytes: int
    leased_bytes: Mapping[ConsumerKind, int]


def pool_rows(snap: Snapshot) -> tuple[list[PoolRow], dict[str, MemoryMode]]:
    """Each pool of each valid board with the leases held in it, and each node's memory mode."""
    # Nobody excluded: every engine's and lane's lease, grouped by node once (a ledger per
    # board over the whole list was boards x leases a pass: 94% of an idle pass at 1,000 nodes).
    by_node: dict[str, list[Lease]] = defaultdict(list)
    for lease in other_leases(snap, ("", "")):
        by_node[lease.node].append(lease)
    rows: list[PoolRow] = []
    modes: dict[str, MemoryMode] = {}
    for node, entry in sorted(snap.boards.items()):
        if entry.board is None:
            continue
        modes[node] = entry.board.memory_mode
        ledger = BoardLeases.of(entry.board, by_node.get(node, ()))
        for key, pool in entry.board.pools.items():
            held = [lease for lease in ledger.leases if lease.pool == key]
            rows.append(
                PoolRow(
                    node=node,
                    pool=key,
                    capacity_bytes=pool.capacity_bytes,
                    used_bytes=pool.used_bytes,
                    available_bytes=ledger.available_bytes(key),
                    floor_bytes=sum(lease.floor_bytes for lease in held),
                    leased_bytes={
                        kind: sum(lease.bytes for lease in held if lease.kind is kind)
                        for kind in ConsumerKind
                    },
                )
            )
    return rows, modes


@dataclass
class PoolMetrics(MetricSet):
    registry: CollectorRegistry
    _seen: dict[str, dict[Labels, float]] = field(default_factory=dict)  # as last set

    capacity = gauge("continuum_pool_capacity_bytes", "A pool's capacity (its board).", _POOL)
    used = gauge(
        "continuum_pool_used_bytes",
        "A pool's measured use (its board); absent until the agent has sampled it.",
        _POOL,
    )
    leased = gauge(
        "continuum_pool_leased_bytes",
        "Bytes leased in a pool by the placements of one kind of consumer.",
        [*_POOL, "consumer_kind"],
    )
    floor = gauge(
        "continuum_pool_floor_bytes",
        "Bytes of a pool under consumers' floors (an embedding lane's largest context).",
        _POOL,
    )
    available = gauge(
        "continuum_pool_available_bytes",
        "capacity - max(leased, measured use); absent while the pool is unsampled.",
        _POOL,
    )
    mode = gauge(
        "continuum_node_memory_mode",
        "1 for a node's memory mode (unified, discrete, unknown), 0 for the others.",
        ["node", "mode"],
    )

    def record(self, snap: Snapshot) -> None:
        rows, modes = pool_rows(snap)
        values: dict[str, dict[Labels, float]] = {
            name: {} for name in ("capacity", "used", "leased", "floor", "available", "mode")
        }
        for row in rows:
            key = (row.node, row.pool)
            values["capacity"][key] = row.capacity_bytes
            values["floor"][key] = row.floor_bytes
            if row.used_bytes is not None:
                values["used"][key] = row.used_bytes
            if row.available_bytes is not None:
                values["available"][key] = row.available_bytes
            for kind, held in row.leased_bytes.items():
                values["leased"][(*key, str(kind))] = held
        for node, mode in modes.items():
            for each in MemoryMode:
                values["mode"][(node, str(each))] = 1 if each is mode else 0
        for name, wanted in values.items():
            family: Gauge = getattr(self, name)
            last = self._seen.get(name, {})
            for gone in set(last) - set(wanted):
                with contextlib.suppress(KeyError):
                    family.remove(*gone)
            # Only the series whose value changed: a pass sets a dozen gauges a pool otherwise.
            for labels, value in wanted.items():
                if last.get(labels) != value:
                    family.labels(*labels).set(value)
            self._seen[name] = wanted
