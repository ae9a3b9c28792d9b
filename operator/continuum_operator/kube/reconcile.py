"""One reconcile pass of one Engine: from a snapshot to the writes it needs. No API calls.

Kueue's cycle, for one engine: read the snapshot (`kube.cache`), decide with the pure core
(`core.bestfit` to place, `core.plan` to re-plan, `core.damping` to weigh a relaunch,
`core.conditions` for what status says), and return the writes: a status patch (only the parts
that changed, None when nothing did), the Deployment and Service wanted (or none), and events.
`kube.loop` applies them. The clock and the operator's memory of each engine (its damper, nodes
it backs off from) are passed in.

The rules kept here (docs/design.md "Placement", "One writer per status field"):
- a placement is assumed (`status.placement.assumed`) when written, before the pod exists, and
  confirmed once the pod is ready; one whose pod is not ready within the start timeout is
  released, the node backed off, and the engine placed again;
- a placed engine is re-planned on its own node crediting its own lease, and relaunched only when
  the damper says so; nothing is planned on a stale board;
- the Deployment is built from `status.plan`, so what runs is what status says.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from continuum_operator.core import conditions as cond
from continuum_operator.core import gpu_check, unfit
from continuum_operator.core.bestfit import (
    Decision,
    NodeView,
    choose,
    matches,
    with_unmeasured,
)
from continuum_operator.core.damping import Damper, Observation, Outcome, PlanShape, step
from continuum_operator.core.placements import consumer_name, placement_of
from continuum_operator.core.plan import ServingPlan, plan
from continuum_operator.core.pools import Board, ConsumerKind, Lease, Ledger
from continuum_operator.core.receipts import Receipt
from continuum_operator.kube import engine_identity, facts_job, objects, runtime_report
from continuum_operator.kube.cache import (
    EngineKey,
    Snapshot,
    format_time,
    parse_time,
)
from continuum_operator.kube.occupancy import is_fresh, other_leases
from continuum_operator.kube.settings import (
    GpuClaims,
    OperatorSettings,
    PodSettings,
    resolve_sharing,
)
from continuum_operator.manifests import ManifestError, parse
from continuum_operator.model.base import Condition
from continuum_operator.model.board import MemoryMode
from continuum_operator.model.engine import Engine, ModelFacts


@dataclass(frozen=True, slots=True)
class Memory:
    """What the operator remembers of one engine between passes (lost on restart, safely)."""

    damper: Damper = field(default_factory=Damper)
    backoff_until: Mapping[str, float] = field(default_factory=dict)
    facts_error: str | None = None  # why the facts Job's answer could not be used
    node_gone_since: float | None = None  # when the placed engine's Node was first seen missing


#: Seconds an engine's Node must stay missing from the cache before its placement is released.
#: Nodes and Engines arrive by separate watches, so right after a start an Engine may be seen
#: before its Node is: a hold of a few passes keeps a restart from releasing every placement.
NODE_GONE_HOLD_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


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


def reading_of(snap: Snapshot, node: str) -> str:
    board = snap.boards.get(node)
    lease = snap.leases.get(node)
    return f"{board.resource_version if board else '-'}/{lease.resource_version if lease else '-'}"


def pods_on(snap: Snapshot, node: str, settings: OperatorSettings) -> PodSettings:
    """The pod settings on one node: GPU sharing resolved against what its board offers, and
    the node's allocatable CPUs (the engine's CPUs follow them, `objects.engine_cpus`)."""
    board = snap.boards.get(node)
    offered = board.cap_mechanisms if board is not None else ()
    sharing = resolve_sharing(settings.pods.gpu_sharing, offered)
    entry = snap.nodes.get(node)
    cpus = entry.cpus_allocatable if entry is not None else None
    return replace(settings.pods, gpu_sharing=sharing, node_cpus=cpus)


def _unschedulable(decision: Decision) -> cond.Problem:
    """Why no node takes it, in counts and the closest node (`core.unfit`: `continuum place`
    prints the same message)."""
    return unfit.explain(decision)


def _size(n: int) -> str:
    """Bytes in an event's words: GiB from 1 GiB up, MiB below (a 9 MiB lease read "0.00 GiB")."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _memory_mode(plan_doc: Mapping[str, Any]) -> MemoryMode:
    """The mode a written plan was made on; a plan that names none, or one this operator does
    not know, counts as unknown (rule 3: never guessed)."""
    try:
        return MemoryMode(str(plan_doc.get("memoryMode")))
    except ValueError:
        return MemoryMode.UNKNOWN


