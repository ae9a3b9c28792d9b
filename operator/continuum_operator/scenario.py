"""Simulation scenarios read from YAML and validated, for `continuum simulate`.

The format is documented in docs/simulate.md; examples live in examples/scenarios/. A mind
entry with `count: N` stands for N minds named `<name>-0` ... `<name>-(N-1)`, arriving
`arriveEvery` seconds apart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from continuum_operator.core.simulate import (
    EngineEvent,
    EngineEventKind,
    EngineScenario,
    MindScenario,
    Scenario,
)
from continuum_operator.manifests import ManifestError, yaml_documents


class _Model(BaseModel):
    # Times are finite: `.inf` and `.nan` would run forever or compare false everywhere.
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", allow_inf_nan=False
    )


#: The most minds a scenario makes (its entries' counts summed): each is held for the whole run.
MOST_MINDS = 100_000


class ClassFile(_Model):
    name: str
    priority: int = 0
    protection_window_seconds: float = Field(default=300.0, ge=0)


class EngineFile(_Model):
    name: str
    slots: int = Field(ge=0, le=100_000)
    tokens_per_slot: int = Field(ge=1)
    relaunch_seconds: float = Field(default=60.0, ge=0)


class MindFile(_Model):
    name: str
    engine: str
    class_name: str = Field(default="default", alias="class")
    context_tokens: int = Field(default=1, ge=1)
    arrive: float = Field(default=0.0, ge=0)
    arrive_every: float = Field(default=0.0, ge=0)
    leave: float | None = Field(default=None, ge=0)
    turn_seconds: float = Field(default=30.0, gt=0)
    think_seconds: float = Field(default=60.0, ge=0)
    turn_deadline_seconds: float = Field(default=1500.0, gt=0)
    release_delay_seconds: float = Field(default=0.5, ge=0)
    count: int = Field(default=1, ge=1, le=1_000_000)


class EventFile(_Model):
    at: float = Field(ge=0)
    engine: str
    resize: int | None = Field(default=None, ge=0)
    relaunch: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        if (self.resize is None) == (not self.relaunch):
            raise ValueError(
                "an event either resizes (`resize: SLOTS`) or relaunches (`relaunch: true`)"
            )
        return self


class PolicyFile(_Model):
    protection_window: bool = True
    count_reclaiming: bool = True
    old_reclaim_order: bool = False


class ScenarioFile(_Model):
    kind: Literal["Scenario"] = "Scenario"
    duration: float = Field(default=3600.0, gt=0)
    grace_seconds: float = Field(default=30.0, gt=0)
    classes: list[ClassFile] = Field(default_factory=list, max_length=1_000)
    engines: list[EngineFile] = Field(min_length=1, max_length=1_000)
    minds: list[MindFile] = Field(default_factory=list, max_length=MOST_MINDS)
    events: list[EventFile] = Field(default_factory=list, max_length=100_000)
    policy: PolicyFile = Field(default_factory=PolicyFile)

    @model_validator(mode="after")
    def _references_resolve(self) -> Self:
        minds = sum(m.count for m in self.minds)
        if minds > MOST_MINDS:
            raise ValueError(
                f"the minds' counts add up to {minds:,}, more than the simulator's "
                f'{MOST_MINDS:,}; lower count (docs/simulate.md, "Bounds")'
            )
        engines = {e.name for e in self.engines}
        classes = {c.name for c in self.classes} | {"default"}
        for i, m in enumerate(self.minds):
            if m.engine not in engines:
                raise ValueError(f"minds[{i}] names engine {m.engine!r}, which is not in engines")
            if m.class_name not in classes:
                raise ValueError(
                    f"minds[{i}] names class {m.class_name!r}, which is not in classes"
                )
        for i, ev in enumerate(self.events):
            if ev.engine not in engines:
                raise ValueError(f"events[{i}] names engine {ev.engine!r}, which is not in engines")
        return self

    def to_scenario(self) -> Scenario:
        classes = {c.name: c for c in self.classes}
        classes.setdefault("default", ClassFile(name="default"))
        minds = []
        for m in self.minds:
            c = classes[m.class_name]
            for i in range(m.count):
                minds.append(
                    MindScenario(
                        name=m.name if m.count == 1 else f"{m.name}-{i}",
                        engine=m.engine,
                        priority=c.priority,
                        protection_window=c.protection_window_seconds,
                        context_tokens=m.context_tokens,
                        arrive=m.arrive + i * m.arrive_every,
                        leave=m.leave,
                        turn_seconds=m.turn_seconds,
                        think_seconds=m.think_seconds,
                        turn_deadline_seconds=m.turn_deadline_seconds,
                        release_delay_seconds=m.release_delay_seconds,
                    )
                )
        return Scenario(
            engines=tuple(
                EngineScenario(e.name, e.slots, e.tokens_per_slot, e.relaunch_seconds)
                for e in self.engines
            ),
            minds=tuple(minds),
            events=tuple(
                EngineEvent(
                    ev.at,
                    ev.engine,
                    EngineEventKind.RESIZE if ev.resize is not None else EngineEventKind.RELAUNCH,
                    ev.resize,
                )
                for ev in self.events
            ),
            duration=self.duration,
            grace_seconds=self.grace_seconds,
            honour_protection=self.policy.protection_window,
            count_reclaiming=self.policy.count_reclaiming,
            old_reclaim_order=self.policy.old_reclaim_order,
        )


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not part.startswith("function-"):
            out += ("." if out else "") + part
    return out


def load(path: Path) -> Scenario:
    """Read a scenario file; ValueError with the file and field path when it is wrong."""
    try:
        docs = yaml_documents(path)
    except ManifestError as err:
        raise ValueError(f"cannot read a scenario: {err}") from err
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise ValueError(f"{path}: a scenario is one YAML mapping (simulate.md)")
    raw = docs[0]
    try:
        return ScenarioFile.model_validate(raw).to_scenario()
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        where = _where(first["loc"])
        msg = str(first["msg"]).removeprefix("Value error, ")
        raise ValueError(f"{path}: {where + ': ' if where else ''}{msg}") from err
