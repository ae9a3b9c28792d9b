"""An Engine already placed, in one pass (`kube.engines.reconcile`): kept, confirmed once its pod is
ready, re-planned on its own node crediting its own lease, relaunched only when the damper says
so, or released to be placed anew (its pod never started, its Node is gone, its changed spec no
longer fits there). Nothing is planned on a stale board (docs/design.md "Placement"). No API
calls. Neighbours: `kube.engines.engine_pass` (the pass, and how it ends), `core.damping` (the
damper), `core.gpu_check` (the GPUs in use).
"""

from __future__ import annotations

from dataclasses import replace

from continuum_operator.core import conditions as cond
from continuum_operator.core import gpu_check
from continuum_operator.core.bestfit import matches
from continuum_operator.core.damping import Damper, Observation, Outcome, PlanShape, step
from continuum_operator.core.plan import ServingPlan, vet_receipts
from continuum_operator.core.pools import Board
from continuum_operator.core.replan import (
    ACCEPT_ANNOTATION,
    HoldVerdict,
    Replayed,
    held_message,
    hold_verdict,
    plan_id,
    replan,
)
from continuum_operator.core.rfc3339 import parse as parse_rfc3339
from continuum_operator.kube.base.settings import GpuClaims, OperatorSettings
from continuum_operator.kube.engines import runtime_report
from continuum_operator.kube.engines.engine_pass import (
    EnginePass,
    Event,
    Writes,
    placement_status,
    plan_status,
    planned_engine,
    pods_on,
    size_text,
)
from continuum_operator.kube.state.cache import Snapshot
from continuum_operator.kube.state.occupancy import is_fresh, other_leases
from continuum_operator.kube.workloads import engine_objects
from continuum_operator.model.engine import EnginePlacement
from continuum_operator.model.plan_status import EnginePoolBytes, PlanStatus

__all__ = ["NODE_GONE_HOLD_SECONDS", "placed"]

#: Seconds an engine's Node must stay missing from the cache before its placement is released.
#: Nodes and Engines arrive by separate watches, so right after a start an Engine may be seen
#: before its Node is: a hold of a few passes keeps a restart from releasing every placement.
NODE_GONE_HOLD_SECONDS = 10.0


def placed(p: EnginePass, placement: EnginePlacement, plan: PlanStatus) -> Writes | None:
    """Keep, confirm, re-plan or relaunch a placed engine; None when it must be placed anew."""
    snap, now, settings, engine = p.snap, p.now, p.settings, p.engine
    node = placement.node
    node_entry = snap.nodes.get(node)
    if node_entry is None and _node_gone_long_enough(p, node):
        return None
    has_gpus = bool(node_entry and node_entry.gpus_allocatable > 0)
    pods = pods_on(snap, node, settings)
    launch = p.launch = engine_objects.launch_hash(engine, plan, pods)
    dep = snap.deployments.get(p.key)
    running = dep is not None and dep.running(launch)
    assumed_at = parse_rfc3339(placement.assumed_at)
    if (
        placement.assumed
        and not running
        and assumed_at is not None
        and now - assumed_at > settings.placement.pod_start_timeout_seconds
    ):
        _release_never_started(p, node)
        return None
    if running and placement.assumed:
        placement = p.write_placement(placement.model_copy(update={"assumed": False}))
    fresh = is_fresh(snap, node, now, p.ttl)
    board = snap.boards.get(node)
    outcome: Outcome | None = None
    no_longer_fits = ""
    # A plan records the spec generation it was made for; older plans have none.
    spec_changed = plan.spec_generation not in (None, p.generation)
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
        plan, placement = _follow_gpus(p, board.board, plan, placement)
    if fresh and board is not None and board.board is not None:
        weighed = _weigh(p, node, board.board, placement, plan, running, spec_changed)
        if weighed is None:
            return None
        plan, running, outcome, no_longer_fits = weighed
    pod = (
        cond.PodPhase.READY
        if running
        else cond.PodPhase.RELAUNCHING
        if (dep is not None and dep.launch not in (None, launch)) or outcome is Outcome.RELAUNCH
        else cond.PodPhase.PENDING
    )
    # What the runtime of the launch in force reports (a refused model, a crash loop).
    current = runtime_report.current_runtime(
        p.status, engine_objects.launch_hash(engine, plan, pods)
    )
    f = cond.EngineFacts(
        generation=p.generation,
        planned=planned_engine(plan, engine),
        board_fresh=fresh,
        pod=pod,
        damping=outcome,
        no_longer_fits=no_longer_fits,
        damping_message=_damping_message(outcome, p.damper, settings) if outcome else "",
        runtime=runtime_report.runtime_report(current, now, settings.pods.restart_window_seconds),
        receipts_refused=_receipts_refused(p),
        plan_held=p.held,
    )
    writes = p.finish(f, engine, plan, has_gpus, pods)
    return replace(writes, deployment=None) if held else writes


