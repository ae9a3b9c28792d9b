"""The operator's grant metrics from ledger steps the allocator made: turn waits by the reason a
mind last waited for, reclaim cycles, and the plan's estimate error against the receipt."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import pytest

from continuum_operator.core.grants import (
    Capacity,
    EnginePhase,
    Grant,
    MindDemand,
    allocate,
)
from continuum_operator.kube.base.metrics import OperatorMetrics
from continuum_operator.model.mind import GrantState

ENGINE = {"namespace": "minds", "engine": "coder"}


class Ledger:
    """One engine's ledger, stepped by the allocator, each step recorded as the leader does."""

    def __init__(self, metrics: OperatorMetrics, slots: int = 1) -> None:
        self.metrics = metrics
        self.capacity = Capacity(EnginePhase.SERVING, slots, 1000)
        self.grants: dict[str, Grant] = {}

    def step(self, now: float, minds: Iterable[MindDemand], released: Collection[str] = ()) -> None:
        before = self.grants
        result = allocate(before, minds, self.capacity, now, released=released)
        states = [g.state for g in result.grants.values()]
        self.metrics.record_grant_step(
            "minds",
            "coder",
            result.transitions,
            before,
            sum(1 for s in states if s in (GrantState.GRANTED, GrantState.RECLAIMING)),
            states.count(GrantState.QUEUED),
        )
        self.grants = result.grants


def state(led: Ledger, name: str) -> GrantState:
    return led.grants[name].state


def mind(name: str, arrival: float, priority: int = 0, window: float = 100.0) -> MindDemand:
    return MindDemand(name, priority, arrival, 500, protection_window=window)


def waits(m: OperatorMetrics, reason: str, suffix: str = "count", **extra: str) -> float | None:
    return m.registry.get_sample_value(
        f"continuum_grant_wait_seconds_{suffix}", {**ENGINE, "reason": reason, **extra}
    )


def test_a_wait_is_observed_at_its_grant_under_the_reason_she_last_waited_for() -> None:
    m = OperatorMetrics()
    led = Ledger(m)
    a, b = mind("a", 0.0), mind("b", 10.0)
    led.step(0.0, [a])  # granted on arrival
    led.step(10.0, [a, b])  # b: Arrived, then PoolFull
    assert led.grants["b"].reason.value == "PoolFull"
    led.step(40.0, [b])  # a deleted: reclaimed; b now waits for that reclaim
    assert led.grants["b"].reason.value == "WaitingForReclaim"
    assert waits(m, "WaitingForReclaim") is None  # still waiting: nothing observed yet
    led.step(45.0, [b], released={"a"})
    assert state(led, "b") is GrantState.GRANTED

    # b waited 35 s from her arrival, the last reason being the reclaim; a waited 0 s.
    assert waits(m, "WaitingForReclaim") == 1
    assert waits(m, "WaitingForReclaim", "sum") == 35.0
    assert waits(m, "WaitingForReclaim", "bucket", le="30.0") == 0
    assert waits(m, "WaitingForReclaim", "bucket", le="60.0") == 1
    assert waits(m, "Arrived") == 1
    assert waits(m, "Arrived", "sum") == 0.0
    assert waits(m, "PoolFull") is None  # she did not end her wait on it


def test_a_new_leader_measures_an_inherited_wait_from_her_ledger_entry() -> None:
    old_leader, new_leader = OperatorMetrics(), OperatorMetrics()
    led = Ledger(old_leader)
    a, b = mind("a", 0.0), mind("b", 10.0)
    led.step(0.0, [a])
    led.step(10.0, [a, b])
    led.step(40.0, [b])
    led.metrics = new_leader  # the old leader died; the new one steps the same ledger
    led.step(45.0, [b], released={"a"})
    # From the entry's `since` (her last change of reason, at 40 s): a lower bound, 5 s.
    assert waits(new_leader, "WaitingForReclaim", "sum") == 5.0


def test_a_replica_that_lost_the_lease_forgets_the_waits_it_saw_begin() -> None:
    m = OperatorMetrics()
    led = Ledger(m)
    a, b = mind("a", 0.0), mind("b", 10.0)
    led.step(0.0, [a])
    led.step(10.0, [a, b])
    assert [k[2] for k in m.waiting] == ["b"]
    m.set_leader(False)
    assert m.waiting == {}  # another leader may grant and requeue her meanwhile
    led.metrics = OperatorMetrics()
    led.step(40.0, [b])
    led.metrics = m
    m.set_leader(True)
    led.step(45.0, [b], released={"a"})
    assert waits(m, "WaitingForReclaim", "sum") == 5.0  # from the ledger, as a new leader


