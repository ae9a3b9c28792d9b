"""The operator's Prometheus metrics, behind small recorder functions.

Names carry the `continuum_` prefix; label values are enums (damping outcomes) or the engine's
own namespace and name. Beside `engine/metrics.py` (the gateway's). DESIGN.md rule 3 asks for a
metric wherever a node's memory mode is unknown: `continuum_engine_memory_mode_unknown`.
Served by `continuum operator --metrics-port`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from continuum_operator.core.damping import Outcome

__all__ = ["OperatorMetrics"]


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    boards_seen: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        r = self.registry
        self.relaunches = Counter(
            "continuum_engine_relaunches",
            "Relaunches of an engine's pod the operator decided (damped).",
            ["namespace", "engine"],
            registry=r,
        )
        self.weighed = Counter(
            "continuum_engine_replans_weighed",
            "Re-plans weighed by relaunch damping, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.placements = Counter(
            "continuum_engine_placements",
            "Assumed leases written (an engine placed on a node).",
            registry=r,
        )
        self.pod_start_timeouts = Counter(
            "continuum_engine_pod_start_timeouts",
            "Assumed leases released because the engine pod was not ready in time.",
            registry=r,
        )
        self.unschedulable = Gauge(
            "continuum_engines_unschedulable",
            "Engines no node takes, at the last pass.",
            registry=r,
        )
        self.memory_mode_unknown = Gauge(
            "continuum_engine_memory_mode_unknown",
            "1 while an engine runs on a node of unknown memory mode (device ungoverned).",
            ["namespace", "engine"],
            registry=r,
        )
        self.plan_layers = Gauge(
            "continuum_engine_plan_layers_on_device",
            "Layers the engine's current plan puts on the device (llama.cpp -ngl).",
            ["namespace", "engine", "node"],
            registry=r,
        )
        self.plan_pool_tokens = Gauge(
            "continuum_engine_plan_pool_tokens",
            "KV-cache tokens in the engine's current plan, over all its slots.",
            ["namespace", "engine", "node"],
            registry=r,
        )
        self.plan_slots = Gauge(
            "continuum_engine_plan_slots",
            "Slots (minds grantable at once) in the engine's current plan.",
            ["namespace", "engine", "node"],
            registry=r,
        )
        self.planned_on: dict[tuple[str, str], str] = {}
        self.board_fresh = Gauge(
            "continuum_node_board_fresh",
            "1 while a node's board is fresh (its agent's Lease renewed in time), 0 when stale.",
            ["node"],
            registry=r,
        )
        # A mind's child pods (kube.webhook, docs/children.md).
        self.children_mutated = Counter(
            "continuum_mind_children_mutated",
            "Child pods of minds given the children's class by the webhook.",
            ["namespace"],
            registry=r,
        )
        self.children_unmutated_seen = Counter(
            "continuum_mind_children_unmutated",
            "Child pods of minds seen without the webhook's mark (admitted unmutated).",
            ["namespace"],
            registry=r,
        )
        self.children_unmutated = Gauge(
            "continuum_mind_children_unmutated_live",
            "Child pods of minds present now without the webhook's mark.",
            ["namespace"],
            registry=r,
        )

        # Grants (kube.minds, docs/grants.md): DESIGN.md rule 7 counts and exports reclaims.
        self.grant_transitions = Counter(
            "continuum_grant_transitions",
            "Grant ledger transitions the leader wrote, by the state entered and the reason.",
            ["to", "reason"],
            registry=r,
        )
        self.reclaims = Counter(
            "continuum_grant_reclaims",
            "Reclaims begun (Granted -> Reclaiming), by reason.",
            ["reason"],
            registry=r,
        )
        self.grants_held = Gauge(
            "continuum_grants_held",
            "Slots held (Granted or Reclaiming) in an engine's ledger, at its last step.",
            ["namespace", "engine"],
            registry=r,
        )
        self.grants_queued = Gauge(
            "continuum_grants_queued",
            "Minds queued in an engine's ledger, at its last step.",
            ["namespace", "engine"],
            registry=r,
        )
        self.ledger_conflicts = Counter(
            "continuum_grant_ledger_conflicts",
            "Ledger writes refused for a stale resourceVersion (409), decided again.",
            registry=r,
        )
        self.leader = Gauge(
            "continuum_operator_leader",
            "1 while this replica holds the leader Lease.",
            registry=r,
        )

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)

    def record_relaunch(self, namespace: str, engine: str) -> None:
        self.relaunches.labels(namespace, engine).inc()

    def record_weighed(self, outcome: Outcome) -> None:
        if outcome is not Outcome.UNCHANGED:
            self.weighed.labels(str(outcome)).inc()

    def record_placement(self) -> None:
        self.placements.inc()

    def record_pod_start_timeout(self) -> None:
        self.pod_start_timeouts.inc()

    def set_memory_mode_unknown(self, namespace: str, engine: str, unknown: bool) -> None:
        self.memory_mode_unknown.labels(namespace, engine).set(1 if unknown else 0)

    def set_plan(self, namespace: str, engine: str, plan: Mapping[str, Any] | None) -> None:
        """The engine's plan as its status holds it; no plan (unschedulable), no series."""
        key = (namespace, engine)
        node = str(plan.get("node") or "") if plan else ""
        old = self.planned_on.get(key)
        if old is not None and old != node:
            for gauge in (self.plan_layers, self.plan_pool_tokens, self.plan_slots):
                with contextlib.suppress(KeyError):
                    gauge.remove(namespace, engine, old)
            del self.planned_on[key]
        if not plan or not node:
            return
        self.plan_layers.labels(namespace, engine, node).set(int(plan.get("layersOnDevice", 0)))
        self.plan_pool_tokens.labels(namespace, engine, node).set(int(plan.get("poolTokens", 0)))
        self.plan_slots.labels(namespace, engine, node).set(int(plan.get("mindsGrantable", 0)))
        self.planned_on[key] = node

    def set_boards_fresh(self, fresh: dict[str, bool]) -> None:
        """Every board's freshness; a board that is gone leaves the metric."""
        for node in self.boards_seen - set(fresh):
            with contextlib.suppress(KeyError):
                self.board_fresh.remove(node)
        for node, ok in fresh.items():
            self.board_fresh.labels(node).set(1 if ok else 0)
        self.boards_seen = set(fresh)

    def record_child_mutated(self, namespace: str) -> None:
        self.children_mutated.labels(namespace).inc()

    def record_child_unmutated(self, namespace: str) -> None:
        self.children_unmutated_seen.labels(namespace).inc()

    def set_children_unmutated(self, namespace: str, live: int) -> None:
        self.children_unmutated.labels(namespace).set(live)

    def record_grant_step(
        self, namespace: str, engine: str, moves: list[tuple[str, str, str]], held: int, queued: int
    ) -> None:
        """One ledger step written: its (from, to, reason) moves and the ledger after it."""
        for src, dst, reason in moves:
            self.grant_transitions.labels(dst, reason).inc()
            if src == "Granted" and dst == "Reclaiming":
                self.reclaims.labels(reason).inc()
        self.grants_held.labels(namespace, engine).set(held)
        self.grants_queued.labels(namespace, engine).set(queued)

    def record_ledger_conflict(self) -> None:
        self.ledger_conflicts.inc()

    def set_leader(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)

    def forget(self, namespace: str, engine: str) -> None:
        self.set_plan(namespace, engine, None)
        for metric in (self.relaunches, self.memory_mode_unknown):
            with contextlib.suppress(KeyError):
                metric.remove(namespace, engine)
