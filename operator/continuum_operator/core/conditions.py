"""An Engine's conditions, made from what the operator knows about it in one pass.

Conditions are a list keyed by type and written whole by their one writer, the operator
(docs/design.md "One writer per status field"). This module decides them from plain values: the
operator's shell gathers an `EngineFacts`, `engine_conditions` turns it into conditions, and
`merge` keeps each condition's `lastTransitionTime` while its status holds. Types and reasons are
enums, never scattered strings. Pure: the time is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from continuum_operator.core.damping import Outcome
from continuum_operator.model.base import Condition
from continuum_operator.model.board import MemoryMode


class ConditionType(StrEnum):
    PLANNED = "Planned"
    READY = "Ready"
    DEGRADED = "Degraded"
    MEMORY_MODE_UNKNOWN = "MemoryModeUnknown"
    BOARD_STALE = "BoardStale"
    UNSCHEDULABLE = "Unschedulable"
    RECEIPT_REFUSED = "ReceiptRefused"
    PLAN_HELD = "PlanHeld"


class Reason(StrEnum):
    # Planned
    PLANNED = "Planned"
    INVALID_SPEC = "InvalidSpec"
    FACTS_MISSING = "FactsMissing"
    FACTS_PENDING = "FactsPending"
    NOT_PLACED = "NotPlaced"
    # Unschedulable
    PLACED = "Placed"
    NO_BOARDS = "NoBoards"
    NO_MATCHING_NODE = "NoMatchingNode"
    NO_FRESH_BOARD = "NoFreshBoard"
    INSUFFICIENT_MEMORY = "InsufficientMemory"
    POD_NEVER_STARTED = "PodNeverStarted"
    # Ready
    POD_READY = "PodReady"
    POD_PENDING = "PodPending"
    RELAUNCHING = "Relaunching"
    MODEL_DIGEST_MISMATCH = "ModelDigestMismatch"
    ENGINE_STOPPED = "EngineStopped"
    # Degraded
    AS_PLANNED = "AsPlanned"
    MINDS_LIMITED = "MindsLimited"
    LAYERS_LIMITED = "LayersLimited"
    RELAUNCH_DEFERRED = "RelaunchDeferred"
    NO_LONGER_FITS = "PlanNoLongerFits"
    ENGINE_RESTARTED = "EngineRestarted"
    # MemoryModeUnknown / BoardStale
    MODE_REPORTED = "MemoryModeReported"
    MODE_UNKNOWN = "NoMemoryModeReported"
    BOARD_FRESH = "LeaseRenewed"
    LEASE_EXPIRED = "LeaseExpired"
    # ReceiptRefused
    RECEIPTS_ACCEPTED = "ReceiptsAccepted"
    RECEIPT_NOT_PLANNED_FROM = "ReceiptNotPlannedFrom"
    # PlanHeld
    CODE_CHANGED = "CodeChanged"
    PLAN_IN_FORCE = "PlanInForce"


class PodPhase(StrEnum):
    NONE = "None"
    PENDING = "Pending"
    READY = "Ready"
    RELAUNCHING = "Relaunching"


@dataclass(frozen=True, slots=True)
class Problem:
    reason: Reason
    message: str


@dataclass(frozen=True, slots=True)
class RuntimeReport:
    """What the engine runtime of the current launch reports (`status.runtime`), as far as
    the conditions read it."""

    refused: Problem | None = None
    """It does not serve and will not by itself: the model's digest, or restarts exhausted."""
    restarted: str = ""
    """llama-server exited within the restart window: how often, and its last error line."""


@dataclass(frozen=True, slots=True)
class PlannedEngine:
    """The plan in force, as far as the conditions read it."""

    node: str
    memory_mode: str  # a `MemoryMode` (its value, where a caller holds only the plan's text)
    layers_on_device: int
    total_layers: int
    minds_grantable: int
    minds_max: int
    gpu_servable: bool


@dataclass(frozen=True, slots=True)
class EngineFacts:
    generation: int | None
    problem: Problem | None = None
    """The spec cannot be planned at all (invalid, or no model facts)."""
    unschedulable: Problem | None = None
    """No node takes it; the message says why, node by node."""
    planned: PlannedEngine | None = None
    board_fresh: bool = True
    pod: PodPhase = PodPhase.NONE
    damping: Outcome | None = None
    damping_message: str = ""
    no_longer_fits: str = ""
    """Its own node's board, read again, no longer holds even the smallest plan: why."""
    runtime: RuntimeReport = RuntimeReport()
    receipts_refused: tuple[str, ...] = ()
    """Receipts found for the launch in force and not planned from (another launch's, or
    beyond the bound of the estimate): why, each."""
    plan_held: str = ""
    """A new plan, on a node that reads as it did, held from relaunching the engine: why."""


def planned_message(node: str, layers_on_device: int, total_layers: int, minds: int) -> str:
    """The Planned condition's message for a plan in force (`continuum place` prints it too)."""
    return f"{layers_on_device}/{total_layers} layers on the device of {node}, {minds} minds"


#: One condition decided: its status, reason and message. `engine_conditions` gives each its
#: type and the generation, which are the same whatever the condition decides.
_Verdict = tuple[bool, Reason, str]


