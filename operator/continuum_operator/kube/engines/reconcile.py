"""One reconcile pass of one Engine: from a snapshot to the writes it needs. No API calls.

Kueue's cycle, for one engine: read the snapshot (`kube.state.cache`), decide with the pure core
(`core.bestfit` to place, `core.plan` to re-plan, `core.damping` to weigh a relaunch,
`core.conditions` for what status says), and return the writes: a status patch (only the parts
that changed, None when nothing did), the Deployment and Service wanted (or none), and events.
`kube.engines.loop` applies them. The clock and the operator's memory of each engine (its damper,
nodes it backs off from) are passed in. Neighbours: `kube.engines.engine_pass` (a pass's state, and
how every pass ends), `kube.engines.placed` (an engine already placed); an engine to place is here.

The rules kept here and in `kube.engines.placed` (docs/design.md "Placement", "One writer per
status field"):
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
from dataclasses import replace
from typing import Any

from continuum_operator.core import conditions as cond
from continuum_operator.core import unfit
from continuum_operator.core.bestfit import Decision, NodeView, choose, with_unmeasured
from continuum_operator.core.pools import Lease
from continuum_operator.core.replan import engine_reading
from continuum_operator.kube.base.settings import GpuSharing, OperatorSettings, resolve_sharing
from continuum_operator.kube.engines.engine_pass import (
    EnginePass,
    Event,
    Memory,
    Writes,
    placement_status,
    plan_status,
    planned_engine,
    pods_on,
    size_text,
)
from continuum_operator.kube.engines.placed import placed
from continuum_operator.kube.ledger.cached import engine_only
from continuum_operator.kube.state.cache import EngineKey, Snapshot
from continuum_operator.kube.state.occupancy import (
    lease_is_fresh,
    other_leases,
    other_leases_and_assumed,
)
from continuum_operator.kube.workloads import engine_objects, facts_job
from continuum_operator.kube.workloads.gpu_env import gpu_sharing_refusal
from continuum_operator.manifests import ManifestError, parse
from continuum_operator.model.engine import Engine, ModelFacts
from continuum_operator.model.json_body import object_at

__all__ = ["facts_disagreements", "reconcile"]


def _unschedulable(decision: Decision) -> cond.Problem:
    """Why no node takes it, in counts and the closest node (`core.unfit`: `continuum place`
    prints the same message)."""
    return unfit.explain(decision)


def _facts_from_file(
    engine: Engine,
    status: Mapping[str, object],
    snap: Snapshot,
    memory: Memory,
    key: EngineKey,
    uid: str,
    settings: OperatorSettings,
) -> tuple[ModelFacts | None, cond.Problem | None, dict[str, Any] | None]:
    """Facts read from the model's file: from status, or a Job to read them (docs/design.md)."""
    source = facts_job.source_key(engine)
    read = object_at(status, "modelFacts")
    if read and read.get("source") == source:
        try:
            return ModelFacts.model_validate(read.get("facts")), None, None
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


def _short(value: object) -> str:
    text = str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _validated(p: EnginePass, body: Mapping[str, object]) -> Engine:
    """The Engine of this body: validated, unless the last pass validated this same object."""
    if p.parsed is not None and p.parsed[0] is body:
        return p.parsed[1]
    engine = parse(Engine, engine_only(body), f"Engine {p.key[0]}/{p.key[1]}")
    p.parsed = (body, engine)
    return engine


