"""Relaunch damping: when a re-plan may restart a running engine (docs/design.md's lessons).

A relaunch kills every turn in flight, and the seed system relaunched its engine 13 times in 4
minutes on readings that were wrong. So a re-plan whose engine arguments differ from the
running engine's must:
- agree over `readingsRequired` consecutive board readings (a reading is one distinct state of the
  node's board and Lease: a board change or a Lease renewal; the same reading seen twice is not
  more evidence);
- gain enough to pay for the relaunch when it grows the engine (pool tokens or layers on the
  device up by `minGain`); a shrink needs no gain, only the evidence: it is what the pool now has;
- wait out a cooldown after the previous relaunch;
- and nothing is weighed while a relaunch (or the first launch) is in flight.

Readings here are evidence that a node's change holds, not that the node changed: Lease renewals
of an unchanged board count. So a new plan on a node that reads as it did when the plan in force
was made (a new operator's planner, not the node) never reaches the damper: it is held
(`core.replan`, docs/operator.md "Upgrades").

A small state machine with the clock passed in: `step(damper, observation, settings)` returns the
next state and an outcome. The operator keeps one `Damper` per engine in memory and rebuilds it
from the Engine's status after a restart (count and last relaunch time; evidence starts again).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from continuum_operator.core.plan import ServingPlan


@dataclass(frozen=True, slots=True)
class DampingSettings:
    readings_required: int = 3
    """Consecutive distinct board readings that must agree on the same new plan (count)."""
    min_gain: float = 0.10
    """Least relative growth of pool tokens or of layers on device worth a relaunch (fraction)."""
    cooldown_seconds: float = 300.0
    """Seconds after a relaunch before the next may start."""


@dataclass(frozen=True, slots=True)
class PlanShape:
    """What damping compares of two plans: the arguments and what they buy."""

    args: tuple[str, ...]
    layers_on_device: int
    total_layers: int
    pool_tokens: int

    @classmethod
    def of(cls, p: ServingPlan) -> PlanShape:
        return cls(p.engine_args, p.layers_on_device, p.total_layers, p.pool_tokens)

    def gain_over(self, running: PlanShape) -> float:
        """Relative gain of this plan over the running one (negative for a shrink)."""
        tokens = (self.pool_tokens - running.pool_tokens) / max(running.pool_tokens, 1)
        layers = (self.layers_on_device - running.layers_on_device) / max(self.total_layers, 1)
        return max(tokens, layers)

    def shrinks(self, running: PlanShape) -> bool:
        return (
            self.pool_tokens < running.pool_tokens
            or self.layers_on_device < running.layers_on_device
        )


class Outcome(StrEnum):
    UNCHANGED = "Unchanged"
    GATHERING_EVIDENCE = "GatheringEvidence"
    GAIN_TOO_SMALL = "GainTooSmall"
    COOLING_DOWN = "CoolingDown"
    IN_FLIGHT = "RelaunchInFlight"
    RELAUNCH = "Relaunch"


@dataclass(frozen=True, slots=True)
class Observation:
    now: float
    """Seconds on the operator's clock (wall time: the last relaunch is kept in status)."""
    reading: str
    """Identity of the board reading (board resourceVersion and Lease renewTime)."""
    running: PlanShape
    candidate: PlanShape
    in_flight: bool = False


@dataclass(frozen=True, slots=True)
class Damper:
    candidate: tuple[str, ...] | None = None
    readings: int = 0
    last_reading: str | None = None
    last_outcome: Outcome = Outcome.UNCHANGED
    last_relaunch_at: float | None = None
    relaunches: int = 0


def step(damper: Damper, obs: Observation, settings: DampingSettings) -> tuple[Damper, Outcome]:
    """Weigh one observation; on `RELAUNCH` the caller relaunches with `obs.candidate`."""

    def out(d: Damper, outcome: Outcome) -> tuple[Damper, Outcome]:
        return replace(d, last_outcome=outcome), outcome

    if obs.in_flight:
        return out(
            replace(damper, candidate=None, readings=0, last_reading=None), Outcome.IN_FLIGHT
        )
    if obs.candidate.args == obs.running.args:
        return out(replace(damper, candidate=None, readings=0), Outcome.UNCHANGED)
    if obs.reading == damper.last_reading and obs.candidate.args == damper.candidate:
        # The same reading again is no new evidence; only the clock (cooldown) may have moved.
        if damper.last_outcome is not Outcome.COOLING_DOWN:
            return damper, damper.last_outcome
    elif obs.candidate.args == damper.candidate:
        damper = replace(damper, readings=damper.readings + 1, last_reading=obs.reading)
    else:
        damper = replace(damper, candidate=obs.candidate.args, readings=1, last_reading=obs.reading)

    if damper.readings < settings.readings_required:
        return out(damper, Outcome.GATHERING_EVIDENCE)
    if not obs.candidate.shrinks(obs.running) and (
        obs.candidate.gain_over(obs.running) < settings.min_gain
    ):
        return out(damper, Outcome.GAIN_TOO_SMALL)
    if (
        damper.last_relaunch_at is not None
        and obs.now - damper.last_relaunch_at < settings.cooldown_seconds
    ):
        return out(damper, Outcome.COOLING_DOWN)
    relaunched = Damper(
        last_outcome=Outcome.RELAUNCH,
        last_relaunch_at=obs.now,
        relaunches=damper.relaunches + 1,
    )
    return relaunched, Outcome.RELAUNCH
