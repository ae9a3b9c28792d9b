"""One pass over one Engine as it goes: what it read (the snapshot, the operator's memory of the
engine), the status parts and events it will write, and how every pass ends (`finish`: the
conditions, the engine's objects and the `Writes`). With what both an engine placed anew and
one already placed write: the plan and its placement as status holds them, and a relaunch. No
API calls. Neighbours: `kube.engines.reconcile` (starts a pass, places an engine),
`kube.engines.placed` (an engine already placed), `kube.workloads.engine_objects` and
`kube.workloads.engine_identity` (the objects).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from continuum_operator.core import conditions as cond
from continuum_operator.core.damping import Damper, Outcome
from continuum_operator.core.placements import consumer_name, placement_of
from continuum_operator.core.plan import ServingPlan
from continuum_operator.core.pools import ConsumerKind
from continuum_operator.core.receipts import Receipt
from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.core.rfc3339 import parse as parse_rfc3339
from continuum_operator.kube.base.events import Event
from continuum_operator.kube.base.settings import OperatorSettings, PodSettings, resolve_sharing
from continuum_operator.kube.client.merge_patch import status_patch
from continuum_operator.kube.engines import runtime_report
from continuum_operator.kube.state.cache import EngineKey, Snapshot
from continuum_operator.kube.workloads import engine_identity, engine_objects
from continuum_operator.model.base import Condition
from continuum_operator.model.board import MemoryMode
from continuum_operator.model.engine import Engine, EnginePlacement, ModelFacts
from continuum_operator.model.json_body import (
    integer,
    items_at,
    labels_at,
    namespaced_name,
    object_at,
    text,
)
from continuum_operator.model.plan_status import READING, SPEC_GENERATION, PlanStatus

__all__ = [
    "READING",
    "EnginePass",
    "Event",
    "Memory",
    "Writes",
    "placement_status",
    "plan_status",
    "planned_engine",
    "pods_on",
    "size_text",
]


@dataclass(frozen=True, slots=True)
class Memory:
    """What the operator remembers of one engine between passes (lost on restart, safely)."""

    damper: Damper = field(default_factory=Damper)
    backoff_until: Mapping[str, float] = field(default_factory=dict)
    facts_error: str | None = None  # why the facts Job's answer could not be used
    node_gone_since: float | None = None  # when the placed engine's Node was first seen missing
    #: The body last validated and its Engine: while the cache holds that same body object (it
    #: replaces a body, never changes one), the next pass takes the Engine, not a validation
    #: of the whole object again (a full pass validated every Engine at each pass).
    parsed: tuple[Mapping[str, object], Engine] | None = None


@dataclass(frozen=True, slots=True)
class Writes:
    status_patch: dict[str, Any] | None
    deployment: dict[str, Any] | None
    service: dict[str, Any] | None  # with the engine's ServiceAccount, Role and RoleBinding
    delete_workload: bool
    events: tuple[Event, ...]
    memory: Memory
    facts_job: dict[str, Any] | None = None  # the Job that reads the model's facts, wanted
    identity: tuple[dict[str, Any], ...] = ()  # the engine pod's ServiceAccount, Role, binding
    damping: Outcome | None = None  # what relaunch damping decided this pass, if it weighed
    unschedulable: bool = False
    memory_mode_unknown: bool = False


def pods_on(snap: Snapshot, node: str, settings: OperatorSettings) -> PodSettings:
    """The pod settings on one node: GPU sharing resolved against what its board offers, and
    the node's allocatable CPUs (the engine's CPUs follow them, `engine_objects.engine_cpus`)."""
    board = snap.boards.get(node)
    offered = board.cap_mechanisms if board is not None else ()
    sharing = resolve_sharing(settings.pods.gpu_sharing, offered)
    entry = snap.nodes.get(node)
    cpus = entry.cpus_allocatable if entry is not None else None
    uuids = board.board.gpu_uuids if board is not None and board.board is not None else {}
    return replace(
        settings.pods, gpu_sharing=sharing, node_cpus=cpus, node_gpu_uuids=tuple(uuids.items())
    )


def size_text(n: int) -> str:
    """Bytes in an event's words: GiB from 1 GiB up, MiB below (a 9 MiB lease read "0.00 GiB")."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def planned_engine(plan: PlanStatus, engine: Engine) -> cond.PlannedEngine:
    """A written plan as the conditions read it."""
    return cond.PlannedEngine(
        node=plan.node,
        memory_mode=plan.memory_mode,
        layers_on_device=plan.layers_on_device,
        total_layers=plan.total_layers,
        minds_grantable=plan.minds_grantable,
        minds_max=engine.spec.minds.max,
        gpu_servable=plan.gpu_servable,
    )


