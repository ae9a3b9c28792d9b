"""An Engine's grant ledger as the API server holds it, read into the allocator and written back.

The ledger's one home is the Engine's GrantLedger, `status.grants` (docs/design.md "The grant ledger
has one home"), merged into the cached Engine body (`kube.ledger.cached`). This module is the
translation between that list of entries and the pure allocator (`core.grants`), with no API calls,
so each rule is shown in unit tests:

- `read_entries` / `read_grants` / `grant_entries`: stored entries -> `GrantEntry`s <->
  `Grant`s. An entry's fields, its parser and its writer are `model.grant` (the gateway parses
  the same entries; `GrantEntry.wire` is what is stored); here is the operator's policy on an
  entry it cannot read. Times the allocator compares are Unix seconds (floats
  survive the API server's JSON exactly); `since` is RFC 3339 with microseconds, and names one
  reclaim.
- `capacity_of`: the pool to allocate from, from the plan and the Ready condition the plan
  loop writes, and `status.grantCapacity` (what the ledger was last made for, written with it). An
  engine whose launch changed while minds still hold slots of the old one is `Draining`.
- `bounded` / `tail_from_log` / `tail_from_minds`: what the Engine object keeps of a long
  queue, and what a new leader reads back of the rest; `journal` (`kube.ledger.journal`): the
  step's log lines kept beside the ledger.

Which Engine each Mind goes to and with what demand is `kube.ledger.routing`; a Mind's status from
her entry, `kube.grants.mind_status`.

Neighbours: `kube.grants.loop` (reads the cache, calls `step`, writes), `core.grants`,
`model.grant`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from continuum_operator.core import conditions as cond
from continuum_operator.core import rfc3339
from continuum_operator.core.grants import (
    REFUSALS,
    Capacity,
    EnginePhase,
    Grant,
    GrantPolicy,
    GrantReason,
    MindDemand,
    Transition,
    allocate,
)
from continuum_operator.core.transition_lines import capacity_line, transition_line
from continuum_operator.kube.client.body import bodies
from continuum_operator.kube.ledger.routing import mind_key
from continuum_operator.kube.ledger.transition_log import Place
from continuum_operator.model.grant import GrantEntry, grant_entries, iso_micro, parse_entries
from continuum_operator.model.grant_ledger import GrantQueue
from continuum_operator.model.json_body import integer, items_at, object_at, text
from continuum_operator.model.mind import HOLDING_STATES, GrantState, ProjectedState

__all__ = [
    "CAPACITY_FIELD",
    "LEDGER_FIELDS",
    "QUEUE_FIELD",
    "QUEUE_KEPT",
    "REFUSED_KEPT",
    "STEP_FIELD",
    "LedgerStep",
    "bounded",
    "capacity_of",
    "engine_note",
    "idle_of",
    "log_lines",
    "queue_doc",
    "read_entries",
    "read_grants",
    "released_of",
    "step",
    "tail_from_log",
    "tail_from_minds",
]

#: Beside `status.grants`, written in the same replace: the pool the ledger was made for.
CAPACITY_FIELD = "grantCapacity"
#: Beside `status.grants`, written in the same replace: the last step's log lines, so a leader
#: that died between the ledger write and the log append has its step logged by the next one.
STEP_FIELD = "grantStep"
#: Beside `status.grants`, only when entries were left out of it: how many minds are queued and
#: refused in all, and how many of each the object keeps (docs/grants.md, "Bounded").
QUEUE_FIELD = "grantQueue"

# The Engine object holds every holder, the head of the queue and the first refusals, and its
# journal the lines of those minds only; the rest of a long queue is each Mind's own (her
# `status.grant`, as Kueue keeps a pending Workload's state on the Workload) and the log's. The
# numbers bound the object whatever the number of minds: 320 entries of about 200 bytes and
# their journal lines (a few each a step, about 260 bytes a line) beside one entry per slot,
# under etcd's 1.5 MiB request limit.
QUEUE_KEPT = 256
REFUSED_KEPT = 64


def _parse_time(value: object) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return rfc3339.parse(value)


# --- entries -> grants ------------------------------------------------------------------------


def read_entries(raw: object) -> list[GrantEntry]:
    """The entries of `status.grants` as stored. The operator's policy on an entry it cannot
    read (`model.grant.parse_entries`): skip it, and decide the step from the rest (the mind's
    next demand brings her back)."""
    if not isinstance(raw, list):
        return []
    entries, _ = parse_entries(raw)
    return entries


def read_grants(entries: Iterable[GrantEntry]) -> dict[str, Grant]:
    """The allocator's ledger from the entries read; an entry with no reason to allocate from
    is skipped as one not read."""
    grants: dict[str, Grant] = {}
    for e in entries:
        g = e.grant()
        if g is not None:
            grants[g.mind] = g
    return grants


def bounded(entries: list[GrantEntry]) -> tuple[list[GrantEntry], GrantQueue | None]:
    """What the Engine object keeps of a ledger's entries: every holder, the first
    `QUEUE_KEPT` of the queue and the first `REFUSED_KEPT` refusals; and `status.grantQueue`
    (the totals, and what is kept), or None when nothing was left out."""
    kept: list[GrantEntry] = []
    queued = refused = 0
    for e in entries:
        state = e.state
        if state == GrantState.QUEUED:
            queued += 1
            if queued > QUEUE_KEPT:
                continue
        elif state == GrantState.RELEASED:
            refused += 1
            if refused > REFUSED_KEPT:
                continue
        kept.append(e)
    if queued <= QUEUE_KEPT and refused <= REFUSED_KEPT:
        return kept, None
    return kept, GrantQueue(
        queued=queued,
        refused=refused,
        kept_queued=min(queued, QUEUE_KEPT),
        kept_refused=min(refused, REFUSED_KEPT),
    )


def tail_from_log(waiting: Mapping[str, Place], kept: Collection[str]) -> dict[str, Grant]:
    """The entries an Engine object left out, as the transition log leaves them: every mind
    whose last line has her queued or refused, not only those that still want a grant (one
    deleted in a step the log lost leaves next step, logged). A new leader with a log decides
    from this, so its next lines follow from the log's, whatever a crash left unwritten."""
    out: dict[str, Grant] = {}
    for name, p in waiting.items():
        if name in kept:
            continue
        try:
            reason = GrantReason(p.reason)
            state = GrantState(p.state)
        except ValueError:
            continue
        out[name] = Grant(
            mind=name,
            state=state,
            reason=reason,
            since=p.t,
            priority=int(p.priority),
            protection_window=p.window,
        )
    return out