def _planned(plan_doc: Mapping[str, Any], engine: Engine) -> cond.PlannedEngine:
    return cond.PlannedEngine(
        node=str(plan_doc.get("node", "")),
        memory_mode=_memory_mode(plan_doc),
        layers_on_device=int(plan_doc.get("layersOnDevice", 0)),
        total_layers=int(plan_doc.get("totalLayers", 0)),
        minds_grantable=int(plan_doc.get("mindsGrantable", 0)),
        minds_max=engine.spec.minds.max,
        gpu_servable=bool(plan_doc.get("gpuServable", False)),
    )


def _shape(plan_doc: Mapping[str, Any]) -> PlanShape:
    return PlanShape(
        args=tuple(str(a) for a in plan_doc.get("engineArgs", [])),
        layers_on_device=int(plan_doc.get("layersOnDevice", 0)),
        total_layers=int(plan_doc.get("totalLayers", 0)),
        pool_tokens=int(plan_doc.get("poolTokens", 0)),
    )


def _facts_from_file(
    engine: Engine,
    status: Mapping[str, Any],
    snap: Snapshot,
    memory: Memory,
    key: EngineKey,
    uid: str,
    settings: OperatorSettings,
) -> tuple[ModelFacts | None, cond.Problem | None, dict[str, Any] | None]:
    """Facts read from the model's file: from status, or a Job to read them (docs/design.md)."""
    source = facts_job.source_key(engine)
    read = status.get("modelFacts") or {}
    if read and read.get("source") == source:
        try:
            return ModelFacts.model_validate(read["facts"]), None, None
        except ValueError as err:
            why = f"status.modelFacts.facts cannot be planned from: {err}"
            return None, cond.Problem(cond.Reason.FACTS_MISSING, why), None
    job = snap.jobs.get(key)
    name = facts_job.facts_job_name(engine)
    fix = (
        "check spec.model.source, or give the facts inline (`continuum facts MODEL.gguf` prints "
        "them for spec.model.facts)"
    )
    if job is not None and job.name == name and (job.failed or memory.facts_error):
        # One line, however the error read (an API error's body is a JSON document).
        why = " ".join((memory.facts_error or "the Job failed").split())[:500]
        message = f"reading the model's facts in Job {name} failed: {why}; {fix}"
        return None, cond.Problem(cond.Reason.FACTS_MISSING, message), None
    message = (
        f"reading the model's GGUF header in Job {name} (`continuum facts` where the file is); "
        "the engine is planned once the facts are in status.modelFacts"
    )
    wanted = facts_job.facts_job(engine, uid, settings.pods)
    return None, cond.Problem(cond.Reason.FACTS_PENDING, message), wanted


_PER_LAYER = frozenset({"layer_bytes", "kv_bytes_per_token_per_layer", "head_count_kv"})


def facts_disagreements(inline: ModelFacts, read: ModelFacts) -> list[str]:
    """Each fact the Engine states inline that the file's header does not bear out, with both
    values ("kvBytesPerTokenPerLayer is 0 inline, 4096 in the file"). One number for every
    layer equals a list of that number once per layer."""
    out: list[str] = []
    for name in sorted(inline.model_fields_set):
        mine, theirs = getattr(inline, name), getattr(read, name)
        if name in _PER_LAYER and mine is not None and theirs is not None:
            same = _per_layer_list(mine, inline.layers) == _per_layer_list(theirs, read.layers)
        else:
            same = mine == theirs
        if not same:
            field = ModelFacts.model_fields[name].alias or name
            shown = "not stated" if theirs is None else f"{_short(theirs)}"
            out.append(f"{field} is {_short(mine)} inline, {shown} in the file")
    return out


def _per_layer_list(value: int | list[int], layers: int) -> list[int]:
    return list(value) if isinstance(value, list) else [value] * layers


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


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


def _stamped(p: ServingPlan, generation: int | None) -> dict[str, Any]:
    """The plan as status holds it, with the spec generation it was made for."""
    doc = p.to_dict()
    if generation is not None:
        doc["specGeneration"] = generation
    return doc