def test_a_mind_deleted_while_queued_is_no_wait() -> None:
    m = OperatorMetrics()
    led = Ledger(m)
    a, b = mind("a", 0.0), mind("b", 10.0)
    led.step(0.0, [a])
    led.step(10.0, [a, b])
    led.step(20.0, [a])  # b leaves the queue
    assert waits(m, "PoolFull") is None
    assert not [k for k in m.waiting if k[2] == "b"]


def cycles(m: OperatorMetrics, reason: str) -> float | None:
    return m.registry.get_sample_value(
        "continuum_grant_reclaim_cycles_total", {**ENGINE, "reason": reason}
    )


@pytest.mark.parametrize(("second_preemptor_at", "counted"), [(300.0, 1.0), (400.0, None)])
def test_a_mind_reclaimed_again_within_two_windows_of_her_last_reclaim_is_a_cycle(
    second_preemptor_at: float, counted: float | None
) -> None:
    m = OperatorMetrics()
    led = Ledger(m)
    low = mind("low", 0.0, priority=0, window=100.0)
    led.step(0.0, [low])
    h1 = mind("h1", 150.0, priority=10)
    led.step(150.0, [low, h1])  # her protection ended at 100: preempted, reclaim 1 at 150
    assert state(led, "low") is GrantState.RECLAIMING
    led.step(151.0, [low, h1], released={"low"})
    led.step(160.0, [low])  # h1 leaves: her reclaim is MindDeleted, never a cycle
    led.step(161.0, [low], released={"h1"})
    assert state(led, "low") is GrantState.GRANTED
    h2 = mind("h2", second_preemptor_at, priority=10)
    led.step(second_preemptor_at, [low, h2])  # reclaim 2: 150 s or 250 s after reclaim 1
    assert state(led, "low") is GrantState.RECLAIMING
    assert cycles(m, "Preempted") == counted
    assert cycles(m, "MindDeleted") is None
    assert m.registry.get_sample_value("continuum_grant_reclaims_total", {"reason": "Preempted"})


def status(layers: int = 20, device_kv: int = 900) -> dict[str, object]:
    plan = {
        "node": "gpu-1",
        "layersOnDevice": 20,
        "poolTokens": 8192,
        "mindsGrantable": 2,
        "kvCacheType": "f16",
        "bytes": {
            "device": {"weights": 1000, "kv": device_kv, "compute": 100, "reserve": 7, "total": 0},
            "host": {"weights": 300, "kv": 0, "compute": 50, "reserve": 0, "total": 0},
        },
    }
    receipt = {
        "kind": "Receipt",
        "contextTokens": 8192,
        "parallel": 2,
        "kvCacheType": "f16",
        "placement": {"layersOnDevice": layers, "gpus": 1},
        "buffers": [
            {"device": "CUDA0", "kind": "model", "bytes": 1000},
            {"device": "CUDA0", "kind": "kv", "bytes": 800},
            {"device": "CUDA0", "kind": "compute", "bytes": 200},
            {"device": "CPU_Mapped", "kind": "model", "bytes": 300},
            {"device": "CUDA_Host", "kind": "compute", "bytes": 50},
        ],
    }
    return {"plan": plan, "runtime": {"receipts": [receipt]}}


def error(m: OperatorMetrics, pool: str) -> float | None:
    return m.registry.get_sample_value(
        "continuum_engine_plan_estimate_error_ratio", {**ENGINE, "pool": pool}
    )


def test_the_estimate_error_is_the_plan_against_the_receipt_of_its_own_launch() -> None:
    m = OperatorMetrics()
    m.set_estimate_error("minds", "coder", status())
    assert error(m, "device") == 0.0  # planned 2,000 = allocated 2,000 (reserve not allocated)
    assert error(m, "host") == 0.0
    m.set_estimate_error("minds", "coder", status(device_kv=1400))
    assert error(m, "device") == 0.25  # over-reserved by a quarter

    # Re-planned to 30 layers while the engine still runs the 20-layer launch: no comparison.
    m.set_estimate_error("minds", "coder", status(layers=30))
    assert error(m, "device") is None and error(m, "host") is None

    m.set_estimate_error("minds", "coder", status())
    m.forget("minds", "coder")
    assert error(m, "device") is None