def tail_from_minds(
    minds: Iterable[Mapping[str, object]], kept: Collection[str], demands: Mapping[str, MindDemand]
) -> dict[str, Grant]:
    """The entries an Engine object left out, as each Mind's own status says them (a new
    leader's view: the one that wrote the ledger kept them in memory). Only a Mind whose status
    was written for her current spec (`status.observedGeneration`, so for this Engine) and says
    Queued or Refused; the others are new to the ledger."""
    out: dict[str, Grant] = {}
    for m in minds:
        name = mind_key(m)
        status = object_at(m, "status")
        grant = object_at(status, "grant")
        demand = demands.get(name)
        if name in kept or demand is None:
            continue
        if status.get("observedGeneration") != object_at(m, "metadata").get("generation"):
            continue
        since = _parse_time(grant.get("since"))
        try:
            reason = GrantReason(str(grant.get("reason")))
        except ValueError:
            continue
        if since is None:
            continue
        if grant.get("state") == GrantState.QUEUED and reason not in REFUSALS:
            state = GrantState.QUEUED
        elif grant.get("state") == ProjectedState.REFUSED and reason in REFUSALS:
            state = GrantState.RELEASED
        else:
            continue
        out[name] = Grant(
            mind=name,
            state=state,
            reason=reason,
            since=since,
            priority=demand.priority,
            protection_window=demand.protection_window,
        )
    return out


# --- the pool ---------------------------------------------------------------------------------


def launch_of(plan: Mapping[str, object]) -> str | None:
    """Identity of the engine process a plan runs: a new value is a relaunch (new KV buffers)."""
    if not plan or not plan.get("engineArgs"):
        return None
    key = {"node": plan.get("node"), "args": plan.get("engineArgs")}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


#: What the grants loop's replace of a GrantLedger's status writes (`kube.grants.ledger_write`): the
#: ledger and its companions, merged into the cached Engine body (`kube.ledger.cached`).
LEDGER_FIELDS = frozenset({"grants", CAPACITY_FIELD, STEP_FIELD, QUEUE_FIELD})


def holds_another_launch(status: object) -> bool:
    """Whether the ledger still holds grants made on another launch than the plan's: the engine
    process they live in must run until its gateway reports them released (or their grace
    deadline forces them), so the successor's Deployment waits (kube.engines.loop)."""
    status = object_at(status)
    recorded = object_at(status, CAPACITY_FIELD).get("launch")
    if recorded is None or recorded == launch_of(object_at(status, "plan")):
        return False
    return any(e.state in HOLDING_STATES for e in read_entries(status.get("grants")))


def _condition(status: Mapping[str, object], type_: cond.ConditionType) -> Mapping[str, object]:
    for c in bodies(status.get("conditions")):
        if c.get("type") == type_:
            return c
    return {}


def _ready(status: Mapping[str, object]) -> bool:
    return _condition(status, cond.ConditionType.READY).get("status") == "True"