def _placement_doc(p: ServingPlan, now: float) -> dict[str, Any]:
    placed = placement_of(p).model_copy(update={"assumed_at": format_time(now)})
    return placed.model_dump(by_alias=True, mode="json", exclude_none=True)


def _damping_message(outcome: Outcome, damper: Damper, settings: OperatorSettings) -> str:
    if outcome is Outcome.GATHERING_EVIDENCE:
        return (
            f"a new plan has held for {damper.readings} of "
            f"{settings.damping.readings_required} board readings; relaunching when it holds"
        )
    if outcome is Outcome.COOLING_DOWN:
        return f"a new plan waits out the {settings.damping.cooldown_seconds:.0f} s cooldown"
    return ""


def reconcile(
    body: Mapping[str, Any],
    snap: Snapshot,
    memory: Memory,
    now: float,
    settings: OperatorSettings,
) -> Writes:
    """The writes one pass over one Engine needs (`Writes.status_patch` None: nothing changed)."""
    p = _Pass(body, snap, memory, now, settings)
    try:
        engine = parse(Engine, dict(body), f"Engine {p.key[0]}/{p.key[1]}")
    except ManifestError as err:
        problem = cond.Problem(cond.Reason.INVALID_SPEC, f"{err.field}: {err.problem}")
        return p.finish(replace(p.facts_in, problem=problem), None, None)
    refused = objects.host_path_refusal(engine.spec.model, settings.pods)
    if refused is not None:
        problem = cond.Problem(cond.Reason.INVALID_SPEC, f"spec.model.source.path: {refused}")
        return p.finish(replace(p.facts_in, problem=problem), None, None)
    facts = engine.spec.model.facts
    if engine.spec.model.source is not None:
        # With a file to read, the plan believes the file: inline facts are only checked.
        read, missing, job = _facts_from_file(
            engine, p.status, snap, memory, p.key, p.uid, settings
        )
        if read is None:
            writes = p.finish(replace(p.facts_in, problem=missing), None, None)
            return replace(writes, facts_job=job, delete_workload=False)
        if facts is not None and (differ := facts_disagreements(facts, read)):
            problem = cond.Problem(
                cond.Reason.INVALID_SPEC,
                "spec.model.facts: disagrees with the model file's header: "
                + "; ".join(differ[:3])
                + (f" (and {len(differ) - 3} more)" if len(differ) > 3 else "")
                + "; remove spec.model.facts (the file's facts are used) or set them to what "
                "`continuum facts MODEL.gguf` prints",
            )
            return p.finish(replace(p.facts_in, problem=problem), None, None)
        facts = read
    assert facts is not None  # ModelRef requires facts or a source
    p.engine, p.facts = engine, facts
    placement, plan_doc = p.status.get("placement"), p.status.get("plan")
    if placement and plan_doc:
        kept = p.placed(placement, plan_doc)
        if kept is not None:
            return kept
    return p.place()


