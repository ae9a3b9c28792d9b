"""The unified-memory failure of docs/design.md, replayed with its numbers.

On an Apple M5 (one unified pool of 57,344 MiB, 32,299 MiB available, Metal's per-process cap
28.57 GB) the old planner read a VRAM row netted against the whole system's usage, settled on
about 2 GB of device budget, put half of 20.41 GB of weights on the CPU and granted 2 minds of 4.
The plan must put every layer on the device and grant all 4 minds.
"""

from __future__ import annotations

from continuum_operator.core.plan import ReasonCode, plan
from continuum_operator.core.pools import BoardLeases
from continuum_operator.model.board import MemoryMode
from tests.support.builders import GB, MiB, board, board_body, engine, example


def m5() -> tuple[dict, dict]:  # type: ignore[type-arg]
    return example("boards", "m5-unified"), example("engines", "agent-32b")


def test_the_pinned_inputs_are_the_measured_ones() -> None:
    b, e = m5()
    pool = b["status"]["pools"][0]
    assert pool["capacityBytes"] == 57_344 * MiB
    assert pool["capacityBytes"] - pool["usedBytes"] == 32_299 * MiB
    facts = e["spec"]["model"]["facts"]
    weights = facts["layers"] * facts["layerBytes"] + facts["inputBytes"] + facts["outputBytes"]
    assert weights == 20_410_000_000
    assert b["status"]["perProcessCapBytes"] == 28_570_000_000


def test_every_layer_goes_on_the_device_and_four_minds_are_granted() -> None:
    b, e = m5()
    eng = engine(e)
    assert eng.spec.model.facts is not None
    p = plan(board(b), eng.spec, eng.spec.model.facts)
    assert p.schedulable
    assert p.layers_on_device == p.total_layers == 65
    assert p.gpu_servable
    assert p.minds_grantable == 4
    assert p.pool_tokens == 4 * 6144
    assert p.device.weights == 20_410_000_000 - 425_000_000  # all but the token embeddings
    # The device part stays under Metal's per-process cap, the whole under the pool.
    assert p.device.in_use <= 28_570_000_000
    assert p.charges == (("unified", p.device.total + p.host.total),)
    assert p.charges[0][1] <= 32_299 * MiB
    assert ReasonCode.ALL_LAYERS_ON_DEVICE in {r.code for r in p.reasons}


def test_netting_the_device_row_against_the_whole_systems_usage_would_have_left_about_2_gb() -> (
    None
):
    """The old reading, modelled as a discrete board: VRAM = the cap, used = all of the system."""
    b, e = m5()
    used = b["status"]["pools"][0]["usedBytes"]
    cap = b["status"]["perProcessCapBytes"]
    wrong = board_body(
        "discrete",
        [
            {
                "kind": "host",
                "capacityBytes": b["status"]["pools"][0]["capacityBytes"],
                "usedBytes": used,
            },
            {"kind": "device", "device": 0, "capacityBytes": cap, "usedBytes": used},
        ],
        name="m5-as-discrete",
    )
    eng = engine(e)
    assert eng.spec.model.facts is not None
    wrong_plan = plan(board(wrong), eng.spec, eng.spec.model.facts)
    device_left = cap - used
    assert 1.5 * GB < device_left < 2.5 * GB
    assert wrong_plan.layers_on_device < 10  # most weights pushed to the CPU
    right_plan = plan(board(b), eng.spec, eng.spec.model.facts)
    assert right_plan.layers_on_device - wrong_plan.layers_on_device > 55


def test_the_device_view_and_the_host_view_of_the_m5_pool_agree() -> None:
    b, _ = m5()
    bd = board(b)
    assert bd.memory_mode is MemoryMode.UNIFIED
    assert bd.device_view(0) is bd.host_view()
    ledger = BoardLeases(bd)
    pool = bd.host_view()
    assert pool is not None
    assert ledger.available_bytes(pool.key) == 32_299 * MiB
