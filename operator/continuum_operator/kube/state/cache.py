"""What the operator has seen of the cluster, fed by watch events; decisions read only this.

As in Kueue, controllers feed a cache and the decision never reads the API: kopf's watch
handlers (`kube.state.handlers`) call `Cache.observe_*`, the reconcile loop decides from a
`view()` (a `snapshot()` where a reader awaits before it is done).
After the operator writes an Engine's status it records the answer here at once ("assume"), so
the next engine's placement sees the bytes just leased before the watch event arrives.
Neighbours: `kube.engines.reconcile` (decides from a Snapshot), `kube.state.handlers` (feeds this),
`kube.state.lease_renewal` (when each agent Lease's renewal counts from).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from pydantic import ValidationError

from continuum_operator.core import rfc3339
from continuum_operator.core.heartbeat import LEASE_NAMESPACE, node_of_lease
from continuum_operator.core.placements import consumer_name
from continuum_operator.core.pools import Board, ConsumerKind, Lease
from continuum_operator.kube.base.kernel import WorkQueue
from continuum_operator.kube.client.kept import kept, newer, resource_version
from continuum_operator.kube.client.merge_patch import merge_patch
from continuum_operator.kube.ledger import cached, grant_ledger
from continuum_operator.kube.state.lane_index import lane_hold, lane_nodes, lanes_of, lanes_on
from continuum_operator.kube.state.lease_renewal import (
    LeaseEntry,
    renewal_counted_from,
    renewed_in_time,
)
from continuum_operator.kube.workloads.engine_objects import GPU_RESOURCE, LAUNCH_ANNOTATION
from continuum_operator.kube.workloads.facts_job import FACTS_FOR_LABEL
from continuum_operator.kube.workloads.lane_objects import whole_cpus
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.engine import EnginePlacement
from continuum_operator.model.json_body import (
    at,
    integer,
    items_at,
    labels_at,
    name_of,
    namespaced_name,
    object_at,
    text,
)

EngineKey = tuple[str, str]  # (namespace, name)


@dataclass(frozen=True, slots=True)
class BoardEntry:
    board: Board | None  # None: the board's status does not validate
    resource_version: str
    problem: str = ""
    cap_mechanisms: tuple[str, ...] = ()  # per-process GPU caps the node offers (its agent saw)


@dataclass(frozen=True, slots=True)
class NodeEntry:
    labels: Mapping[str, str]
    gpus_allocatable: int
    cpus_allocatable: int | None = None  # whole CPUs; None where the Node states none


@dataclass(frozen=True, slots=True)
class DeploymentEntry:
    launch: str | None
    generation: int
    observed_generation: int
    ready_replicas: int
    updated_replicas: int
    replicas: int
    resource_version: int = 0

    def running(self, launch: str) -> bool:
        """The pod of this launch is ready, and no older or newer launch is rolling."""
        return (
            self.launch == launch
            and self.observed_generation >= self.generation
            and self.updated_replicas >= 1
            and self.ready_replicas >= 1
            and self.replicas <= 1
        )


@dataclass(frozen=True, slots=True)
class JobEntry:
    """A facts Job (`kube.workloads.facts_job.facts_job`) and how it ended, if it did."""

    name: str
    source: str
    succeeded: bool
    failed: bool


@dataclass(frozen=True, slots=True)
class PlacedLeases:
    """An engine's `status.placement` as leases, and whether it is still assumed."""

    leases: tuple[Lease, ...]
    assumed: bool


def placed_leases(key: EngineKey, body: Mapping[str, object]) -> PlacedLeases | None:
    """None: no placement, or one that does not validate (skipped, not guessed)."""
    raw = at(body, "status", "placement")
    if not raw:
        return None
    try:
        p = EnginePlacement.model_validate(raw)
    except ValueError:
        return None
    who = consumer_name(ConsumerKind.ENGINE, key[0], key[1])
    leases = tuple(Lease(who, ConsumerKind.ENGINE, p.node, x.pool, x.bytes) for x in p.pools)
    return PlacedLeases(leases, p.assumed)


