"""Discrete-event simulation of engines and minds in virtual time, through the real allocator.

Engines serve slots, relaunch and resize; minds arrive, think, take turns, wait with a reason
and a deadline, and leave; the engine gateway reports a reclaimed slot released after a delay
(slow minds, slow gateways). Every ledger change goes through `grants.allocate`, and the whole
run is written as the transition log of docs/transition-log.md, so `continuum check-log` can
judge it from outside. Pure: the scenario comes in as data, the log and summary go out.

The turn protocol (docs/gateway.md): a turn runs only on a `Granted` grant; when the grant
turns `Reclaiming` the turn ends at once and the slot is released, so a turn never waits on
the reclaim of its own grant. `Scenario.old_reclaim_order` replays the opposite order, where
the reclaim waits for the turn and the turn for the reclaim, to show the checker flags it.

A scenario is a file anyone may hand `continuum simulate`: its run is bounded
(`SimulationBounds`) in events, log lines and the allocator's work, each counted in virtual
terms (the same scenario stops at the same point on any machine), and a run that would pass a
bound stops with `ScenarioTooLarge`, saying which bound, where and what to change.

The allocator's policy is the operator's (`grants.PriorityPolicy`) unless the scenario turns a
safeguard off (`honour_protection`, `count_reclaiming`, `old_reclaim_order`): then it is the
matching policy of `core.broken_policies`. A scenario may also name any `GrantPolicy` of its own
(`Scenario.policy`), so a new policy runs through the simulator and `continuum check-log`.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any

from continuum_operator.core.broken_policies import weakened
from continuum_operator.core.grants import (
    REFUSALS,
    Allocation,
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
from continuum_operator.model.mind import GrantState


@dataclass(frozen=True, slots=True)
class EngineScenario:
    name: str
    slots: int
    tokens_per_slot: int
    relaunch_seconds: float = 60.0


@dataclass(frozen=True, slots=True)
class MindScenario:
    name: str
    engine: str
    priority: int = 0
    protection_window: float = 300.0
    context_tokens: int = 1
    arrive: float = 0.0
    leave: float | None = None
    turn_seconds: float = 30.0
    think_seconds: float = 60.0
    turn_deadline_seconds: float = 1500.0
    release_delay_seconds: float = 0.5


class EngineEventKind(StrEnum):
    RESIZE = "resize"
    RELAUNCH = "relaunch"


@dataclass(frozen=True, slots=True)
class EngineEvent:
    at: float
    engine: str
    kind: EngineEventKind
    slots: int | None = None


@dataclass(frozen=True, slots=True)
class SimulationBounds:
    """The most a run may do: virtual events processed, transition-log lines kept (the log is
    held in memory, a few hundred bytes a line), and the allocator's work (the minds and slots
    each of its steps weighs, summed). At the defaults a run stays under about 1 GB and a few
    minutes of one CPU; the examples' runs are far inside them (docs/simulate.md, "Bounds")."""

    events: int = 1_000_000
    log_lines: int = 2_000_000
    allocator_work: int = 50_000_000


class ScenarioTooLarge(Exception):
    """A run stopped at one of its `SimulationBounds`; the message says which and what to do."""


@dataclass(frozen=True, slots=True)
class Scenario:
    engines: tuple[EngineScenario, ...]
    minds: tuple[MindScenario, ...]
    events: tuple[EngineEvent, ...] = ()
    duration: float = 3600.0
    grace_seconds: float = 30.0
    honour_protection: bool = True
    count_reclaiming: bool = True
    old_reclaim_order: bool = False
    # The allocator's policy as it is, the switches above aside (`old_reclaim_order` still
    # parks turns); None: the operator's, with the safeguards they turn off taken away.
    policy: GrantPolicy | None = None
    bounds: SimulationBounds = SimulationBounds()


class _MindPhase(StrEnum):
    AWAY = "away"
    THINKING = "thinking"
    WAITING = "waiting"
    TURN = "turn"
    PARKED = "parked"  # old order only: a turn waiting on the reclaim of its own grant
    GONE = "gone"


