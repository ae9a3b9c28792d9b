"""Memory modes as behaviour of the board (`core.modes`): one entry a mode, read by the plan and
the lanes alike (docs/design.md rules 1-3)."""

from __future__ import annotations

import pytest

from continuum_operator.core import modes
from continuum_operator.core.embed import ContextBytes, Residence, lane_charges
from continuum_operator.core.plan import plan
from continuum_operator.core.plan_reasons import Reason, ReasonCode
from continuum_operator.core.pools import Board
from continuum_operator.model.board import MemoryMode
from tests.support.builders import GiB, MiB, board, board_body, engine, engine_body


def unified() -> Board:
    return board(board_body("unified", [{"kind": "unified", "capacityBytes": 64 * GiB,
                                         "usedBytes": 0}], cap=40 * GiB))  # fmt: skip


def discrete(gpus: int = 2) -> Board:
    pools = [{"kind": "host", "capacityBytes": 64 * GiB, "usedBytes": 0}] + [
        {"kind": "device", "device": g, "capacityBytes": (24 - g) * GiB, "usedBytes": 0}
        for g in range(gpus)
    ]
    return board(board_body("discrete", pools))


def unknown() -> Board:
    return board(board_body("unknown", [{"kind": "host", "capacityBytes": 32 * GiB,
                                         "usedBytes": 0}]))  # fmt: skip


def free(pool: str) -> int:
    return {"unified": 64 * GiB, "host": 64 * GiB, "device/0": 24 * GiB, "device/1": 23 * GiB}[pool]


def test_every_memory_mode_has_its_rules() -> None:
    assert set(modes.RULES) == set(MemoryMode)
    assert all(modes.rules_of(m).mode is m for m in MemoryMode)


def test_only_a_mode_that_measures_the_device_is_governed() -> None:
    assert {m for m in MemoryMode if modes.rules_of(m).governed} == {
        MemoryMode.UNIFIED,
        MemoryMode.DISCRETE,
    }


@pytest.mark.parametrize(
    ("b", "gpus", "pools"),
    [
        (unified(), [0], ["unified"]),
        (unified(), [], ["unified"]),
        (discrete(), [0, 1], ["device/0", "device/1"]),
        (discrete(), [], ["device/0"]),
        (discrete(), [0, 7], ["device/0"]),  # a GPU the board does not have is charged nothing
        (unknown(), [0], []),
    ],
)
def test_a_device_part_is_charged_to_the_pools_its_gpus_draw_from(
    b: Board, gpus: list[int], pools: list[str]
) -> None:
    assert modes.rules_of(b.memory_mode).device_pools(b, gpus) == pools


def test_a_unified_board_keeps_one_reserve_and_a_discrete_one_a_reserve_per_pool() -> None:
    assert modes.rules_of(MemoryMode.UNIFIED).reserves(MiB, 1, True) == (0, MiB)
    assert modes.rules_of(MemoryMode.DISCRETE).reserves(MiB, 2, True) == (2 * MiB, MiB)
    assert modes.rules_of(MemoryMode.DISCRETE).reserves(MiB, 2, False) == (0, MiB)


def test_each_mode_budgets_its_own_sides() -> None:
    ask = modes.BudgetAsk(reserve=GiB, gpus=1, declared_device=None)
    u = unified()
    got = modes.rules_of(u.memory_mode).budget(u, u.pools["unified"], ask, free)
    assert isinstance(got, modes.Budgeted)
    assert got.budget == modes.Budget(40 * GiB, 63 * GiB, 40 * GiB, shared=63 * GiB)
    d = discrete()
    got = modes.rules_of(d.memory_mode).budget(d, d.pools["host"], ask, free)
    assert isinstance(got, modes.Budgeted)
    assert (got.budget, got.gpus) == (modes.Budget(23 * GiB, 63 * GiB, None), (0,))
    k = unknown()
    got = modes.rules_of(k.memory_mode).budget(k, k.pools["host"], ask, free)
    assert isinstance(got, modes.Budgeted) and not got.device_checked
    assert got.budget == modes.Budget(None, 63 * GiB, None)
    assert [n.code for n in got.notes] == [ReasonCode.MEMORY_MODE_UNKNOWN]


def test_a_discrete_board_with_too_few_gpus_says_so() -> None:
    d = discrete(1)
    ask = modes.BudgetAsk(reserve=0, gpus=2, declared_device=None)
    got = modes.rules_of(d.memory_mode).budget(d, d.pools["host"], ask, free)
    assert isinstance(got, Reason) and got.code is ReasonCode.NOT_ENOUGH_GPUS


def test_a_running_engine_keeps_its_gpus_where_the_board_has_them() -> None:
    d = discrete()
    ask = modes.BudgetAsk(reserve=0, gpus=1, declared_device=None, on_gpus=[1])
    got = modes.rules_of(d.memory_mode).budget(d, d.pools["host"], ask, free)
    assert isinstance(got, modes.Budgeted) and got.gpus == (1,)


@pytest.mark.parametrize(
    "b", [unified(), discrete(1), unknown()], ids=["unified", "discrete", "unknown"]
)
def test_the_plan_and_a_lane_charge_a_device_part_to_the_same_pools(b: Board) -> None:
    spec = engine(engine_body(minds={"min": 1, "max": 2})).spec
    assert spec.model.facts is not None
    p = plan(b, spec, spec.model.facts)
    lane = lane_charges(b, Residence.DEVICE, p.gpus, ContextBytes(device=MiB, host=0))
    host = b.host_view()
    assert host is not None
    assert {pool for pool, _ in p.charges} - {host.key} == set(lane) - {host.key}
