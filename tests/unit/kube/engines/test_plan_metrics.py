"""Per-engine plan gauges follow the plan in the Engine's status, and its node."""

from __future__ import annotations

from continuum_operator.kube.base.metrics import OperatorMetrics


def sample(m: OperatorMetrics, name: str, node: str) -> float | None:
    return m.registry.get_sample_value(name, {"namespace": "minds", "engine": "e", "node": node})


def test_the_plan_is_exported_where_it_runs_and_leaves_with_it() -> None:
    m = OperatorMetrics()
    plan = {"node": "gpu-1", "layersOnDevice": 33, "poolTokens": 65536, "mindsGrantable": 4}
    m.set_plan("minds", "e", plan)
    assert sample(m, "continuum_engine_plan_layers_on_device", "gpu-1") == 33
    assert sample(m, "continuum_engine_plan_pool_tokens", "gpu-1") == 65536
    assert sample(m, "continuum_engine_plan_slots", "gpu-1") == 4

    m.set_plan("minds", "e", {**plan, "node": "gpu-2", "layersOnDevice": 20})
    assert sample(m, "continuum_engine_plan_layers_on_device", "gpu-1") is None
    assert sample(m, "continuum_engine_plan_layers_on_device", "gpu-2") == 20

    m.set_plan("minds", "e", None)  # unschedulable now: no made-up zero
    assert sample(m, "continuum_engine_plan_slots", "gpu-2") is None


def test_a_deleted_engine_leaves_no_plan_series() -> None:
    m = OperatorMetrics()
    m.set_plan(
        "minds", "e", {"node": "n", "layersOnDevice": 1, "poolTokens": 2, "mindsGrantable": 1}
    )
    m.forget("minds", "e")
    assert sample(m, "continuum_engine_plan_pool_tokens", "n") is None