# The members a turn's cycle tests on every event, as module globals: reading an enum member
# off its class goes through the enum's metaclass (about 70 ns in 3.11, a global about 5).
_THINKING, _TURN = _MindPhase.THINKING, _MindPhase.TURN
_GRANTED, _SERVING = GrantState.GRANTED, EnginePhase.SERVING


@dataclass(slots=True)
class _Mind:
    spec: MindScenario
    phase: _MindPhase = _MindPhase.AWAY
    epoch: int = 0  # bumps whenever a scheduled wake-up of the mind becomes stale
    wait_started: float = 0.0
    wait_reason: str = ""
    turns: int = 0


@dataclass(slots=True)
class _Engine:
    spec: EngineScenario
    phase: EnginePhase
    slots: int
    target: int | None = None
    grants: dict[str, Grant] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    epoch: int = 0
    refused: set[str] = field(default_factory=set)  # ContextTooLarge: asking again is futile
    reviews: set[float] = field(default_factory=set)  # allocator re-runs already scheduled


@dataclass(frozen=True, slots=True)
class SimulationResult:
    log: list[dict[str, Any]]
    summary: dict[str, Any]
    events: int


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class _Simulation:
    def __init__(self, scenario: Scenario) -> None:
        self.sc = scenario
        self.policy: GrantPolicy = scenario.policy or weakened(
            scenario.grace_seconds,
            protection=scenario.honour_protection,
            count_reclaiming=scenario.count_reclaiming,
            grace_deadline=not scenario.old_reclaim_order,
        )
        self.now = 0.0
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.seq = itertools.count(1)
        self.processed = 0
        self.log: list[dict[str, Any]] = []
        self.transition_lines: list[dict[str, Any]] = []
        self.engines = {e.name: _Engine(e, EnginePhase.SERVING, e.slots) for e in scenario.engines}
        self.minds = {m.name: _Mind(m) for m in scenario.minds}
        # Each engine's minds with their demand, built once: a step used to scan every mind of
        # the scenario and build each one's MindDemand anew (most of a step at 500 minds).
        self.roster: dict[str, list[tuple[_Mind, MindDemand]]] = defaultdict(list)
        for m in self.minds.values():
            s = m.spec
            demand = MindDemand(s.name, s.priority, s.arrive, s.context_tokens, s.protection_window)
            self.roster[s.engine].append((m, demand))
        self.waits: dict[str, list[float]] = defaultdict(list)
        self.abandoned: Counter[str] = Counter()
        self.turns_cut = 0
        self.refused = 0
        self.work = 0  # the allocator's work so far: minds and slots weighed, step by step

    # --- scheduling -------------------------------------------------------------------------

    def at(self, t: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.queue, (t, next(self.seq), action))

    def run(self) -> SimulationResult:
        for e in self.engines.values():
            self.capacity_line(e)
        for m in self.minds.values():
            self.at(m.spec.arrive, partial(self.arrive, m))
            if m.spec.leave is not None:
                self.at(m.spec.leave, partial(self.leave, m))
        for ev in self.sc.events:
            self.at(ev.at, partial(self.engine_event, ev))
        queue, duration, pop = self.queue, self.sc.duration, heapq.heappop
        log, bounds = self.log, self.sc.bounds
        most_events, most_lines = bounds.events, bounds.log_lines
        processed = 0
        while queue and queue[0][0] <= duration:
            if processed >= most_events:
                self.too_large(f"{most_events:,} events")
            if len(log) > most_lines:
                self.too_large(f"{most_lines:,} lines of transition log")
            self.now, _, action = pop(queue)
            processed += 1
            action()
        self.processed = processed
        return SimulationResult(self.log, self.summary(), self.processed)

    def too_large(self, bound: str) -> None:
        raise ScenarioTooLarge(
            f"the scenario reached the simulator's bound of {bound} at virtual time "
            f"{self.now:,.1f} s of its {self.sc.duration:,.1f} s duration; shorten duration, "
            "lengthen the minds' turnSeconds and thinkSeconds, or lower their count or the "
            'engines\' slots (docs/simulate.md, "Bounds")'
        )

    # --- log --------------------------------------------------------------------------------

    def line(self, engine: str, event: str, **fields: Any) -> None:
        self.log.append({"t": self.now, "engine": engine, "event": event, **fields})

    def turn_line(self, e: _Engine, m: _Mind, phase: str) -> None:
        # `line` for the commonest line, two a turn, without its keyword packing and merging.
        self.log.append(
            {
                "t": self.now,
                "engine": e.spec.name,
                "event": "turn",
                "mind": m.spec.name,
                "phase": phase,
            }
        )

    def capacity_line(self, e: _Engine) -> None:
        capacity = Capacity(e.phase, e.slots, e.spec.tokens_per_slot)
        self.log.append(capacity_line(self.now, e.spec.name, capacity))

    def transition_line(self, engine: str, t: Transition) -> None:
        line = transition_line(self.now, engine, t)
        self.log.append(line)
        self.transition_lines.append(line)  # for the summary, without rescanning the log

    # --- engines ----------------------------------------------------------------------------

    def demands(self, e: _Engine) -> list[MindDemand]:
        return [
            demand
            for m, demand in self.roster[e.spec.name]
            if m.phase is not _MindPhase.AWAY and m.phase is not _MindPhase.GONE
        ]

    def step(self, e: _Engine) -> None:
        capacity = Capacity(e.phase, e.slots, e.spec.tokens_per_slot, e.target)
        # What a step costs: the engine's minds scanned, its ledger and its slots.
        self.work += len(self.roster[e.spec.name]) + len(e.grants) + max(e.slots, e.target or 0)
        demands = self.demands(e)
        if self.work > self.sc.bounds.allocator_work:
            self.too_large(f"{self.sc.bounds.allocator_work:,} minds and slots weighed")
        result: Allocation = allocate(
            e.grants, demands, capacity, self.now, released=e.released, policy=self.policy
        )
        e.released -= {t.mind for t in result.transitions if t.to_state is GrantState.RELEASED}
        e.grants = result.grants
        for t in result.transitions:
            self.transition_line(e.spec.name, t)
        for t in result.transitions:
            self.effect(e, t)
        if result.review_at is not None and result.review_at not in e.reviews:
            # A protection window or a grace deadline lapses: the operator's timer, here.
            e.reviews.add(result.review_at)
            self.at(result.review_at, lambda: self.step(e))
        if e.phase is EnginePhase.DRAINING and not result.holders():
            e.phase, e.slots, e.target = EnginePhase.RELAUNCHING, e.target or e.slots, None
            e.epoch += 1
            self.capacity_line(e)
            epoch = e.epoch
            self.at(self.now + e.spec.relaunch_seconds, lambda: self.relaunched(e, epoch))

    def effect(self, e: _Engine, t: Transition) -> None:
        m = self.minds.get(t.mind)
        if m is None:
            return
        if t.to_state is GrantState.RECLAIMING:
            if m.phase is _MindPhase.TURN and self.sc.old_reclaim_order:
                # The opposite order: the turn parks until its grant is back, the reclaim waits
                # for the turn to end, and only the turn deadline breaks the cycle.
                m.phase = _MindPhase.PARKED
                m.epoch += 1
                m.wait_started = self.now
                m.wait_reason = "OwnGrantReclaiming"
                deadline = self.now + m.spec.turn_deadline_seconds
                self.line(
                    e.spec.name, "wait", mind=m.spec.name, reason=m.wait_reason, deadline=deadline
                )
                epoch = m.epoch
                self.at(deadline, lambda: self.parked_out(e, m, epoch))
                return
            if m.phase is _MindPhase.TURN:
                self.line(e.spec.name, "turn", mind=m.spec.name, phase="cut")
                self.turns_cut += 1
                self.think(m)
            self.schedule_release(e, m, t)
        elif t.to_state is GrantState.GRANTED and m.phase is _MindPhase.WAITING:
            self.end_wait(e, m, "granted")
            self.start_turn(e, m)
        elif (
            t.to_state is GrantState.RELEASED
            and t.reason in REFUSALS
            and m.phase is _MindPhase.WAITING
        ):
            self.end_wait(e, m, "refused")
            self.refuse(e, m)

    def schedule_release(self, e: _Engine, m: _Mind, t: Transition) -> None:
        def report() -> None:
            g = e.grants.get(m.spec.name)
            if g is not None and g.state is GrantState.RECLAIMING and g.since == t.at:
                e.released.add(m.spec.name)
                self.step(e)

        self.at(self.now + m.spec.release_delay_seconds, report)
        if t.deadline is not None:
            self.at(t.deadline, lambda: self.step(e))

    def parked_out(self, e: _Engine, m: _Mind, epoch: int) -> None:
        if m.epoch != epoch or m.phase is not _MindPhase.PARKED:
            return
        self.waits[m.wait_reason].append(self.now - m.wait_started)
        self.abandoned[m.wait_reason] += 1
        self.line(e.spec.name, "waitEnd", mind=m.spec.name, outcome="deadline")
        self.line(e.spec.name, "turn", mind=m.spec.name, phase="cut")
        self.turns_cut += 1
        self.think(m)
        e.released.add(m.spec.name)
        self.step(e)

    def engine_event(self, ev: EngineEvent) -> None:
        e = self.engines[ev.engine]
        if e.phase is not EnginePhase.SERVING:
            # A resize during a relaunch lands on the successor; a second relaunch is moot.
            if ev.kind is EngineEventKind.RESIZE and ev.slots is not None:
                e.target = ev.slots
                if e.phase is EnginePhase.RELAUNCHING:
                    e.slots = ev.slots
            return
        e.phase = EnginePhase.DRAINING
        e.target = ev.slots if ev.kind is EngineEventKind.RESIZE else e.slots
        self.capacity_line(e)
        self.step(e)

    def relaunched(self, e: _Engine, epoch: int) -> None:
        if e.epoch != epoch:
            return
        e.phase = EnginePhase.SERVING
        e.target = None
        self.capacity_line(e)
        self.step(e)
        for name in sorted(e.refused):
            m = self.minds[name]
            if m.phase is _MindPhase.THINKING:
                self.think(m)
        e.refused.clear()

    # --- minds ------------------------------------------------------------------------------

    def arrive(self, m: _Mind) -> None:
        if m.phase is _MindPhase.GONE:
            return
        m.phase = _MindPhase.THINKING
        self.step(self.engines[m.spec.engine])
        self.want_turn(m)

    def leave(self, m: _Mind) -> None:
        e = self.engines[m.spec.engine]
        if m.phase in (_MindPhase.WAITING, _MindPhase.PARKED):
            self.end_wait(e, m, "left")
        elif m.phase is _MindPhase.TURN:
            self.line(e.spec.name, "turn", mind=m.spec.name, phase="cut")
            self.turns_cut += 1
        m.phase = _MindPhase.GONE
        m.epoch += 1
        self.step(e)

    def think(self, m: _Mind) -> None:
        m.phase = _THINKING
        m.epoch += 1
        # A turn's cycle (think, want a turn, turn) is nearly every event of a run: its wake-ups
        # are partials, called from C, rather than lambdas that add a Python frame each, and
        # pushed here rather than through `at` (a frame less).
        wake: Callable[[], None] = partial(self.want_turn, m, m.epoch)
        heapq.heappush(self.queue, (self.now + m.spec.think_seconds, next(self.seq), wake))

    def want_turn(self, m: _Mind, epoch: int | None = None) -> None:
        if (epoch is not None and m.epoch != epoch) or m.phase is not _THINKING:
            return
        e = self.engines[m.spec.engine]
        g = e.grants.get(m.spec.name)
        if g is not None and g.state is _GRANTED and e.phase is _SERVING:
            self.start_turn(e, m)
            return
        if g is not None and g.state is GrantState.RELEASED:
            self.refuse(e, m)
            return
        reason = (
            str(g.reason)
            if g is not None and g.state is GrantState.QUEUED
            else (
                str(GrantReason.ENGINE_RELAUNCHING)
                if e.phase is not EnginePhase.SERVING
                else str(GrantReason.WAITING_FOR_RECLAIM)
            )
        )
        m.phase = _MindPhase.WAITING
        m.epoch += 1
        m.wait_started = self.now
        m.wait_reason = reason
        deadline = self.now + m.spec.turn_deadline_seconds
        self.line(e.spec.name, "wait", mind=m.spec.name, reason=reason, deadline=deadline)
        epoch_now = m.epoch
        self.at(deadline, lambda: self.wait_deadline(e, m, epoch_now))

    def refuse(self, e: _Engine, m: _Mind) -> None:
        """ContextTooLarge: refused at once, never parked. The answer cannot change until the
        engine relaunches (its slot size is fixed), so the mind stops asking until then rather
        than asking again at the same virtual instant forever."""
        self.refused += 1
        m.phase = _MindPhase.THINKING
        m.epoch += 1
        e.refused.add(m.spec.name)

    def wait_deadline(self, e: _Engine, m: _Mind, epoch: int) -> None:
        if m.epoch != epoch or m.phase is not _MindPhase.WAITING:
            return
        self.abandoned[m.wait_reason] += 1
        self.end_wait(e, m, "deadline")
        self.think(m)

    def end_wait(self, e: _Engine, m: _Mind, outcome: str) -> None:
        self.waits[m.wait_reason].append(self.now - m.wait_started)
        self.line(e.spec.name, "waitEnd", mind=m.spec.name, outcome=outcome)

    def start_turn(self, e: _Engine, m: _Mind) -> None:
        m.phase = _TURN
        m.epoch += 1
        self.turn_line(e, m, "start")
        end: Callable[[], None] = partial(self.end_turn, e, m, m.epoch)
        heapq.heappush(self.queue, (self.now + m.spec.turn_seconds, next(self.seq), end))

    def end_turn(self, e: _Engine, m: _Mind, epoch: int) -> None:
        if m.epoch != epoch or m.phase is not _TURN:
            return
        m.turns += 1
        self.turn_line(e, m, "end")
        self.think(m)

    # --- summary ----------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        transitions = self.transition_lines
        reclaims = Counter(x["reason"] for x in transitions if x["to"] == "Reclaiming")
        grants = sum(1 for x in transitions if x["to"] == "Granted" and x["from"] != "Granted")
        reclaimed_minds: set[str] = set()
        cycles = 0
        for x in transitions:
            if x["to"] == "Reclaiming":
                reclaimed_minds.add(x["mind"])
            elif x["to"] == "Granted" and x["from"] != "Granted" and x["mind"] in reclaimed_minds:
                cycles += 1
                reclaimed_minds.discard(x["mind"])
        waits = {
            reason: {
                "count": len(v),
                "p50": _percentile(v, 0.50),
                "p99": _percentile(v, 0.99),
                "max": max(v),
                "abandoned": self.abandoned[reason],
            }
            for reason, v in sorted(self.waits.items())
        }
        return {
            "duration": self.sc.duration,
            "events": self.processed,
            "grants": grants,
            "reclaims": dict(sorted(reclaims.items())),
            "reclaimCycles": cycles,
            "turns": {
                "completed": sum(m.turns for m in self.minds.values()),
                "cut": self.turns_cut,
                "refused": self.refused,
                "byMind": {name: m.turns for name, m in sorted(self.minds.items())},
            },
            "waits": waits,
        }


def simulate(scenario: Scenario) -> SimulationResult:
    return _Simulation(scenario).run()