def _receipts_refused(p: EnginePass) -> tuple[str, ...]:
    """Why receipts found for the launch in force are not planned from: another launch's
    (`runtime_report`), or beyond the bound of the estimate (`core.receipt_bounds`)."""
    evidence = p.evidence()
    _, beyond = vet_receipts(p.engine.spec, p.facts, evidence.receipts, p.llama_build())
    return (*evidence.set_aside, *(r.message for r in beyond))


def _node_gone_long_enough(p: EnginePass, node: str) -> bool:
    """The Node was deleted under the engine: its pod cannot run there again. Once that has
    held a while, the lease is released (True: the engine is placed anew)."""
    since = p.memory.node_gone_since
    p.node_gone_since = since = p.now if since is None else since
    if p.now - since < NODE_GONE_HOLD_SECONDS:
        return False
    _release_node_gone(p, node)
    return True


def _weigh(
    p: EnginePass,
    node: str,
    board: Board,
    placement: EnginePlacement,
    plan: PlanStatus,
    running: bool,
    spec_changed: bool,
) -> tuple[PlanStatus, bool, Outcome | None, str] | None:
    """A placed engine against its fresh board: the plan in force, whether its pod still
    runs, what the damper decided and why it no longer fits (if so); None when it must be
    placed anew (its spec changed and this node no longer takes it)."""
    snap, engine = p.snap, p.engine
    outcome: Outcome | None = None
    no_longer_fits = ""
    node_entry = snap.nodes.get(node)
    kept = () if spec_changed else plan.gpus
    replayed = _replan(p, node, board, placement, kept)
    candidate = replayed.plan
    labels = node_entry.labels if node_entry is not None else {}
    if spec_changed and (not candidate.schedulable or matches(engine.spec, labels) is not None):
        p.events.append(
            Event(
                "Normal",
                "Replacing",
                f"spec changed (generation {p.generation}): {node} no longer takes "
                "this engine; placing it anew",
            )
        )
        p.new["placement"] = None
        p.new["plan"] = None
        return None
    if spec_changed:
        # What the user asked for is not damped: relaunch now if the arguments moved.
        if candidate.engine_args != plan.engine_args:
            plan = _relaunch_now(
                p,
                replayed,
                f"spec changed (generation {p.generation}): "
                f"{candidate.layers_on_device}/{candidate.total_layers} layers, "
                f"{candidate.minds_grantable} minds, {candidate.pool_tokens} pool tokens",
            )
            running, outcome = False, Outcome.RELAUNCH
        else:
            plan = p.write_plan(plan_status(candidate, p.generation, replayed.reading))
    elif not candidate.schedulable:
        # Not moved elsewhere (yet): said, so a person can act.
        no_longer_fits = candidate.reasons[-1].message if candidate.reasons else ""
    else:
        plan, running, outcome = _weigh_same_spec(p, node, placement, plan, replayed, running)
    return plan, running, outcome, no_longer_fits


