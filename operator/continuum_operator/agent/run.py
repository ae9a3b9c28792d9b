"""The agent's cycle: probe, make the board, write it if it changed enough, renew the Lease.

Order matters for what the Lease promises. The Lease says "this node's board is current", so it
is renewed only after the board is known to be in step: written this cycle, or unchanged past
the thresholds since the last write. A probe that fails or a board write that fails leaves the
Lease to expire, and the operator then treats the board as stale (no new plans there) rather
than trusting numbers that no longer hold.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from continuum_operator.agent import probe
from continuum_operator.agent.metrics import AgentMetrics
from continuum_operator.agent.writer import AgentApi, AgentApiError
from continuum_operator.core.board_change import Change, Thresholds, board_change
from continuum_operator.core.nodeboard import board_status
from continuum_operator.model.base import ObjectMeta
from continuum_operator.model.board import NodeBoard, NodeBoardStatus

__all__ = ["Agent", "AgentSettings", "Cycle", "board_resource", "run_forever"]

log = logging.getLogger("continuum.agent")

Capture = Callable[..., tuple[dict[str, Any], dict[str, float]]]


@dataclass(frozen=True, slots=True)
class AgentSettings:
    node_name: str
    """The Node this agent measures; its NodeBoard and Lease are named after it."""
    interval_seconds: float = 10.0
    """Seconds between probe cycles (and Lease renewals); the kubelet renews its own every 10 s."""
    thresholds: Thresholds = field(default_factory=Thresholds)
    """How far usage must move before the board is rewritten (core/board_change.py)."""
    probe: probe.ProbeSettings = field(default_factory=probe.ProbeSettings)


@dataclass(frozen=True, slots=True)
class Cycle:
    status: NodeBoardStatus
    change: Change
    wrote: bool
    renewed: bool
    timings: dict[str, float]


def board_resource(node: str, status: NodeBoardStatus) -> NodeBoard:
    return NodeBoard(metadata=ObjectMeta(name=node), status=status)


class Agent:
    """One node's agent; `api` is None on a bare machine (probe and print only)."""

    def __init__(
        self,
        settings: AgentSettings,
        api: AgentApi | None = None,
        *,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        capture: Capture = probe.capture,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.api = api
        self.metrics = metrics
        self.clock = clock
        self.capture = capture  # tests replay a recorded machine through this
        self.written: NodeBoardStatus | None = None
        self._read_written = False

    def probe(
        self, placed_pods: list[dict[str, str]] | None = None, annotations: Any = None
    ) -> tuple[NodeBoardStatus, dict[str, float]]:
        doc, timings = self.capture(
            self.settings.probe, placed_pods=placed_pods or [], node_annotations=annotations
        )
        readings = probe.readings(doc, self.settings.probe.configured_cap_bytes)
        return board_status(readings), timings

    def cycle(self) -> Cycle:
        api = self.api
        if api is None:
            status, timings = self.probe()
            return Cycle(status, Change(False, "no cluster"), False, False, timings)
        start = time.perf_counter()
        if not self._read_written:
            self.written = api.read_board()
            self._read_written = True
        facts = api.node_facts()
        pods = api.placed_pods()
        if pods is None:
            # No board (deleted, or the CRD reinstalled): written again now, whatever moved,
            # before the Lease vouches for it; a quiet node would otherwise never write it.
            self.written = None
        status, timings = self.probe(pods, facts.annotations if facts else None)
        change = board_change(self.written, status, self.settings.thresholds)
        if change.write:
            api.write_board(status, facts)
            self.written = status
            if self.metrics is not None:
                self.metrics.record_write()
            log.info("board %s written: %s", self.settings.node_name, change.reason)
        api.renew_lease(self.clock(), facts)
        if self.metrics is not None:
            self.metrics.record_cycle(status, timings, time.perf_counter() - start)
        return Cycle(status, change, change.write, True, timings)


def run_forever(agent: Agent, stop: threading.Event) -> None:
    """Cycle every interval until `stop` is set; a failed cycle skips a beat, never the loop."""
    while not stop.is_set():
        try:
            agent.cycle()
        except AgentApiError as err:
            log.warning("agent cycle failed, the Lease is not renewed this time: %s", err)
            if agent.metrics is not None:
                agent.metrics.record_failure()
        except Exception:
            log.exception("agent cycle failed, the Lease is not renewed this time")
            if agent.metrics is not None:
                agent.metrics.record_failure()
        stop.wait(agent.settings.interval_seconds)