@dataclass(frozen=True, slots=True)
class Snapshot:
    boards: Mapping[str, BoardEntry]
    leases: Mapping[str, LeaseEntry]  # by node name
    nodes: Mapping[str, NodeEntry]
    engines: Mapping[EngineKey, Mapping[str, object]]
    deployments: Mapping[EngineKey, DeploymentEntry]
    jobs: Mapping[EngineKey, JobEntry] = field(default_factory=dict)
    lanes: Mapping[EngineKey, Mapping[str, object]] = field(default_factory=dict)  # EmbedLanes
    # Each engine's placement as leases (parsed once per watch event, not once per decision) and
    # the engines placed on each node; None: derived from `engines` (a snapshot built by hand).
    engine_leases: Mapping[EngineKey, PlacedLeases] | None = None
    engines_on: Mapping[str, frozenset[EngineKey]] | None = None


@dataclass
class Cache:
    lease_namespace: str = LEASE_NAMESPACE
    max_lease_seconds: float = 300.0  # `FreshnessSettings.max_ttl_seconds`
    boards: dict[str, BoardEntry] = field(default_factory=dict)
    leases: dict[str, LeaseEntry] = field(default_factory=dict)
    nodes: dict[str, NodeEntry] = field(default_factory=dict)
    # Engines, each with its GrantLedger's status merged in (`kube.ledger.cached`); the
    # GrantLedgers themselves by their Engine's key.
    engines: dict[EngineKey, dict[str, Any]] = field(default_factory=dict)
    ledgers: dict[EngineKey, Mapping[str, object]] = field(default_factory=dict)
    holders: cached.HolderIndex = field(default_factory=cached.HolderIndex)
    deployments: dict[EngineKey, DeploymentEntry] = field(default_factory=dict)
    jobs: dict[EngineKey, JobEntry] = field(default_factory=dict)
    services: set[EngineKey] = field(default_factory=set)  # engines whose Service exists
    lanes: dict[EngineKey, Mapping[str, object]] = field(default_factory=dict)  # EmbedLanes
    # Each board's `spec.placed` as last seen (`kube.nodes.placed_pods` writes only what differs),
    # and the nodes whose board changed, to decide again (its reconciler's queue).
    board_placed: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    placed_queue: WorkQueue[str] = field(default_factory=WorkQueue)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    clock: Callable[[], float] = time.time  # the loops' (`kube.process.run`): renewals seen
    engine_leases: dict[EngineKey, PlacedLeases] = field(default_factory=dict)
    engines_on: dict[str, frozenset[EngineKey]] = field(default_factory=dict)
    # Engines, their index and assumed patches change together, with no lock: every observer,
    # every reader and every write's answer runs on the event loop (the loops' API calls are
    # awaited there, `kube.client.async_api`), and none awaits between its reads and its changes.
    # Engines to decide again (`kube.engines.loop`, on `kube.base.kernel`), marked by what each
    # observation can change; every engine not placed yet once a node's room changed
    # (`mark_unplaced` marks them at the next pass: the loop's own placements change rooms many
    # times a pass).
    engine_queue: WorkQueue[EngineKey] = field(default_factory=WorkQueue)
    _unplaced_pending: bool = False
    # Status patches sent and not answered yet ("assumed", as kube-scheduler assumes a pod), each
    # with the last body observed without it: the patch is merged over every body observed
    # meanwhile, so the bytes it leases stay counted, and dropped if the write fails.
    _pending: dict[EngineKey, tuple[Mapping[str, object], dict[str, Any]]] = field(
        default_factory=dict
    )
    # EmbedLanes to decide again (`kube.lanes.loop`, on `kube.base.kernel`): a lane that changed,
    # the lanes of an Engine that changed, those placed on a node whose room changed, and those
    # that may go to any node (not placed yet, or with a model of their own).
    lane_queue: WorkQueue[EngineKey] = field(default_factory=WorkQueue)
    # The grants loop's queue (`kube.process.run.join_caches` sets it), woken by an Engine's watch
    # event: its pass finds which engines changed by comparing their bodies with those it last
    # stepped.
    grants_queue: WorkQueue[EngineKey] | None = None
    # Whether a TokenQuota exists (`join_caches` sets it): the passes then read every GrantLedger.
    quotas_read: Callable[[], bool] = lambda: False

    def assume_status(self, key: EngineKey, patch: Mapping[str, object]) -> None:
        """Record a status patch as written before its answer (`settle_status` ends it)."""
        known = self.engines.get(key)
        if known is None:
            return
        self._pending[key] = (patch, known)
        body = merge_patch(known, patch)
        self.engines[key] = body
        self._index_engine(key, body)

    def settle_status(self, key: EngineKey, answer: Mapping[str, object] | None) -> None:
        """The answer of an assumed status patch; None: it failed, and the engine is as observed
        without it (decided again at the next pass)."""
        pending = self._pending.pop(key, None)
        if pending is not None and answer is None and key in self.engines:
            self.engines[key] = pending[1]
            self._index_engine(key, pending[1])
        self.engine_queue.mark(key, wake=False)
        if answer is not None:
            self.observe_engine(answer, deleted=False, nudge=False)

    def mark_unplaced(self) -> None:
        """Mark every engine not placed yet, if a node's room changed since the last call."""
        if self._unplaced_pending:
            self._unplaced_pending = False
            unplaced = [k for k in self.engines if k not in self.engine_leases]
            self.engine_queue.mark(*unplaced, wake=False)

    def mark_nodes(self, nodes: Iterable[str], wake: bool = True) -> None:
        """Something a placement reads changed on these nodes (board, Lease, Node, leases):
        the engines placed there, and those not placed yet (they may place there)."""
        nodes = set(nodes)
        if not nodes:
            return
        for node in nodes:
            self.engine_queue.mark(*self.engines_on.get(node, ()), wake=False)
        self._unplaced_pending = True
        if wake:
            self.engine_queue.wake()
        self.lane_queue.mark(*lanes_on(self.lanes, nodes))

    def snapshot(self) -> Snapshot:
        engines = dict(self.engines)  # bodies are replaced, never changed in place
        engine_leases = dict(self.engine_leases)
        engines_on = dict(self.engines_on)
        return Snapshot(
            boards=dict(self.boards),
            leases=dict(self.leases),
            nodes=dict(self.nodes),
            engines=engines,
            deployments=dict(self.deployments),
            jobs=dict(self.jobs),
            lanes=dict(self.lanes),
            engine_leases=engine_leases,
            engines_on=engines_on,
        )

    def view(self) -> Snapshot:
        """The cache as a Snapshot of its own maps, not copies, for a decision made at once (no
        await until it is done: every change runs on the event loop). Copying every map for
        each engine decided was most of a pass's time outside the decisions."""
        return Snapshot(**{f.name: getattr(self, f.name) for f in fields(Snapshot)})

    def _index_engine(self, key: EngineKey, body: Mapping[str, object] | None) -> None:
        """Keep `engine_leases` and `engines_on` in line with `engines[key]`."""
        old = self.engine_leases.pop(key, None)
        new = placed_leases(key, body) if body is not None else None
        old_nodes = {x.node for x in old.leases} if old else set()
        new_nodes = {x.node for x in new.leases} if new else set()
        if new is not None:
            self.engine_leases[key] = new
        if old != new:
            # Bytes taken or freed (or no longer assumed): every decision on those nodes reads it.
            self.mark_nodes(old_nodes | new_nodes, wake=False)
        for node in old_nodes - new_nodes:
            rest = self.engines_on.get(node, frozenset()) - {key}
            if rest:
                self.engines_on[node] = rest
            else:
                self.engines_on.pop(node, None)
        for node in new_nodes - old_nodes:
            self.engines_on[node] = self.engines_on.get(node, frozenset()) | {key}

    def _nudge(self) -> None:
        self.changed.set()

    def observe_board(self, obj: Mapping[str, object], deleted: bool) -> None:
        name = name_of(obj)
        self.placed_queue.mark(name)
        if deleted:
            self.boards.pop(name, None)
            self.board_placed.pop(name, None)
        else:
            rv = text(obj, "metadata", "resourceVersion") or ""
            self.board_placed[name] = [labels_at(p) for p in items_at(obj, "spec", "placed")]
            try:
                resource = NodeBoard.model_validate(dict(obj))
                caps = tuple(str(c.mechanism) for c in resource.status.cap_mechanisms)
                entry = BoardEntry(Board.from_resource(resource), rv, "", caps)
            except ValidationError as err:
                entry = BoardEntry(None, rv, str(err.errors()[0]["msg"]))
            known = self.boards.get(name)
            self.boards[name] = entry
            if known is not None and replace(known, resource_version=rv) == entry:
                return  # its words changed (a reason, a GPU's name), nothing a decision reads
        self.mark_nodes((name,))
        self._nudge()

    def observe_lease(self, obj: Mapping[str, object], deleted: bool) -> None:
        """The agent's Lease of a node (`core.heartbeat`); the kubelet's own Lease is ignored."""
        if text(obj, "metadata", "namespace") != self.lease_namespace:
            return
        node = node_of_lease(name_of(obj), labels_at(obj, "metadata", "annotations"))
        if node is None:
            return
        known = self.leases.get(node)
        if deleted:
            self.leases.pop(node, None)
        else:
            duration = integer(obj, "spec", "leaseDurationSeconds")
            renew_time = rfc3339.parse(
                text(obj, "spec", "renewTime") or text(obj, "spec", "acquireTime")
            )
            now = self.clock()
            entry = LeaseEntry(
                renew_time=renew_time,
                duration_seconds=(
                    min(float(duration), self.max_lease_seconds) if duration is not None else None
                ),
                resource_version=text(obj, "metadata", "resourceVersion") or "",
                counted_from=renewal_counted_from(known, renew_time, now),
            )
            self.leases[node] = entry
            if known is not None and renewed_in_time(known, entry, now):
                # The board stayed fresh throughout: no decision changes, and a pass over every
                # engine for each node's heartbeat would never rest. The next resync reads it.
                return
        self.mark_nodes((node,))
        self._nudge()

    def observe_node(self, obj: Mapping[str, object], deleted: bool) -> None:
        name = name_of(obj)
        if deleted:
            self.nodes.pop(name, None)
        else:
            allocatable = labels_at(obj, "status", "allocatable")  # quantities, as strings
            try:
                gpus = int(allocatable.get(GPU_RESOURCE, 0))
            except ValueError:
                gpus = 0
            entry = NodeEntry(
                labels_at(obj, "metadata", "labels"),
                gpus,
                whole_cpus(allocatable.get("cpu")),
            )
            if self.nodes.get(name) == entry:
                return  # a status heartbeat: nothing the decisions read changed
            self.nodes[name] = entry
        self.mark_nodes((name,))
        self._nudge()

    def observe_engine(self, obj: Mapping[str, object], deleted: bool, nudge: bool = True) -> None:
        key = namespaced_name(obj)
        pending = self._pending.get(key)
        known = self.engines.get(key)
        if deleted:
            self.engines.pop(key, None)
            self._pending.pop(key, None)
            self._index_engine(key, None)
        else:
            # A watch event older than the answer of our own write must not undo it. (An
            # assumed body keeps the version it was assumed over.)
            if newer(obj, known):
                body = cached.merged(kept(obj), self.ledgers.get(key))
                if pending is not None:
                    # Another write landed while ours is in flight: ours still holds.
                    self._pending[key] = (pending[0], body)
                    body = merge_patch(body, pending[0])
                self.engines[key] = body
                self._index_engine(key, body)
        # Marked even for the loop's own writes: the engine is decided again against what
        # it wrote (a pass that then writes nothing leaves it quiet).
        self.engine_queue.mark(key, wake=nudge)
        self.lane_queue.mark(*lanes_of(self.lanes, key))
        if nudge:
            self._nudge()
            if self.grants_queue is not None:
                self.grants_queue.wake()

    def observe_ledger(self, obj: Mapping[str, object], deleted: bool, nudge: bool = True) -> None:
        """An Engine's GrantLedger, merged into the Engine's cached body. No plan reads the
        ledger but a relaunch's wait for the drain of the old launch's grants: only then is the
        Engine marked for the plan loop (one mark per grant was a plan decide per grant)."""
        key = namespaced_name(obj)
        known = self.ledgers.get(key)
        if deleted:
            if known is None or at(known, "metadata", "uid") != at(obj, "metadata", "uid"):
                return  # an earlier ledger of the name, already replaced
            self.ledgers.pop(key)
        elif newer(obj, known):
            # By resourceVersion alone: a late event of an earlier ledger of the name (replaced
            # since) is older than the ledger made after its deletion.
            self.ledgers[key] = kept(obj)
        else:
            return  # older than the answer of our own write
        before, current = self.engines.get(key), self.ledgers.get(key)
        self.holders.replace(key, known, current)
        if before is None:
            # Not an Engine of this cache (yet, or another operator's, `--engine-selector`):
            # kept for its Engine's event to merge. No step here reads it, so no pass is woken
            # (another operator's writes, ~100/s at scale, would each wake one, reading every
            # engine), but where TokenQuotas count what it holds and that changed.
            if self.grants_queue is None:
                return
            if deleted:
                # Its Minds were not told while it lived (`MindWrites.missing_engine_jobs`).
                self.grants_queue.mark(key, wake=nudge)
            elif (
                nudge
                and self.quotas_read()
                and cached.held_tokens(known) != cached.held_tokens(current)
            ):
                self.grants_queue.wake()
            return
        after = cached.merged(before, current)
        pending = self._pending.get(key)
        if pending is not None:
            self._pending[key] = (pending[0], cached.merged(pending[1], current))
        self.engines[key] = after
        if any(grant_ledger.holds_another_launch(b.get("status") or {}) for b in (before, after)):
            self.engine_queue.mark(key, wake=nudge)
        if nudge and self.grants_queue is not None:
            self.grants_queue.wake()

    def observe_lane(self, obj: Mapping[str, object], deleted: bool, nudge: bool = True) -> None:
        """An EmbedLane (`kube.lanes.loop`); its placement is in every engine's ledger."""
        key = namespaced_name(obj)
        known = self.lanes.get(key)
        if deleted:
            self.lanes.pop(key, None)
        elif newer(obj, known):
            self.lanes[key] = kept(obj)
        new = self.lanes.get(key)
        self.lane_queue.mark(key)
        if lane_hold(known) != lane_hold(new):
            # A lane's bytes are charged on its node, to every engine decided there.
            self.mark_nodes(lane_nodes(known) | lane_nodes(new), wake=nudge)
        if nudge:
            self._nudge()

    def observe_service(self, obj: Mapping[str, object], deleted: bool) -> None:
        key = namespaced_name(obj)
        if deleted:
            self.services.discard(key)
        else:
            self.services.add(key)
        self.engine_queue.mark(key)
        self._nudge()

    def observe_job(self, obj: Mapping[str, object], deleted: bool) -> None:
        engine = labels_at(obj, "metadata", "labels").get(FACTS_FOR_LABEL)
        if not engine:
            return
        namespace, name = namespaced_name(obj)
        key = (namespace, engine)
        if deleted:
            if key in self.jobs and self.jobs[key].name == name:
                del self.jobs[key]
        else:
            status = object_at(obj, "status")
            self.jobs[key] = JobEntry(
                name=name,
                source=labels_at(obj, "metadata", "annotations").get(
                    "continuum.dev/model-source", ""
                ),
                succeeded=_job_ended(status, "Complete"),
                failed=_job_ended(status, "Failed"),
            )
        self.engine_queue.mark(key)
        self._nudge()

    def observe_deployment(
        self, obj: Mapping[str, object], deleted: bool, nudge: bool = True
    ) -> None:
        key = namespaced_name(obj)
        known = self.deployments.get(key)
        if deleted:
            self.deployments.pop(key, None)
        elif known is not None and resource_version(obj) < known.resource_version:
            # The answer of our own apply, older than a watch event already seen (the pod got
            # ready while the write was in flight): keeping it would hide the readiness forever.
            pass
        else:
            template = labels_at(obj, "spec", "template", "metadata", "annotations")
            self.deployments[key] = DeploymentEntry(
                launch=template.get(LAUNCH_ANNOTATION),
                generation=integer(obj, "metadata", "generation") or 0,
                observed_generation=integer(obj, "status", "observedGeneration") or 0,
                ready_replicas=integer(obj, "status", "readyReplicas") or 0,
                updated_replicas=integer(obj, "status", "updatedReplicas") or 0,
                replicas=integer(obj, "status", "replicas") or 0,
                resource_version=resource_version(obj),
            )
        self.engine_queue.mark(key, wake=nudge)
        if nudge:
            self._nudge()


def _job_ended(status: Mapping[str, object], kind: str) -> bool:
    conditions = items_at(status, "conditions")
    return any(at(c, "type") == kind and at(c, "status") == "True" for c in conditions)
