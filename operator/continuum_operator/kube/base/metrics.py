"""The operator's Prometheus metrics, behind small recorder functions.

Names carry the `continuum_` prefix; label values are enums (damping outcomes) or the engine's
own namespace and name. Beside `engine/metrics.py` (the gateway's). docs/design.md rule 3 asks for a
metric wherever a node's memory mode is unknown: `continuum_engine_memory_mode_unknown`.
Served by `continuum operator --metrics-port`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from prometheus_client import CollectorRegistry

from continuum_operator.core.damping import Outcome
from continuum_operator.core.grants import Grant, GrantReason, Transition
from continuum_operator.core.receipts import is_host_buffer
from continuum_operator.kube.base.readiness import Readiness, serve_metrics
from continuum_operator.metric_families import MetricSet, counter, gauge, histogram
from continuum_operator.model.json_body import integer
from continuum_operator.model.mind import GrantState

__all__ = [
    "CYCLE_WINDOWS",
    "WAIT_BUCKETS",
    "OperatorMetrics",
    "RelaunchCause",
    "estimate_errors",
]

#: Seconds: a turn wait is anything from none (granted on arrival) to a mind parked for half an
#: hour behind a relaunch; the top buckets are there to see that happen.
WAIT_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
#: client-go's request latency buckets (rest_client_request_duration_seconds), up to the adapter's
#: 30 s deadline.
API_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)

#: A reclaim cycle: a mind reclaimed again within this many protection windows of the start of
#: her previous reclaim (docs/metrics.md). The allocator never preempts within one window
#: (docs/design.md rule 7), so a Preempted cycle is a mind preempted once her protection ended;
#: engine reasons ignore protection and count from 0.
CYCLE_WINDOWS = 2.0

_EngineMind = tuple[str, str, str]

#: The labels of the three gauges of an engine's plan: `set_plan` moves them together when the
#: plan's node changes.
_PLAN_SERIES = ["namespace", "engine", "node"]


class RelaunchCause(StrEnum):
    """The `cause` label of `continuum_engine_relaunches_total`."""

    PLANNED = "Planned"  # the operator relaunched the pod (a damped re-plan, a spec change)
    CRASHED = "Crashed"  # llama-server exited inside the pod and the runtime started it again


@dataclass
class OperatorMetrics(MetricSet):
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    boards_seen: set[str] = field(default_factory=set)
    # Minds queued now, by (namespace, engine, mind): when this leader saw her wait begin, and
    # the reason she waits for. Only this replica's own steps fill it (see `record_grant_step`).
    waiting: dict[_EngineMind, tuple[float, str]] = field(default_factory=dict)
    estimated: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    # The runtime restarts last seen per engine: (launch, count), to count what is new.
    restarts_seen: dict[tuple[str, str], tuple[str | None, int]] = field(default_factory=dict)
    # The node each engine's plan series are labelled with, to drop them when it changes.
    planned_on: dict[tuple[str, str], str] = field(default_factory=dict)

    # The families, in the order /metrics lists them (they are created in this order).
    # Every request of the operator's own adapter (kube.client.api); kopf's watches are not in it.
    api_requests = counter(
        "continuum_operator_api_requests",
        "API requests the operator made through its adapter, by verb and resource.",
        ["verb", "resource"],
    )
    api_request_seconds = histogram(
        "continuum_operator_api_request_duration_seconds",
        "Seconds from sending a request through the adapter to reading its answer, by verb "
        "and resource (watches not included).",
        ["verb", "resource"],
        buckets=API_BUCKETS,
    )

    # Engines: their relaunches, placements and plans, and the boards they are planned on.
    relaunches = counter(
        "continuum_engine_relaunches",
        "Relaunches of an engine: of its pod, by the operator (damped; cause Planned), and "
        "of llama-server inside its pod, by the runtime (cause Crashed).",
        ["namespace", "engine", "cause"],
    )
    weighed = counter(
        "continuum_engine_replans_weighed",
        "Re-plans weighed by relaunch damping, by outcome.",
        ["outcome"],
    )
    placements = counter(
        "continuum_engine_placements", "Assumed leases written (an engine placed on a node)."
    )
    pod_start_timeouts = counter(
        "continuum_engine_pod_start_timeouts",
        "Assumed leases released because the engine pod was not ready in time.",
    )
    unschedulable = gauge(
        "continuum_engines_unschedulable", "Engines no node takes, at the last pass."
    )
    memory_mode_unknown = gauge(
        "continuum_engine_memory_mode_unknown",
        "1 while an engine runs on a node of unknown memory mode (device ungoverned).",
        ["namespace", "engine"],
    )
    plan_layers = gauge(
        "continuum_engine_plan_layers_on_device",
        "Layers the engine's current plan puts on the device (llama.cpp -ngl).",
        _PLAN_SERIES,
    )
    plan_pool_tokens = gauge(
        "continuum_engine_plan_pool_tokens",
        "KV-cache tokens in the engine's current plan, over all its slots.",
        _PLAN_SERIES,
    )
    plan_slots = gauge(
        "continuum_engine_plan_slots",
        "Slots (minds grantable at once) in the engine's current plan.",
        _PLAN_SERIES,
    )
    board_fresh = gauge(
        "continuum_node_board_fresh",
        "1 while a node's board is fresh (its agent's Lease renewed in time), 0 when stale.",
        ["node"],
    )

    # A mind's child pods (kube.children.webhook, docs/children.md).
    children_mutated = counter(
        "continuum_mind_children_mutated",
        "Child pods of minds given the children's class by the webhook.",
        ["namespace"],
    )
    children_unmutated_seen = counter(
        "continuum_mind_children_unmutated",
        "Child pods of minds seen without the webhook's mark (admitted unmutated).",
        ["namespace"],
    )
    children_unmutated = gauge(
        "continuum_mind_children_unmutated_live",
        "Child pods of minds present now without the webhook's mark.",
        ["namespace"],
    )

    # Grants (kube.grants.loop, docs/grants.md): docs/design.md rule 7 counts and exports reclaims.
    grant_transitions = counter(
        "continuum_grant_transitions",
        "Grant ledger transitions the leader wrote, by the state entered and the reason.",
        ["to", "reason"],
    )
    reclaims = counter(
        "continuum_grant_reclaims",
        "Reclaims begun (Granted -> Reclaiming), by reason.",
        ["reason"],
    )
    grants_held = gauge(
        "continuum_grants_held",
        "Slots held (Granted or Reclaiming) in an engine's ledger, at its last step.",
        ["namespace", "engine"],
    )
    grants_queued = gauge(
        "continuum_grants_queued",
        "Minds queued in an engine's ledger, at its last step.",
        ["namespace", "engine"],
    )
    grant_waits = histogram(
        "continuum_grant_wait_seconds",
        "Seconds a mind waited Queued before Granted, by the reason she last waited for.",
        ["namespace", "engine", "reason"],
        buckets=WAIT_BUCKETS,
    )
    reclaim_cycles = counter(
        "continuum_grant_reclaim_cycles",
        "Minds reclaimed again within twice their protection window of their last reclaim.",
        ["namespace", "engine", "reason"],
    )
    # An engine's, but declared here so that /metrics lists the families in the order it
    # always has.
    estimate_error = gauge(
        "continuum_engine_plan_estimate_error_ratio",
        "(planned - allocated) / allocated bytes per pool side: the plan against the "
        "running engine's receipt of the same placement.",
        ["namespace", "engine", "pool"],
    )
    ledger_conflicts = counter(
        "continuum_grant_ledger_conflicts",
        "Ledger writes refused for a stale resourceVersion (409), decided again.",
    )

    leader = gauge("continuum_operator_leader", "1 while this replica holds the leader Lease.")

    def serve(self, port: int, readiness: Readiness) -> None:
        """`/metrics`, and `/readyz` from `readiness` (`kube.base.readiness`)."""
        serve_metrics(port, self.registry, readiness)

    def record_api_request(self, verb: str, resource: str) -> None:
        self.api_requests.labels(verb, resource).inc()

    def record_api_answer(self, verb: str, resource: str, seconds: float) -> None:
        self.api_request_seconds.labels(verb, resource).observe(seconds)

    def record_relaunch(self, namespace: str, engine: str) -> None:
        self.relaunches.labels(namespace, engine, RelaunchCause.PLANNED).inc()

    def record_runtime_restarts(
        self, namespace: str, engine: str, status: Mapping[str, object] | None
    ) -> None:
        """llama-server's restarts that `status.runtime.restarts` reports and this replica has
        not counted: the increase within one launch, all of a new launch's. The first report
        seen (after this operator started) is the baseline: counted by whoever saw it grow."""
        runtime = (status or {}).get("runtime")
        if not isinstance(runtime, Mapping):
            return
        try:
            restarts = int(runtime.get("restarts") or 0)
        except (TypeError, ValueError):
            return
        launch = runtime.get("launch")
        launch = str(launch) if launch is not None else None
        key = (namespace, engine)
        seen = self.restarts_seen.get(key)
        if seen is not None:
            new = restarts - seen[1] if seen[0] == launch else restarts
            if new > 0:
                self.relaunches.labels(namespace, engine, RelaunchCause.CRASHED).inc(new)
        self.restarts_seen[key] = (launch, restarts)

    def record_weighed(self, outcome: Outcome) -> None:
        if outcome is not Outcome.UNCHANGED:
            self.weighed.labels(str(outcome)).inc()

    def record_placement(self) -> None:
        self.placements.inc()

    def record_pod_start_timeout(self) -> None:
        self.pod_start_timeouts.inc()

    def set_memory_mode_unknown(self, namespace: str, engine: str, unknown: bool) -> None:
        self.memory_mode_unknown.labels(namespace, engine).set(1 if unknown else 0)

    def set_plan(self, namespace: str, engine: str, plan: Mapping[str, object] | None) -> None:
        """The engine's plan as its status holds it; no plan (unschedulable), no series."""
        key = (namespace, engine)
        node = str(plan.get("node") or "") if plan else ""
        old = self.planned_on.get(key)
        if old is not None and old != node:
            for family in (self.plan_layers, self.plan_pool_tokens, self.plan_slots):
                with contextlib.suppress(KeyError):
                    family.remove(namespace, engine, old)
            del self.planned_on[key]
        if not plan or not node:
            return
        self.plan_layers.labels(namespace, engine, node).set(integer(plan, "layersOnDevice") or 0)
        self.plan_pool_tokens.labels(namespace, engine, node).set(integer(plan, "poolTokens") or 0)
        self.plan_slots.labels(namespace, engine, node).set(integer(plan, "mindsGrantable") or 0)
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
        self,
        namespace: str,
        engine: str,
        transitions: Sequence[Transition],
        before: Mapping[str, Grant],
        held: int,
        queued: int,
    ) -> None:
        """One ledger step written: its transitions, the ledger it started from (`before`, read
        from its GrantLedger) and the counts of the ledger after it.

        A wait starts when a mind enters Queued and ends when she is Granted; its reason is the
        last one she was queued with (PoolFull, WaitingForReclaim, EngineRelaunching, ...).
        A mind granted on arrival waited 0 s for `Arrived`. A wait this replica did not see
        begin (a mind queued under an earlier leader) is measured from her ledger entry's
        `since`, the last change of her wait reason: a lower bound.
        """
        for t in transitions:
            self.grant_transitions.labels(t.to_state.value, t.reason.value).inc()
            key = (namespace, engine, t.mind)
            if t.from_state is GrantState.GRANTED and t.to_state is GrantState.RECLAIMING:
                self.reclaims.labels(t.reason.value).inc()
                if _is_cycle(t, before.get(t.mind)):
                    self.reclaim_cycles.labels(namespace, engine, t.reason.value).inc()
            if t.to_state is GrantState.QUEUED:
                start = t.at
                if t.from_state is GrantState.QUEUED:
                    start = self.waiting.get(key, (t.at, ""))[0]
                    if key not in self.waiting and (old := before.get(t.mind)) is not None:
                        start = old.since
                self.waiting[key] = (start, t.reason.value)
            elif t.from_state is GrantState.QUEUED:
                seen = self.waiting.pop(key, None)
                old = before.get(t.mind)
                if seen is None and old is not None and old.state is GrantState.QUEUED:
                    seen = (old.since, old.reason.value)
                if t.to_state is GrantState.GRANTED and seen is not None:
                    started, reason = seen
                    self.grant_waits.labels(namespace, engine, reason).observe(
                        max(0.0, t.at - started)
                    )
        self.grants_held.labels(namespace, engine).set(held)
        self.grants_queued.labels(namespace, engine).set(queued)

    def set_estimate_error(
        self, namespace: str, engine: str, status: Mapping[str, object] | None
    ) -> None:
        """The plan in the Engine's status against its runtime's receipt (docs/design.md rule 5);
        no receipt of the plan's placement, no series (see `estimate_errors`)."""
        key = (namespace, engine)
        errors = estimate_errors(status or {})
        for pool in self.estimated.get(key, set()) - set(errors):
            with contextlib.suppress(KeyError):
                self.estimate_error.remove(namespace, engine, pool)
        for pool, ratio in errors.items():
            self.estimate_error.labels(namespace, engine, pool).set(ratio)
        if errors:
            self.estimated[key] = set(errors)
        else:
            self.estimated.pop(key, None)

    def record_ledger_conflict(self) -> None:
        self.ledger_conflicts.inc()

    def set_leader(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)
        if not leading:
            # Another leader writes the ledger now: waits we saw begin may end, or begin
            # again, without us; a later term reads them from the ledger instead.
            self.waiting.clear()

    def forget(self, namespace: str, engine: str) -> None:
        self.set_plan(namespace, engine, None)
        self.set_estimate_error(namespace, engine, None)
        for key in [k for k in self.waiting if k[:2] == (namespace, engine)]:
            del self.waiting[key]
        with contextlib.suppress(KeyError):
            self.memory_mode_unknown.remove(namespace, engine)
        for cause in RelaunchCause:
            with contextlib.suppress(KeyError):
                self.relaunches.remove(namespace, engine, cause)
        self.restarts_seen.pop((namespace, engine), None)