def engine_conditions(f: EngineFacts) -> list[Condition]:
    """Every condition type, always present, in a fixed order."""
    # A refusal belongs to the launch of a plan in force; without one there is nothing it refused.
    refused = f.runtime.refused if f.planned is not None else None
    T = ConditionType
    verdicts = (
        (T.PLANNED, _planned(f)),
        (T.READY, _ready(f, refused)),
        (T.DEGRADED, _degraded(f, refused)),
        (T.MEMORY_MODE_UNKNOWN, _memory_mode_unknown(f)),
        (T.BOARD_STALE, _board_stale(f)),
        (T.UNSCHEDULABLE, _unschedulable(f)),
        (T.RECEIPT_REFUSED, _receipt_refused(f)),
        (T.PLAN_HELD, _plan_held(f)),
    )
    return [
        Condition(
            type=str(t),
            status="True" if status else "False",
            reason=str(reason),
            message=message,
            observed_generation=f.generation,
        )
        for t, (status, reason, message) in verdicts
    ]


def _planned(f: EngineFacts) -> _Verdict:
    p = f.planned
    if f.problem is not None:
        return False, f.problem.reason, f.problem.message
    if p is None:
        return False, Reason.NOT_PLACED, "no node takes this engine yet"
    message = planned_message(p.node, p.layers_on_device, p.total_layers, p.minds_grantable)
    return True, Reason.PLANNED, message


def _ready(f: EngineFacts, refused: Problem | None) -> _Verdict:
    if refused is not None:
        return False, refused.reason, refused.message
    if f.pod is PodPhase.READY:
        return True, Reason.POD_READY, "the engine pod is ready"
    if f.pod is PodPhase.RELAUNCHING:
        return False, Reason.RELAUNCHING, "the engine is relaunching"
    if f.pod is PodPhase.PENDING:
        return False, Reason.POD_PENDING, "the engine pod has not started yet"
    why = f.problem or f.unschedulable
    if why is None:
        return False, Reason.NOT_PLACED, "not placed yet"
    return False, why.reason, why.message


def _degraded(f: EngineFacts, refused: Problem | None) -> _Verdict:
    """The first of the reasons, most severe first, why the engine serves less than asked."""
    p = f.planned
    if refused is not None:
        return True, refused.reason, refused.message
    if p is None:
        return False, Reason.AS_PLANNED, ""
    if f.runtime.restarted:
        return True, Reason.ENGINE_RESTARTED, f.runtime.restarted
    if not f.board_fresh:
        return (
            True,
            Reason.LEASE_EXPIRED,
            f"the board of {p.node} is stale: the engine keeps its plan, nothing re-plans there",
        )
    if f.no_longer_fits:
        return (
            True,
            Reason.NO_LONGER_FITS,
            f"{p.node} no longer holds this engine as planned: {f.no_longer_fits}",
        )
    if f.damping in (Outcome.GATHERING_EVIDENCE, Outcome.COOLING_DOWN):
        return True, Reason.RELAUNCH_DEFERRED, f.damping_message
    if p.minds_grantable < p.minds_max:
        message = f"{p.minds_grantable} of {p.minds_max} minds fit on {p.node}"
        return True, Reason.MINDS_LIMITED, message
    if p.layers_on_device < p.total_layers and p.memory_mode != MemoryMode.UNKNOWN:
        message = f"{p.layers_on_device}/{p.total_layers} layers fit on the device of {p.node}"
        return True, Reason.LAYERS_LIMITED, message
    return False, Reason.AS_PLANNED, ""


def _memory_mode_unknown(f: EngineFacts) -> _Verdict:
    p = f.planned
    if p is not None and p.memory_mode == MemoryMode.UNKNOWN:
        return (
            True,
            Reason.MODE_UNKNOWN,
            f"node {p.node} reports no memory mode: host memory is governed, device memory "
            "is not; declare spec.placement.deviceBudgetBytes or run the agent with a GPU "
            "backend",
        )
    return False, Reason.MODE_REPORTED, ""


def _board_stale(f: EngineFacts) -> _Verdict:
    p = f.planned
    if p is not None and not f.board_fresh:
        message = f"node {p.node}'s Lease has expired: no new plans or relaunches there"
        return True, Reason.LEASE_EXPIRED, message
    return False, Reason.BOARD_FRESH, ""


def _unschedulable(f: EngineFacts) -> _Verdict:
    p = f.planned
    if f.unschedulable is not None and p is None:
        return True, f.unschedulable.reason, f.unschedulable.message
    return False, Reason.PLACED if p else Reason.NOT_PLACED, ""


def _receipt_refused(f: EngineFacts) -> _Verdict:
    if not f.receipts_refused:
        return False, Reason.RECEIPTS_ACCEPTED, ""
    more = len(f.receipts_refused) - 1
    message = f.receipts_refused[0] + (f" (and {more} more)" if more else "")
    return True, Reason.RECEIPT_NOT_PLANNED_FROM, message[:2000]


def _plan_held(f: EngineFacts) -> _Verdict:
    if f.plan_held:
        return True, Reason.CODE_CHANGED, f.plan_held
    return False, Reason.PLAN_IN_FORCE, ""


def merge(old: Sequence[Condition], new: Sequence[Condition], now: str) -> list[Condition]:
    """New conditions with `lastTransitionTime` kept where the status did not change."""
    before = {c.type: c for c in old}
    merged: list[Condition] = []
    for c in new:
        prior = before.get(c.type)
        since = (
            prior.last_transition_time
            if prior is not None and prior.status == c.status and prior.last_transition_time
            else now
        )
        merged.append(c.model_copy(update={"last_transition_time": since}))
    return merged


def transitions(old: Sequence[Condition], new: Sequence[Condition]) -> list[Condition]:
    """Conditions whose status or reason changed: what deserves an event."""
    before = {c.type: (c.status, c.reason) for c in old}
    return [c for c in new if before.get(c.type) != (c.status, c.reason)]