def reconcile(
    body: Mapping[str, object],
    snap: Snapshot,
    memory: Memory,
    now: float,
    settings: OperatorSettings,
) -> Writes:
    """The writes one pass over one Engine needs (`Writes.status_patch` None: nothing changed)."""
    p = EnginePass(body, snap, memory, now, settings)
    try:
        engine = _validated(p, body)
    except ManifestError as err:
        problem = cond.Problem(cond.Reason.INVALID_SPEC, f"{err.field}: {err.problem}")
        return p.finish(replace(p.facts_in, problem=problem), None, None)
    refused = engine_objects.host_path_refusal(engine.spec.model, settings.pods)
    if refused is not None:
        problem = cond.Problem(cond.Reason.INVALID_SPEC, f"spec.model.source.path: {refused}")
        return p.finish(replace(p.facts_in, problem=problem), None, None)
    refused = gpu_sharing_refusal(engine.spec.placement.gpus, settings.pods)
    if refused is not None:
        problem = cond.Problem(cond.Reason.INVALID_SPEC, f"spec.placement.gpus: {refused}")
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
    placement, plan = engine.status.placement, engine.status.plan
    if placement is not None and plan is not None:
        kept = placed(p, placement, plan)
        if kept is not None:
            return kept
    return _place(p)


def _views(p: EnginePass, assumed: Mapping[str, list[Lease]]) -> list[NodeView]:
    """Every node with a board, as this engine's placement weighs it. Built for each board at
    each engine placed (hundreds of thousands at scale): what is the same for every board is
    read once, and a board with no assumed lease on it is taken as it is."""
    snap, now, ttl, backoff = p.snap, p.now, p.ttl, p.backoff
    nodes, leases = snap.nodes, snap.leases
    sharing = p.settings.pods.gpu_sharing
    # `auto` resolves per node: MPS on this one refuses a pod several GPUs.
    mps_everywhere = sharing is GpuSharing.MPS if sharing is not GpuSharing.AUTO else None
    views: list[NodeView] = []
    for name, entry in snap.boards.items():
        board = entry.board
        if board is None:
            continue
        node = nodes.get(name)
        on_it = assumed.get(name)
        views.append(
            NodeView(
                board=with_unmeasured(board, on_it) if on_it else board,
                fresh=lease_is_fresh(leases.get(name), now, ttl),
                labels=node.labels if node is not None else {},
                node_exists=node is not None,
                backing_off=name in backoff,
                mps_shared=mps_everywhere
                if mps_everywhere is not None
                else resolve_sharing(sharing, entry.cap_mechanisms) is GpuSharing.MPS,
            )
        )
    return views


def _place(p: EnginePass) -> Writes:
    """Best fit among the nodes with fresh boards, as an assumed lease; or why none."""
    snap, engine = p.snap, p.engine
    others, not_started = other_leases_and_assumed(snap, p.key)
    assumed: dict[str, list[Lease]] = defaultdict(list)
    for lease in not_started:
        assumed[lease.node].append(lease)  # by node: each board reads its own
    views = _views(p, assumed)
    decision = choose(views, engine.spec, p.facts, others, receipts=p.receipts())
    if decision.chosen is None:
        f = cond.EngineFacts(generation=p.generation, unschedulable=_unschedulable(decision))
        for part in ("plan", "placement"):
            if p.status.get(part) is not None:
                p.new[part] = None
        return p.finish(f, engine, None)
    chosen = decision.chosen
    board = snap.boards[chosen.node].board
    assert board is not None  # only boards that validate are weighed
    others = other_leases(snap, p.key, node=chosen.node)
    reading = engine_reading(board, engine.spec, p.facts, others, p.receipts(), p.llama_build())
    plan = p.write_plan(plan_status(chosen, p.generation, reading))
    p.write_placement(placement_status(chosen, p.now))
    p.events.append(
        Event(
            "Normal",
            "Placed",
            f"assumed a lease on {chosen.node}: "
            + ", ".join(f"{pool} {size_text(n)}" for pool, n in chosen.charges)
            + f"; {chosen.layers_on_device}/{chosen.total_layers} layers on device, "
            f"{chosen.minds_grantable} minds",
        )
    )
    node_entry = snap.nodes.get(chosen.node)
    f = cond.EngineFacts(
        generation=p.generation,
        planned=planned_engine(plan, engine),
        pod=cond.PodPhase.PENDING,
    )
    p.damper = replace(p.damper, candidate=None, readings=0, last_reading=None)
    return p.finish(
        f,
        engine,
        plan,
        bool(node_entry and node_entry.gpus_allocatable > 0),
        pods_on(snap, chosen.node, p.settings),
    )