_QUIET_REASONS = frozenset(
    {cond.Reason.POD_PENDING, cond.Reason.RELAUNCHING, cond.Reason.NOT_PLACED}
)


def _event_type(c: Condition) -> str:
    """Warning for what a person should look at; Normal for progress."""
    t = cond.ConditionType
    if c.type in (t.PLANNED, t.READY):
        bad = c.status == "False" and c.reason not in _QUIET_REASONS
    else:
        bad = c.status == "True"
    return "Warning" if bad else "Normal"


def plan_status(p: ServingPlan, generation: int | None, reading: str | None = None) -> PlanStatus:
    """The plan as status holds it, with the spec generation it was made for and the reading
    of its node it was made on (`core.replan.node_reading`), where known."""
    return PlanStatus.model_validate({**p.to_dict(), SPEC_GENERATION: generation, READING: reading})


def placement_status(p: ServingPlan, now: float) -> EnginePlacement:
    """The plan's placement as status holds it: a lease assumed from `now`."""
    return placement_of(p).model_copy(update={"assumed_at": format_seconds(now)})


class EnginePass:
    """One pass over one Engine: what it read, and the status parts and events it will write."""

    engine: Engine
    facts: ModelFacts

    def __init__(
        self,
        body: Mapping[str, object],
        snap: Snapshot,
        memory: Memory,
        now: float,
        settings: OperatorSettings,
    ) -> None:
        self.snap, self.now, self.settings = snap, now, settings
        self.key: EngineKey = namespaced_name(body)
        self.uid = text(body, "metadata", "uid") or ""
        self.generation = integer(body, "metadata", "generation")
        self.status = object_at(body, "status")
        conditions = items_at(self.status, "conditions")
        self.old_conditions = [Condition.model_validate(c) for c in conditions]
        self.events: list[Event] = []
        self.new: dict[str, object] = {}  # status parts this pass writes (None removes one)
        self.facts_in = cond.EngineFacts(generation=self.generation)
        self.me = consumer_name(ConsumerKind.ENGINE, *self.key)
        self.ttl = settings.freshness.default_ttl_seconds
        damper = memory.damper
        relaunches = object_at(self.status, "relaunches")
        if damper.relaunches == 0 and relaunches:
            # After a restart: the count and the cooldown come back from status; evidence not.
            damper = replace(
                damper,
                relaunches=integer(relaunches, "count") or 0,
                last_relaunch_at=parse_rfc3339(text(relaunches, "lastTime")),
            )
        self.damper = damper
        self.backoff = {n: t for n, t in memory.backoff_until.items() if t > now}
        self.memory = memory
        self.parsed = memory.parsed
        self.node_gone_since: float | None = None
        self.launch: str | None = None  # the launch in force, once `placed` knows it
        self.annotations: Mapping[str, str] = labels_at(body, "metadata", "annotations")
        self.held = ""  # why a new plan is held (`core.replan`), for the PlanHeld condition

    # -- the end of every pass ----------------------------------------------------------------

    def finish(
        self,
        f: cond.EngineFacts,
        engine: Engine | None,
        plan: PlanStatus | None,
        node_has_gpus: bool = False,
        pods: PodSettings | None = None,
    ) -> Writes:
        pods = pods or self.settings.pods
        old = self.old_conditions
        conditions = cond.merge(old, cond.engine_conditions(f), format_seconds(self.now))
        for c in cond.transitions(old, conditions):
            if c.reason in _QUIET_REASONS:
                continue  # progress the next transition reports (PodReady, Placed)
            event = Event(_event_type(c), c.reason, c.message or f"{c.type}")
            if (c.message or c.status == "True") and event not in self.events:
                self.events.append(event)
        new = self.new
        new["conditions"] = [c.model_dump(by_alias=True, exclude_none=True) for c in conditions]
        new["observedGeneration"] = self.generation
        deployment = service = None
        identity: tuple[dict[str, Any], ...] = ()
        if engine is not None and plan is not None:
            deployment = engine_objects.deployment(
                engine, self.uid, plan, pods, node_has_gpus=node_has_gpus
            )
            service = engine_objects.service(engine, self.uid, pods)
            identity = (
                *engine_identity.engine_rbac(engine, self.uid),
                engine_identity.network_policy(engine, self.uid, pods),
            )
            claim = engine_objects.gpu_claim_template(engine, self.uid, plan, pods)
            if claim is not None:  # before the Deployment, as its pods name it
                identity = (*identity, claim)
            new["enforcement"] = engine_objects.enforcement(plan, pods, node_has_gpus=node_has_gpus)
        patch = status_patch(self.status, new)
        return Writes(
            status_patch={"status": patch} if patch else None,
            deployment=deployment,
            service=service,
            delete_workload=plan is None,
            events=tuple(self.events),
            memory=Memory(
                self.damper,
                self.backoff,
                self.memory.facts_error,
                self.node_gone_since,
                self.parsed,
            ),
            damping=f.damping,
            unschedulable=f.unschedulable is not None and f.planned is None,
            memory_mode_unknown=(
                f.planned is not None and f.planned.memory_mode == MemoryMode.UNKNOWN
            ),
            identity=identity,
        )

    def write_plan(self, plan: PlanStatus) -> PlanStatus:
        """Write `plan` as status.plan this pass; returns it."""
        self.new["plan"] = plan.to_status()
        return plan

    def write_placement(self, placement: EnginePlacement) -> EnginePlacement:
        """Write `placement` as status.placement this pass; returns it."""
        self.new["placement"] = placement.model_dump(by_alias=True, mode="json", exclude_none=True)
        return placement

    def relaunch(
        self, candidate: ServingPlan, reason: str, reading: str | None = None
    ) -> PlanStatus:
        """Record a relaunch with `candidate` (made on the node's `reading`); returns its plan
        as status holds it."""
        plan = self.write_plan(plan_status(candidate, self.generation, reading))
        self.write_placement(placement_status(candidate, self.now))
        self.new["relaunches"] = {
            "count": self.damper.relaunches,
            "lastTime": format_seconds(self.now),
            "lastReason": reason,
        }
        self.events.append(Event("Normal", "Relaunching", reason))
        return plan

    def evidence(self) -> runtime_report.Evidence:
        """The receipts of this Engine's model that its launch in force measured (`launch`:
        its hash; None, as when placing anew: the runtime's report is of no launch to keep),
        and why others found were set aside."""
        return runtime_report.receipts_of(
            self.status, self.engine.status.plan, self.engine.spec.model.sha256, self.launch
        )

    def receipts(self) -> tuple[Receipt, ...]:
        """The receipts a plan of this Engine may use (`evidence`)."""
        return self.evidence().receipts

    def llama_build(self) -> str | None:
        """The llama.cpp build the engine's image runs, as its runtime last reported it; None
        (any build's receipt) before it has reported."""
        runtime = self.status.get("runtime") or {}
        build = runtime.get("llamaBuild") if isinstance(runtime, Mapping) else None
        return str(build) if build else None
