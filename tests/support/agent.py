"""A fake API server for the node agent and an agent cycle on a recorded fixture."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from continuum_operator.agent import nvml
from continuum_operator.agent.run import Agent, AgentSettings
from continuum_operator.agent.writer import AgentApiError, NodeFacts
from continuum_operator.model.board import (
    NodeBoardStatus,
)
from continuum_operator.testing.fake_nvml import FakeNvml
from tests.support.builders import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "probes"


class FakeApi:
    """AgentApi's surface, in memory: what was written, when the Lease was renewed."""

    def __init__(self, stored: NodeBoardStatus | None = None) -> None:
        self.stored = stored
        self.writes: list[NodeBoardStatus] = []
        self.renewals: list[datetime] = []
        self.fail_writes = False

    def read_board(self) -> NodeBoardStatus | None:
        return self.stored

    def node_facts(self) -> NodeFacts | None:
        return NodeFacts(uid="u", annotations={})

    def placed_pods(self) -> list[dict[str, str]] | None:
        return [] if self.stored is not None else None  # AgentApi: None while no board exists

    def write_board(self, status: NodeBoardStatus, facts: NodeFacts | None) -> None:
        if self.fail_writes:
            raise AgentApiError("writing NodeBoard n1 status: 500 boom")
        self.writes.append(status)
        self.stored = status

    def renew_lease(self, now: datetime, facts: NodeFacts | None) -> None:
        self.renewals.append(now)


def agent_on(
    fixture: str, api: FakeApi, clock: list[datetime], doc: dict[str, Any] | None = None
) -> Agent:
    """An agent on a recorded machine: every cycle replays `doc` (the fixture unless given)."""
    doc = doc if doc is not None else json.loads((FIXTURES / f"{fixture}.json").read_text())

    def capture(*_: Any, **__: Any) -> tuple[dict[str, Any], dict[str, float]]:
        return {**doc, "nvml": nvml.read_raw(FakeNvml(doc["nvml"]))}, {}

    return Agent(
        AgentSettings(node_name="n1"),
        api,  # type: ignore[arg-type]
        clock=lambda: clock[0],
        capture=capture,
    )