# The Planned reasons of a spec no node takes until it changes (the Ready condition says why).
_NEVER_PLACED = frozenset({cond.Reason.INVALID_SPEC, cond.Reason.FACTS_MISSING})
# Phases of an engine that has served: a later pause in serving is a relaunch.
_SERVED = frozenset({EnginePhase.SERVING, EnginePhase.DRAINING, EnginePhase.RELAUNCHING})


def _unschedulable(status: Mapping[str, object]) -> bool:
    """Whether no node takes the engine as it is: its Unschedulable condition, or a spec the
    planner refuses (its Planned condition)."""
    return (
        _condition(status, cond.ConditionType.UNSCHEDULABLE).get("status") == "True"
        or _condition(status, cond.ConditionType.PLANNED).get("reason") in _NEVER_PLACED
    )


def engine_note(engine: Mapping[str, object]) -> str:
    """Why an engine is not serving, in its Ready condition's words ('' when it says nothing)."""
    ready = _condition(object_at(engine, "status"), cond.ConditionType.READY)
    if ready.get("status") == "True":
        return ""
    reason, message = str(ready.get("reason") or ""), str(ready.get("message") or "")
    return f"{reason}: {message}" if reason and message else reason or message


@dataclass(frozen=True, slots=True)
class GrantPool:
    """The capacity to allocate from, and the launch it belongs to (recorded with the ledger)."""

    capacity: Capacity
    launch: str | None

    def to_status(self) -> dict[str, object]:
        """`status.grantCapacity` (`model.grant_ledger.GrantCapacity`) as written: `launch`
        always, null when the plan runs none."""
        doc: dict[str, object] = {
            "phase": self.capacity.phase.value,
            "slots": self.capacity.slots,
            "tokensPerSlot": self.capacity.tokens_per_slot,
            "launch": self.launch,
        }
        if self.capacity.target_slots is not None:
            doc["targetSlots"] = self.capacity.target_slots
        return doc


def capacity_of(engine: Mapping[str, object], grants: Mapping[str, Grant]) -> GrantPool:
    """The engine's pool as the allocator must see it now.

    - Serving: the pod of the current plan is ready (the plan loop's `Ready` condition) and the
      ledger was made for this launch (or holds no slot).
    - Draining: the plan's launch changed (a relaunch or a resize: llama.cpp cannot resize its
      KV buffer in place) while minds still hold slots of the old one; the old size stands
      until every slot is released, and the new size decides who is `EngineShrunk`.
    - Otherwise queued minds wait and nobody is granted: `Unschedulable` while no node takes
      it (its Unschedulable condition, or a spec the planner refuses); `Relaunching` when it
      served before (the ledger's last pool says so); `Starting` when it never has (not placed
      yet, or its first pod not ready).
    """
    spec = object_at(engine, "spec")
    status = object_at(engine, "status")
    plan = object_at(status, "plan")
    tokens = integer(plan, "contextTokensPerMind") or integer(spec, "contextTokensPerMind") or 0
    slots = (integer(plan, "mindsGrantable") or 0) if plan.get("schedulable", True) else 0
    launch = launch_of(plan)
    recorded = object_at(status, CAPACITY_FIELD)
    holding = any(g.state in HOLDING_STATES for g in grants.values())
    old_launch = text(recorded.get("launch"))
    if holding and old_launch is not None and old_launch != launch:
        return GrantPool(
            Capacity(
                EnginePhase.DRAINING,
                integer(recorded, "slots") or 0,
                integer(recorded, "tokensPerSlot") or tokens,
                target_slots=slots,
            ),
            old_launch,
        )
    if _ready(status) and launch is not None and slots > 0:
        return GrantPool(Capacity(EnginePhase.SERVING, slots, tokens), launch)
    if _unschedulable(status):
        phase = EnginePhase.UNSCHEDULABLE
    elif recorded.get("phase") in _SERVED:
        phase = EnginePhase.RELAUNCHING
    else:
        phase = EnginePhase.STARTING
    return GrantPool(Capacity(phase, slots, tokens), launch)


# --- the gateway's releases ----------------------------------------------------------------


def released_of(engine: Mapping[str, object], grants: Mapping[str, Grant]) -> set[str]:
    """Minds whose reclaim the gateway reported released (status.runtime.slotReleases): the
    report names the reclaim by (mind, slot, grantSince), so an old report frees nothing new."""
    runtime = object_at(engine, "status", "runtime")
    out: set[str] = set()
    for r in bodies(runtime.get("slotReleases")):
        g = grants.get(str(r.get("mind")))
        if (
            g is not None
            and g.state is GrantState.RECLAIMING
            and r.get("slot") == g.slot
            and r.get("grantSince") == iso_micro(g.since)
        ):
            out.add(g.mind)
    return out


