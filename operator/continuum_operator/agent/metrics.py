"""The node agent's Prometheus metrics, behind small recorder functions.

What the agent measured at its last cycle (each pool's capacity and use, the memory mode), how
long its probes took, and how often it wrote the board or failed a cycle. The NodeBoard holds the
same readings, but only as last written (a write waits for a change past the thresholds); these
are the readings of every cycle. Series carry the agent's `node` (one agent per node, so the
DaemonSet's series add up without relabelling); pools are named as the operator's are
(`unified`, `host`, `device/<gpu>`). Served by `continuum agent --metrics-port`; docs/metrics.md
lists them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, start_http_server

from continuum_operator.core.pools import pool_key
from continuum_operator.metric_families import MetricSet, counter, gauge, histogram
from continuum_operator.model.board import MemoryMode, NodeBoardStatus

__all__ = ["CYCLE_BUCKETS", "AgentMetrics"]

#: Seconds: a cycle is a few NVML and /proc reads and one or two API calls; anything near the
#: interval (10 s) means the Lease is at risk.
CYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: The labels of a pool's two gauges: a GPU that goes away leaves both (`record_cycle`).
_POOL_SERIES = ["node", "pool"]


@dataclass
class AgentMetrics(MetricSet):
    node: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _pools: set[str] = field(default_factory=set)

    capacity = gauge(
        "continuum_agent_pool_capacity_bytes",
        "A pool's capacity as the agent measured it at its last cycle.",
        _POOL_SERIES,
    )
    used = gauge(
        "continuum_agent_pool_used_bytes",
        "A pool's measured use at the agent's last cycle; absent while unsampled.",
        _POOL_SERIES,
    )
    mode = gauge(
        "continuum_agent_memory_mode",
        "1 for the memory mode the agent reported at its last cycle, 0 for the others.",
        ["node", "mode"],
    )
    cycle_seconds = histogram(
        "continuum_agent_cycle_seconds",
        "Seconds one agent cycle took: probe, board write if any, Lease renewal.",
        ["node"],
        buckets=CYCLE_BUCKETS,
    )
    probe_seconds = gauge(
        "continuum_agent_probe_seconds",
        "Seconds each probe took at the last cycle (nvml, host, metal, attribution).",
        ["node", "probe"],
    )
    board_writes = counter(
        "continuum_agent_board_writes",
        "NodeBoard status writes (usage moved past the thresholds, or a first write).",
        ["node"],
    )
    cycle_failures = counter(
        "continuum_agent_cycle_failures",
        "Cycles that failed (probe or API error): the Lease was not renewed that time.",
        ["node"],
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        # This node's counters, present from the start at 0.
        self.board_writes.labels(self.node)
        self.cycle_failures.labels(self.node)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def record_cycle(
        self,
        status: NodeBoardStatus,
        timings: Mapping[str, float],
        seconds: float,
    ) -> None:
        """One cycle done: its readings, probe timings and duration."""
        pools: set[str] = set()
        for p in status.pools:
            key = pool_key(p.kind, p.device)
            pools.add(key)
            self.capacity.labels(self.node, key).set(p.capacity_bytes)
            if p.used_bytes is None:
                with contextlib.suppress(KeyError):
                    self.used.remove(self.node, key)
            else:
                self.used.labels(self.node, key).set(p.used_bytes)
        for key in self._pools - pools:  # a GPU that went away
            for family in (self.capacity, self.used):
                with contextlib.suppress(KeyError):
                    family.remove(self.node, key)
        self._pools = pools
        for mode in MemoryMode:
            self.mode.labels(self.node, mode.value).set(1 if mode is status.memory_mode else 0)
        for probe, spent in timings.items():
            self.probe_seconds.labels(self.node, probe).set(spent)
        self.cycle_seconds.labels(self.node).observe(seconds)

    def record_write(self) -> None:
        self.board_writes.labels(self.node).inc()

    def record_failure(self) -> None:
        self.cycle_failures.labels(self.node).inc()
