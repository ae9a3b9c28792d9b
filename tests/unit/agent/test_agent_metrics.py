"""The node agent's /metrics: what its last cycle measured, scraped over HTTP and checked
against the board that cycle made (a recorded H100 machine, replayed)."""

from __future__ import annotations

import threading
import urllib.request
from datetime import UTC, datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from continuum_operator.agent.metrics import AgentMetrics
from continuum_operator.agent.run import run_forever
from continuum_operator.core.pools import pool_key
from tests.support.agent import FakeApi, agent_on
from tests.support.local_http import free_port


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def labels(**kw: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(kw.items()))


def test_the_agent_serves_its_last_cycles_readings_timings_and_writes() -> None:
    api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
    agent = agent_on("x86-h100-hmm", api, now)
    agent.metrics = AgentMetrics("n1")
    port = free_port()
    agent.metrics.serve(port)
    first = agent.cycle()
    agent.cycle()  # the same readings: no second write
    got = scrape(port)

    assert first.status.pools, "the fixture has pools"
    for p in first.status.pools:
        key = pool_key(p.kind, p.device)
        assert got[("continuum_agent_pool_capacity_bytes", labels(node="n1", pool=key))] == float(
            p.capacity_bytes
        )
        used = got.get(("continuum_agent_pool_used_bytes", labels(node="n1", pool=key)))
        assert used == (None if p.used_bytes is None else float(p.used_bytes))
    mode = first.status.memory_mode.value
    assert mode == "discrete"
    assert got[("continuum_agent_memory_mode", labels(node="n1", mode="discrete"))] == 1
    assert got[("continuum_agent_memory_mode", labels(node="n1", mode="unified"))] == 0
    assert got[("continuum_agent_memory_mode", labels(node="n1", mode="unknown"))] == 0
    assert got[("continuum_agent_board_writes_total", labels(node="n1"))] == 1 == len(api.writes)
    assert got[("continuum_agent_cycle_seconds_count", labels(node="n1"))] == 2
    assert got[("continuum_agent_cycle_failures_total", labels(node="n1"))] == 0


def test_probe_timings_are_exported_by_probe() -> None:
    m = AgentMetrics("n1")
    api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
    agent = agent_on("x86-h100-hmm", api, now)
    status, _ = agent.probe()
    m.record_cycle(status, {"nvml": 0.004, "host": 0.001}, 0.02)
    sample = m.registry.get_sample_value
    assert sample("continuum_agent_probe_seconds", {"node": "n1", "probe": "nvml"}) == 0.004
    assert sample("continuum_agent_probe_seconds", {"node": "n1", "probe": "host"}) == 0.001
    # A GPU gone from the next reading takes its series with it.
    hosts = [p for p in status.pools if p.device is None]
    m.record_cycle(status.model_copy(update={"pools": hosts}), {}, 0.01)
    assert sample("continuum_agent_pool_capacity_bytes", {"node": "n1", "pool": "device/0"}) is None
    assert sample("continuum_agent_pool_capacity_bytes", {"node": "n1", "pool": "host"})


def test_a_failed_cycle_is_counted_and_the_loop_goes_on() -> None:
    api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
    api.fail_writes = True
    agent = agent_on("x86-h100-hmm", api, now)
    agent.metrics = AgentMetrics("n1")
    stop = threading.Event()
    cycles: list[Any] = []
    real = agent.cycle

    def cycle_then_stop() -> Any:
        cycles.append(1)
        if len(cycles) == 2:
            stop.set()
        return real()

    agent.cycle = cycle_then_stop  # type: ignore[method-assign]
    agent.settings = type(agent.settings)(node_name="n1", interval_seconds=0.001)
    run_forever(agent, stop)
    sample = agent.metrics.registry.get_sample_value
    assert sample("continuum_agent_cycle_failures_total", {"node": "n1"}) == 2
    assert sample("continuum_agent_board_writes_total", {"node": "n1"}) == 0
    assert api.renewals == []  # a failed write renews nothing