def idle_of(engine: Mapping[str, object]) -> set[str]:
    """Minds the gateway parked at their own ask and that have asked nothing since
    (status.runtime.park.idle): their slots go to minds waiting (`core.grants`, `Parked`)."""
    return {m for m in items_at(engine, "status", "runtime", "park", "idle") if isinstance(m, str)}


# --- one step ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LedgerStep:
    """What one allocation step asks to write: the new ledger, the pools it went through (a
    drain that ends goes on at once with the successor's pool) and the transitions under each.

    `entries` is the whole ledger (the projections read it); `kept` and `queue` what the Engine
    object holds of it (`bounded`)."""

    grants: dict[str, Grant]
    segments: tuple[tuple[GrantPool, tuple[Transition, ...]], ...]
    entries: list[GrantEntry]
    changed: bool
    review_at: float | None
    kept: list[GrantEntry] = field(default_factory=list)
    queue: GrantQueue | None = None

    @property
    def pool(self) -> GrantPool:
        return self.segments[-1][0]

    def transitions(self) -> list[Transition]:
        return [t for _, ts in self.segments for t in ts]


def step(
    engine: Mapping[str, object],
    demands: Mapping[str, MindDemand],
    now: float,
    policy: GrantPolicy,
    quota_left: Mapping[str, int] | None = None,
    tail: Mapping[str, Grant] | None = None,
    stored: list[GrantEntry] | None = None,
) -> LedgerStep:
    """One allocation of an engine's ledger at `now` (no API calls). `quota_left`: by
    namespace, the tokens its minds may hold on this engine (`core.grants.allocate`). `tail`:
    the entries the Engine object left out (`status.grantQueue`), from the leader's memory of
    its last write or from the Minds' own status (`tail_from_minds`). `stored`: the object's
    entries as `read_entries` reads them, where the caller read them already (each read
    validates every entry)."""
    status = object_at(engine, "status")
    stored_raw = status.get("grants")
    if stored is None:
        stored = read_entries(stored_raw)
    grants = read_grants(stored)
    for name, g in (tail or {}).items():
        grants.setdefault(name, g)
    pool = capacity_of(engine, grants)
    released = released_of(engine, grants)
    result = allocate(
        grants,
        demands.values(),
        pool.capacity,
        now,
        released=released,
        policy=policy,
        quota_left=quota_left,
        idle=idle_of(engine),
    )
    segments = [(pool, result.transitions)]
    if pool.capacity.phase is EnginePhase.DRAINING and not result.holders():
        # Drained: the successor's pool at once, so no step ends with a free slot unused. The
        # old launch is forgotten; that the engine served is not (a pause is a relaunch).
        drained = {"phase": EnginePhase.DRAINING.value}
        pool = capacity_of({**engine, "status": {**status, CAPACITY_FIELD: drained}}, result.grants)
        result = allocate(
            result.grants,
            demands.values(),
            pool.capacity,
            now,
            policy=policy,
            quota_left=quota_left,
        )
        segments.append((pool, result.transitions))
    asked = {n: d.context_tokens for n, d in demands.items()}
    entries = grant_entries(result.grants, demands, asked)
    kept, queue = bounded(entries)
    changed = (
        (status.get(CAPACITY_FIELD) or None) != pool.to_status()
        or kept != stored
        or len(stored) != (len(stored_raw) if isinstance(stored_raw, list) else 0)  # one unread
        or queue_doc(queue) != status.get(QUEUE_FIELD)
        or any(ts for _, ts in segments)  # a move of a mind the object does not keep
    )
    return LedgerStep(
        result.grants,
        tuple(segments),
        entries,
        changed,
        result.review_at,
        kept,
        queue,
    )


def log_lines(
    t: float, engine: str, recorded: Mapping[str, object] | None, s: LedgerStep
) -> list[dict[str, object]]:
    """The transition log's lines for one step (docs/transition-log.md): a `capacity` line
    wherever the pool differs from the one before, then the transitions under it."""
    lines: list[dict[str, object]] = []
    before: Mapping[str, object] | None = recorded
    for pool, transitions in s.segments:
        doc = pool.to_status()
        if before is None or _pool_key(before) != _pool_key(doc):
            lines.append(capacity_line(t, engine, pool.capacity))
        before = doc
        lines.extend(transition_line(t, engine, tr) for tr in transitions)
    return lines


def queue_doc(queue: GrantQueue | None) -> dict[str, object] | None:
    """`status.grantQueue` as the GrantLedger stores it (None: not written)."""
    return None if queue is None else queue.model_dump(by_alias=True)


def _pool_key(doc: Mapping[str, object]) -> tuple[object, ...]:
    return (doc.get("phase"), doc.get("slots"), doc.get("tokensPerSlot"))
