"""NodeBoards from recorded probe fixtures (tests/fixtures): `fixture` reads one, `board_of`
turns it into the board status the agent would write."""

from __future__ import annotations

import json
from typing import Any

from continuum_operator.agent import nvml, probe
from continuum_operator.core.nodeboard import board_status
from continuum_operator.model.board import (
    NodeBoardStatus,
)
from continuum_operator.testing.fake_nvml import FakeNvml
from tests.support.builders import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "probes"


def fixture(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return doc


def board_of(doc: dict[str, Any], cap: int | None = None) -> NodeBoardStatus:
    """The board as the agent makes it: NVML answered by the fake module from the fixture."""
    replayed = {**doc, "nvml": nvml.read_raw(FakeNvml(doc["nvml"]))}
    return board_status(probe.readings(replayed, cap))