def _weigh_same_spec(
    p: EnginePass,
    node: str,
    placement: EnginePlacement,
    plan: PlanStatus,
    replayed: Replayed,
    running: bool,
) -> tuple[PlanStatus, bool, Outcome | None]:
    """A schedulable re-plan of an engine whose spec did not change: held where its node reads
    as it did (a change of code: `core.replan`), applied where a person accepted it, else
    weighed by the damper; the plan in force records each reading it is confirmed on."""
    candidate, reading = replayed.plan, replayed.reading
    recorded = plan.reading
    verdict = (
        hold_verdict(
            plan.engine_args,
            candidate,
            recorded,
            reading,
            p.annotations.get(ACCEPT_ANNOTATION),
        )
        if running
        else HoldVerdict.NONE
    )
    if verdict is HoldVerdict.HELD:
        p.held = held_message(f"{p.key[0]}/{p.key[1]}", plan, candidate)
        p.damper = replace(p.damper, candidate=None, readings=0, last_reading=None)
        if recorded is None:  # a plan of an operator before this one: its reading is now's
            plan = p.write_plan(plan.model_copy(update={"reading": reading}))
        return plan, running, None
    if verdict is HoldVerdict.ACCEPTED:
        why = f"plan {plan_id(candidate.engine_args)} accepted ({ACCEPT_ANNOTATION}): "
        plan = _relaunch_now(p, replayed, why + _change(node, candidate, plan))
        return plan, False, Outcome.RELAUNCH
    p.damper, outcome = step(
        p.damper,
        Observation(
            now=p.now,
            reading=reading_of(p.snap, node),
            running=_shape(plan),
            candidate=PlanShape.of(candidate),
            in_flight=not running,
        ),
        p.settings.damping,
    )
    if outcome is Outcome.RELAUNCH:
        plan = p.relaunch(candidate, _change(node, candidate, plan), reading)
        running = False
    elif outcome is Outcome.UNCHANGED and _bytes_moved(candidate, plan):
        # The same launch, its bytes now measured (a receipt) or no longer: the
        # plan and the lease say what it holds; nothing relaunches for it.
        plan = _recharge(p, replayed, placement)
    elif outcome is Outcome.UNCHANGED and recorded != reading:
        # The plan in force, confirmed on the node as it reads now.
        plan = p.write_plan(plan.model_copy(update={"reading": reading}))
    return plan, running, outcome


def _relaunch_now(p: EnginePass, replayed: Replayed, why: str) -> PlanStatus:
    """Relaunch with `replayed`'s plan at once, undamped: what a person asked for (a spec
    changed, a held plan accepted)."""
    p.damper = replace(
        p.damper,
        candidate=None,
        readings=0,
        last_reading=None,
        relaunches=p.damper.relaunches + 1,
        last_relaunch_at=p.now,
    )
    return p.relaunch(replayed.plan, why, replayed.reading)


def _replan(
    p: EnginePass,
    node: str,
    board: Board,
    placement: EnginePlacement,
    on_gpus: tuple[int, ...] = (),
) -> Replayed:
    """The plan the engine would get on its own node now, crediting back what it holds, on
    the GPUs it runs on (`on_gpus`; none after a spec change: chosen again), and the reading of
    the node it was made from (`core.replan`)."""
    # Only this node's leases count (`with_unmeasured`, `BoardLeases.of`): only they are read.
    return replan(
        board,
        p.engine.spec,
        p.facts,
        p.me,
        [(x.pool, x.bytes) for x in placement.pools],
        other_leases(p.snap, p.key, node=node),
        other_leases(p.snap, p.key, assumed_only=True, node=node),
        receipts=p.receipts(),
        llama_build=p.llama_build(),
        on_gpus=on_gpus,
    )


def _follow_gpus(
    p: EnginePass, board: Board, plan: PlanStatus, placement: EnginePlacement
) -> tuple[PlanStatus, EnginePlacement]:
    """The plan and lease of a running engine with its device charges moved to the GPUs
    its processes use, where its board says they are not the charged ones
    (`core.gpu_check`); as they were otherwise (no attribution, as charged, incomplete).
    The same launch: nothing relaunches (docs/operator.md, "The GPU charged is the GPU in
    use")."""
    gpu = gpu_check.check(
        list(plan.gpus),
        board.gpus_in_use.get(p.me, ()),
        plan.memory_mode,
    )
    if gpu.verdict is not gpu_check.GpuVerdict.ELSEWHERE:
        return plan, placement
    charges = [(c.pool, c.bytes) for c in plan.charges]
    plan = plan.model_copy(
        update={
            "gpus": tuple(gpu.in_use),
            "charges": tuple(
                EnginePoolBytes(pool=pool, bytes=n)
                for pool, n in gpu_check.moved_charges(charges, gpu)
            ),
        }
    )
    pools = [(x.pool, x.bytes) for x in placement.pools]
    moved = [EnginePoolBytes(pool=pool, bytes=n) for pool, n in gpu_check.moved_charges(pools, gpu)]
    p.write_plan(plan)
    placement = p.write_placement(
        placement.model_copy(update={"gpus": list(gpu.in_use), "pools": moved})
    )
    p.events.append(Event("Warning", "GpuMismatch", gpu.message()))
    return plan, placement