class _Pass:
    """One pass over one Engine: what it read, and the status parts and events it will write."""

    engine: Engine
    facts: ModelFacts

    def __init__(
        self,
        body: Mapping[str, Any],
        snap: Snapshot,
        memory: Memory,
        now: float,
        settings: OperatorSettings,
    ) -> None:
        meta = body["metadata"]
        self.snap, self.now, self.settings = snap, now, settings
        self.key: EngineKey = (meta["namespace"], meta["name"])
        self.uid = str(meta.get("uid", ""))
        self.generation: int | None = meta.get("generation")
        self.status: dict[str, Any] = dict(body.get("status") or {})
        self.old_conditions = [
            Condition.model_validate(c) for c in self.status.get("conditions") or []
        ]
        self.events: list[Event] = []
        self.new: dict[str, Any] = {}  # status parts this pass writes (None removes one)
        self.facts_in = cond.EngineFacts(generation=self.generation)
        self.me = consumer_name(ConsumerKind.ENGINE, *self.key)
        self.ttl = settings.freshness.default_ttl_seconds
        damper = memory.damper
        relaunches = self.status.get("relaunches")
        if damper.relaunches == 0 and relaunches:
            # After a restart: the count and the cooldown come back from status; evidence not.
            damper = replace(
                damper,
                relaunches=int(relaunches.get("count", 0)),
                last_relaunch_at=parse_time(relaunches.get("lastTime")),
            )
        self.damper = damper
        self.backoff = {n: t for n, t in memory.backoff_until.items() if t > now}
        self.memory = memory
        self.node_gone_since: float | None = None

    # -- the end of every pass ----------------------------------------------------------------

    def finish(
        self,
        f: cond.EngineFacts,
        engine: Engine | None,
        plan_doc: Mapping[str, Any] | None,
        node_has_gpus: bool = False,
        pods: PodSettings | None = None,
    ) -> Writes:
        pods = pods or self.settings.pods
        old = self.old_conditions
        conditions = cond.merge(old, cond.engine_conditions(f), format_time(self.now))
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
        if engine is not None and plan_doc is not None:
            deployment = objects.deployment(
                engine, self.uid, plan_doc, pods, node_has_gpus=node_has_gpus
            )
            service = objects.service(engine, self.uid, pods)
            identity = (
                *engine_identity.engine_rbac(engine, self.uid),
                engine_identity.network_policy(engine, self.uid, pods),
            )
            claim = objects.gpu_claim_template(engine, self.uid, plan_doc, pods)
            if claim is not None:  # before the Deployment, as its pods name it
                identity = (*identity, claim)
            new["enforcement"] = objects.enforcement(plan_doc, pods, node_has_gpus=node_has_gpus)
        patch = {k: v for k, v in new.items() if self.status.get(k) != v}
        return Writes(
            status_patch={"status": patch} if patch else None,
            deployment=deployment,
            service=service,
            delete_workload=plan_doc is None,
            events=tuple(self.events),
            memory=Memory(self.damper, self.backoff, self.memory.facts_error, self.node_gone_since),
            damping=f.damping,
            unschedulable=f.unschedulable is not None and f.planned is None,
            memory_mode_unknown=(
                f.planned is not None and f.planned.memory_mode == MemoryMode.UNKNOWN
            ),
            identity=identity,
        )

    def relaunch(self, candidate: ServingPlan, reason: str) -> dict[str, Any]:
        """Record a relaunch with `candidate`; returns its plan as status holds it."""
        plan_doc = _stamped(candidate, self.generation)
        self.new["plan"] = plan_doc
        self.new["placement"] = _placement_doc(candidate, self.now)
        self.new["relaunches"] = {
            "count": self.damper.relaunches,
            "lastTime": format_time(self.now),
            "lastReason": reason,
        }
        self.events.append(Event("Normal", "Relaunching", reason))
        return plan_doc

    # -- an engine already placed ----------------------------------------------------------

    def placed(self, placement: dict[str, Any], plan_doc: dict[str, Any]) -> Writes | None:
        """Keep, confirm, re-plan or relaunch a placed engine; None when it must be placed anew."""
        snap, now, settings, engine = self.snap, self.now, self.settings, self.engine
        node = str(placement["node"])
        node_entry = snap.nodes.get(node)
        if node_entry is None and self.node_gone_long_enough(node):
            return None
        has_gpus = bool(node_entry and node_entry.gpus_allocatable > 0)
        pods = pods_on(snap, node, settings)
        launch = objects.launch_hash(engine, plan_doc, pods)
        dep = snap.deployments.get(self.key)
        running = dep is not None and dep.running(launch)
        assumed_at = parse_time(placement.get("assumedAt"))
        if (
            placement.get("assumed", True)
            and not running
            and assumed_at is not None
            and now - assumed_at > settings.placement.pod_start_timeout_seconds
        ):
            self.release_never_started(node)
            return None
        if running and placement.get("assumed", True):
            self.new["placement"] = {**placement, "assumed": False}
        fresh = is_fresh(snap, node, now, self.ttl)
        board = snap.boards.get(node)
        outcome: Outcome | None = None
        no_longer_fits = ""
        # A plan records the spec generation it was made for; older plans have none.
        spec_changed = plan_doc.get("specGeneration") not in (None, self.generation)
        # A spec changed while the board is stale waits for a fresh one (docs/design.md rule 4: no
        # relaunch on a stale board). The Deployment stays as it runs: built from the new spec
        # with the old plan it would carry the new spec's command line (a model digest), which is
        # a relaunch.
        held = False
        if spec_changed and not fresh and dep is not None and dep.launch is not None:
            held, running = True, dep.running(dep.launch)
        if (
            running
            and fresh
            and not spec_changed
            and board is not None
            and board.board is not None
            and pods.gpu_claims is GpuClaims.DEVICE_PLUGIN
        ):
            # The device plugin chose the pod's GPUs: the lease follows the ones it uses.
            plan_doc, placement = self.follow_gpus(board.board, plan_doc, placement)
        if fresh and board is not None and board.board is not None:
            weighed = self.weigh(node, board.board, placement, plan_doc, running, spec_changed)
            if weighed is None:
                return None
            plan_doc, running, outcome, no_longer_fits = weighed
        pod = (
            cond.PodPhase.READY
            if running
            else cond.PodPhase.RELAUNCHING
            if (dep is not None and dep.launch not in (None, launch)) or outcome is Outcome.RELAUNCH
            else cond.PodPhase.PENDING
        )
        # What the runtime of the launch in force reports (a refused model, a crash loop).
        current = runtime_report.current_runtime(
            self.status, objects.launch_hash(engine, plan_doc, pods)
        )
        f = cond.EngineFacts(
            generation=self.generation,
            planned=_planned(plan_doc, engine),
            board_fresh=fresh,
            pod=pod,
            damping=outcome,
            no_longer_fits=no_longer_fits,
            damping_message=_damping_message(outcome, self.damper, settings) if outcome else "",
            runtime=runtime_report.runtime_report(
                current, now, settings.pods.restart_window_seconds
            ),
        )
        writes = self.finish(f, engine, plan_doc, has_gpus, pods)
        return replace(writes, deployment=None) if held else writes

    def node_gone_long_enough(self, node: str) -> bool:
        """The Node was deleted under the engine: its pod cannot run there again. Once that has
        held a while, the lease is released (True: the engine is placed anew)."""
        since = self.memory.node_gone_since
        self.node_gone_since = since = self.now if since is None else since
        if self.now - since < NODE_GONE_HOLD_SECONDS:
            return False
        self.release_node_gone(node)
        return True

    def weigh(
        self,
        node: str,
        board: Board,
        placement: dict[str, Any],
        plan_doc: dict[str, Any],
        running: bool,
        spec_changed: bool,
    ) -> tuple[dict[str, Any], bool, Outcome | None, str] | None:
        """A placed engine against its fresh board: the plan in force, whether its pod still
        runs, what the damper decided and why it no longer fits (if so); None when it must be
        placed anew (its spec changed and this node no longer takes it)."""
        snap, now, settings, engine = self.snap, self.now, self.settings, self.engine
        outcome: Outcome | None = None
        no_longer_fits = ""
        node_entry = snap.nodes.get(node)
        kept = () if spec_changed else tuple(int(g) for g in plan_doc.get("gpus") or ())
        candidate = self.replan(node, board, placement, kept)
        labels = node_entry.labels if node_entry is not None else {}
        if spec_changed and (not candidate.schedulable or matches(engine.spec, labels) is not None):
            self.events.append(
                Event(
                    "Normal",
                    "Replacing",
                    f"spec changed (generation {self.generation}): {node} no longer takes "
                    "this engine; placing it anew",
                )
            )
            self.new["placement"] = None
            self.new["plan"] = None
            return None
        if spec_changed:
            # What the user asked for is not damped: relaunch now if the arguments moved.
            if candidate.engine_args != _shape(plan_doc).args:
                self.damper = replace(
                    self.damper,
                    candidate=None,
                    readings=0,
                    last_reading=None,
                    relaunches=self.damper.relaunches + 1,
                    last_relaunch_at=now,
                )
                plan_doc = self.relaunch(
                    candidate,
                    f"spec changed (generation {self.generation}): "
                    f"{candidate.layers_on_device}/{candidate.total_layers} layers, "
                    f"{candidate.minds_grantable} minds, {candidate.pool_tokens} pool tokens",
                )
                running, outcome = False, Outcome.RELAUNCH
            else:
                plan_doc = _stamped(candidate, self.generation)
                self.new["plan"] = plan_doc
        elif not candidate.schedulable:
            # Not moved elsewhere (yet): said, so a person can act.
            no_longer_fits = candidate.reasons[-1].message if candidate.reasons else ""
        else:
            self.damper, outcome = step(
                self.damper,
                Observation(
                    now=now,
                    reading=reading_of(snap, node),
                    running=_shape(plan_doc),
                    candidate=PlanShape.of(candidate),
                    in_flight=not running,
                ),
                settings.damping,
            )
            if outcome is Outcome.RELAUNCH:
                plan_doc = self.relaunch(candidate, _change(node, candidate, plan_doc))
                running = False
            elif outcome is Outcome.UNCHANGED and _bytes_moved(candidate, plan_doc):
                # The same launch, its bytes now measured (a receipt) or no longer: the
                # plan and the lease say what it holds; nothing relaunches for it.
                plan_doc = self.recharge(candidate, placement)
        return plan_doc, running, outcome, no_longer_fits

    def replan(
        self,
        node: str,
        board: Board,
        placement: Mapping[str, Any],
        on_gpus: tuple[int, ...] = (),
    ) -> ServingPlan:
        """The plan the engine would get on its own node now, crediting back what it holds, on
        the GPUs it runs on (`on_gpus`; none after a spec change: chosen again).

        The agent measures the engine's bytes, not the reserve kept free beside them, so only the
        lease less its reserve is taken off the measured usage; crediting the whole lease would
        count the reserve as free, and every relaunch would find one reserve more room than the
        last (a ratchet to out-of-memory).
        """
        # Only this node's leases count (`with_unmeasured`, `Ledger.of`): only they are read.
        assumed = other_leases(self.snap, self.key, assumed_only=True, node=node)
        others = other_leases(self.snap, self.key, node=node)
        measured = with_unmeasured(board, assumed)
        reserve = self.engine.spec.reserve_bytes
        mine = [
            Lease(self.me, ConsumerKind.ENGINE, node, x["pool"], max(0, x["bytes"] - reserve))
            for x in placement.get("pools", [])
        ]
        ledger = Ledger.of(measured, [*others, *mine])
        return plan(
            measured,
            self.engine.spec,
            self.facts,
            ledger,
            crediting=self.me,
            receipts=self.receipts(),
            llama_build=self.llama_build(),
            on_gpus=on_gpus,
        )

    def follow_gpus(
        self, board: Board, plan_doc: dict[str, Any], placement: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The plan and lease of a running engine with its device charges moved to the GPUs
        its processes use, where its board says they are not the charged ones
        (`core.gpu_check`); as they were otherwise (no attribution, as charged, incomplete).
        The same launch: nothing relaunches (docs/operator.md, "The GPU charged is the GPU in
        use")."""
        gpu = gpu_check.check(
            [int(g) for g in plan_doc.get("gpus") or ()],
            board.gpus_in_use.get(self.me, ()),
            _memory_mode(plan_doc),
        )
        if gpu.verdict is not gpu_check.GpuVerdict.ELSEWHERE:
            return plan_doc, placement

        def moved(parts: Any) -> list[dict[str, Any]]:
            pairs = [(str(x["pool"]), int(x["bytes"])) for x in parts or ()]
            return [{"pool": p, "bytes": n} for p, n in gpu_check.moved_charges(pairs, gpu)]

        plan_doc = {**plan_doc, "gpus": list(gpu.in_use), "charges": moved(plan_doc.get("charges"))}
        was = self.new.get("placement") or placement
        placement = {**was, "gpus": list(gpu.in_use), "pools": moved(was.get("pools"))}
        self.new["plan"], self.new["placement"] = plan_doc, placement
        self.events.append(Event("Warning", "GpuMismatch", gpu.message()))
        return plan_doc, placement

    def receipts(self) -> tuple[Receipt, ...]:
        """The receipts of this Engine's model: its runtime's, and the one its plan used."""
        return runtime_report.receipts_of(self.status, self.engine.spec.model.sha256)

    def llama_build(self) -> str | None:
        """The llama.cpp build the engine's image runs, as its runtime last reported it; None
        (any build's receipt) before it has reported."""
        runtime = self.status.get("runtime") or {}
        build = runtime.get("llamaBuild") if isinstance(runtime, Mapping) else None
        return str(build) if build else None

    def recharge(self, candidate: ServingPlan, placement: Mapping[str, Any]) -> dict[str, Any]:
        """The running launch's plan and lease re-written with `candidate`'s bytes (the same
        arguments): the placement keeps whether it is assumed and since when."""
        plan_doc = _stamped(candidate, self.generation)
        self.new["plan"] = plan_doc
        pools = _placement_doc(candidate, self.now)["pools"]
        kept = self.new.get("placement") or placement
        self.new["placement"] = {**kept, "pools": pools}
        source = "receipt" if candidate.receipt is not None else "estimate"
        self.events.append(
            Event(
                "Normal",
                "Recharged",
                f"the running launch re-charged from its {source}: "
                + ", ".join(f"{pool} {_size(n)}" for pool, n in candidate.charges),
            )
        )
        return plan_doc

    def release_never_started(self, node: str) -> None:
        placement = self.settings.placement
        self.backoff[node] = self.now + placement.backoff_seconds
        self.events.append(
            Event(
                "Warning",
                str(cond.Reason.POD_NEVER_STARTED),
                f"the engine pod on {node} was not ready within "
                f"{placement.pod_start_timeout_seconds:.0f} s; lease released, "
                f"{node} skipped for {placement.backoff_seconds:.0f} s",
            )
        )
        self.new["placement"] = None
        self.new["plan"] = None
        self.damper = replace(self.damper, candidate=None, readings=0, last_reading=None)

    def release_node_gone(self, node: str) -> None:
        self.events.append(
            Event(
                "Warning",
                "NodeGone",
                f"node {node} was deleted under the engine; lease released, placing it anew",
            )
        )
        self.new["placement"] = None
        self.new["plan"] = None
        self.node_gone_since = None
        self.damper = replace(self.damper, candidate=None, readings=0, last_reading=None)

    # -- an engine to place ----------------------------------------------------------------

    def place(self) -> Writes:
        """Best fit among the nodes with fresh boards, as an assumed lease; or why none."""
        snap, engine = self.snap, self.engine
        assumed: dict[str, list[Lease]] = defaultdict(list)
        for lease in other_leases(snap, self.key, assumed_only=True):
            assumed[lease.node].append(lease)  # by node: each board reads its own
        views = [
            NodeView(
                board=with_unmeasured(entry.board, assumed.get(name, ())),
                fresh=is_fresh(snap, name, self.now, self.ttl),
                labels=snap.nodes[name].labels if name in snap.nodes else {},
                node_exists=name in snap.nodes,
                backing_off=name in self.backoff,
            )
            for name, entry in snap.boards.items()
            if entry.board is not None
        ]
        decision = choose(
            views, engine.spec, self.facts, other_leases(snap, self.key), receipts=self.receipts()
        )
        if decision.chosen is None:
            f = cond.EngineFacts(generation=self.generation, unschedulable=_unschedulable(decision))
            for part in ("plan", "placement"):
                if self.status.get(part) is not None:
                    self.new[part] = None
            return self.finish(f, engine, None)
        chosen = decision.chosen
        plan_doc = _stamped(chosen, self.generation)
        self.new["plan"] = plan_doc
        self.new["placement"] = _placement_doc(chosen, self.now)
        self.events.append(
            Event(
                "Normal",
                "Placed",
                f"assumed a lease on {chosen.node}: "
                + ", ".join(f"{pool} {_size(n)}" for pool, n in chosen.charges)
                + f"; {chosen.layers_on_device}/{chosen.total_layers} layers on device, "
                f"{chosen.minds_grantable} minds",
            )
        )
        node_entry = snap.nodes.get(chosen.node)
        f = cond.EngineFacts(
            generation=self.generation,
            planned=_planned(plan_doc, engine),
            pod=cond.PodPhase.PENDING,
        )
        self.damper = replace(self.damper, candidate=None, readings=0, last_reading=None)
        return self.finish(
            f,
            engine,
            plan_doc,
            bool(node_entry and node_entry.gpus_allocatable > 0),
            pods_on(snap, chosen.node, self.settings),
        )


def _bytes_moved(candidate: ServingPlan, was: Mapping[str, Any]) -> bool:
    """Whether a plan of the same arguments holds other bytes than the plan in force: only a
    receipt found (or lost) moves them; budgets and reasons move with every board reading and
    are not worth a write."""
    doc = candidate.to_dict()
    return bool(doc["bytes"] != was.get("bytes") or doc["charges"] != was.get("charges"))


def _change(node: str, candidate: ServingPlan, was: Mapping[str, Any]) -> str:
    old_args = " ".join(_shape(was).args)
    return (
        f"plan changed on {node}: {candidate.layers_on_device}/"
        f"{candidate.total_layers} layers, {candidate.minds_grantable} minds, "
        f"{candidate.pool_tokens} pool tokens (was "
        f"{was.get('layersOnDevice')}/{was.get('totalLayers')} "
        f"layers, {was.get('mindsGrantable')} minds; args {old_args})"
    )