def _is_cycle(t: Transition, before: Grant | None) -> bool:
    """A reclaim within CYCLE_WINDOWS protection windows of the start of the mind's previous
    one. A deleted mind's reclaim ends her grants for good: no cycle."""
    if t.reason is GrantReason.MIND_DELETED or before is None or before.reclaimed_at is None:
        return False
    return t.at - before.reclaimed_at < CYCLE_WINDOWS * t.protection_window


def estimate_errors(status: Mapping[str, object]) -> dict[str, float]:
    """(planned - allocated) / allocated bytes per pool side, for the Engine's `status.plan`
    against the receipt in its `status.runtime` of the same placement.

    The receipt must be of the plan's launch (layers on device, `--ctx-size`, slots, KV type):
    after a re-plan the engine still runs (and reports) the old launch until its relaunch, and
    comparing the new plan with the old allocation would report an error that is none. Sides
    that allocated nothing, or that the plan has no bytes for, are left out.
    """
    plan = status.get("plan")
    runtime = status.get("runtime")
    if not isinstance(plan, Mapping) or not isinstance(runtime, Mapping):
        return {}
    receipts = runtime.get("receipts")
    if not isinstance(receipts, list) or not receipts or not isinstance(receipts[-1], Mapping):
        return {}
    receipt = receipts[-1]
    placement = receipt.get("placement")
    launched = (
        placement.get("layersOnDevice") if isinstance(placement, Mapping) else None,
        receipt.get("contextTokens"),  # --ctx-size
        receipt.get("parallel", 1),
        receipt.get("kvCacheType", "f16"),
    )
    planned_launch = (
        plan.get("layersOnDevice"),
        plan.get("poolTokens"),
        plan.get("mindsGrantable"),
        plan.get("kvCacheType"),
    )
    if launched != planned_launch:
        return {}
    sides = plan.get("bytes")
    if not isinstance(sides, Mapping):
        return {}
    allocated = {"device": 0, "host": 0}
    for buf in receipt.get("buffers") or ():
        if not isinstance(buf, Mapping):
            continue
        side = "host" if is_host_buffer(str(buf.get("device", ""))) else "device"
        allocated[side] += int(buf.get("bytes") or 0)
    out: dict[str, float] = {}
    for side, got in allocated.items():
        part = sides.get(side)
        if got <= 0 or not isinstance(part, Mapping) or not part:
            continue
        planned = sum(int(part.get(k) or 0) for k in ("weights", "kv", "compute"))
        out[side] = (planned - got) / got
    return out