def _recharge(p: EnginePass, replayed: Replayed, placement: EnginePlacement) -> PlanStatus:
    """The running launch's plan and lease re-written with the re-plan's bytes (the same
    arguments): the placement keeps whether it is assumed and since when."""
    candidate = replayed.plan
    plan = p.write_plan(plan_status(candidate, p.generation, replayed.reading))
    pools = placement_status(candidate, p.now).pools
    p.write_placement(placement.model_copy(update={"pools": pools}))
    source = "receipt" if candidate.receipt is not None else "estimate"
    p.events.append(
        Event(
            "Normal",
            "Recharged",
            f"the running launch re-charged from its {source}: "
            + ", ".join(f"{pool} {size_text(n)}" for pool, n in candidate.charges),
        )
    )
    return plan


def _release_never_started(p: EnginePass, node: str) -> None:
    placement = p.settings.placement
    p.backoff[node] = p.now + placement.backoff_seconds
    p.events.append(
        Event(
            "Warning",
            str(cond.Reason.POD_NEVER_STARTED),
            f"the engine pod on {node} was not ready within "
            f"{placement.pod_start_timeout_seconds:.0f} s; lease released, "
            f"{node} skipped for {placement.backoff_seconds:.0f} s",
        )
    )
    p.new["placement"] = None
    p.new["plan"] = None
    p.damper = replace(p.damper, candidate=None, readings=0, last_reading=None)


def _release_node_gone(p: EnginePass, node: str) -> None:
    p.events.append(
        Event(
            "Warning",
            "NodeGone",
            f"node {node} was deleted under the engine; lease released, placing it anew",
        )
    )
    p.new["placement"] = None
    p.new["plan"] = None
    p.node_gone_since = None
    p.damper = replace(p.damper, candidate=None, readings=0, last_reading=None)


def _bytes_moved(candidate: ServingPlan, was: PlanStatus) -> bool:
    """Whether a plan of the same arguments holds other bytes than the plan in force: only a
    receipt found (or lost) moves them; budgets and reasons move with every board reading and
    are not worth a write."""
    now = plan_status(candidate, None)
    return now.bytes != was.bytes or now.charges != was.charges


def _change(node: str, candidate: ServingPlan, was: PlanStatus) -> str:
    old_args = " ".join(was.engine_args)
    return (
        f"plan changed on {node}: {candidate.layers_on_device}/"
        f"{candidate.total_layers} layers, {candidate.minds_grantable} minds, "
        f"{candidate.pool_tokens} pool tokens (was "
        f"{was.layers_on_device}/{was.total_layers} "
        f"layers, {was.minds_grantable} minds; args {old_args})"
    )


def reading_of(snap: Snapshot, node: str) -> str:
    board = snap.boards.get(node)
    lease = snap.leases.get(node)
    return f"{board.resource_version if board else '-'}/{lease.resource_version if lease else '-'}"


def _shape(plan: PlanStatus) -> PlanShape:
    return PlanShape(
        args=plan.engine_args,
        layers_on_device=plan.layers_on_device,
        total_layers=plan.total_layers,
        pool_tokens=plan.pool_tokens,
    )


def _damping_message(outcome: Outcome, damper: Damper, settings: OperatorSettings) -> str:
    if outcome is Outcome.GATHERING_EVIDENCE:
        return (
            f"a new plan has held for {damper.readings} of "
            f"{settings.damping.readings_required} board readings; relaunching when it holds"
        )
    if outcome is Outcome.COOLING_DOWN:
        return f"a new plan waits out the {settings.damping.cooldown_seconds:.0f} s cooldown"
    return ""
