"""An upgrade cannot break serving (docs/operator.md, "Upgrades"): a re-plan of a running Engine
whose arguments differ from the plan in force while its node reads as it did when that plan was
made is a change of the operator's code, not of the node. It is held (condition `PlanHeld`,
naming the old plan and the new), never relaunched by damping however many Lease renewals
agree, and applied only when a person accepts it by the Engine's annotation or the node's
readings change.

The seed's failure, in the operator's terms: a new planner (here the operator's, wrapped to
shrink every plan to `spec.minds.min`) on unchanged boards."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from continuum_operator import cli
from continuum_operator.core import replan as replan_module
from continuum_operator.core.plan import ServingPlan, plan
from continuum_operator.core.replan import ACCEPT_ANNOTATION, plan_id
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.model.engine import EngineSpec
from tests.support.builders import board_body, engine
from tests.support.reconcile import NOW, SETTINGS, after, conditions, discrete, snapshot
from tests.support.runtime_truth import _serving


def shrinking_plan(board: Any, spec: EngineSpec, facts: Any, *args: Any, **kw: Any) -> ServingPlan:
    """The operator's planner, changed: every engine gets its fewest minds."""
    fewest = spec.model_copy(
        update={"minds": spec.minds.model_copy(update={"max": spec.minds.min})}
    )
    return plan(board, fewest, facts, *args, **kw)


@pytest.fixture
def upgrade(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], None]]:
    """Start the new operator: from the call on, running engines are re-planned by the new
    planner (what an engine was placed and confirmed with is the old one's)."""
    yield lambda: monkeypatch.setattr(replan_module, "plan", shrinking_plan)


def renewals(body: dict[str, Any], mem: Any, snap: Any, n: int, start: float = 10.0) -> Any:
    """`n` passes, each on a Lease renewal of the same board (what damping counts as readings);
    the engine, its memory and every pass's events."""
    events: list[list[str]] = []
    for i in range(n):
        s = replace(snap, leases={"a": replace(snap.leases["a"], resource_version=f"r{i}")})
        w = reconcile(body, s, mem, NOW + start + i, SETTINGS)
        body, mem = after(body, w), w.memory
        events.append([e.reason for e in w.events if e.reason in ("Relaunching", "Recharged")])
    return body, mem, events


def held(body: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == "PlanHeld")


def test_a_new_planner_on_the_same_board_holds_the_running_engine_and_relaunches_nothing(
    upgrade: Callable[[], None],
) -> None:
    body, mem, snap = _serving()
    upgrade()
    planned = body["status"]["plan"]
    assert planned["mindsGrantable"] == 4 and planned.get("reading")
    body, mem, events = renewals(body, mem, snap, 6)
    assert events == [[]] * 6  # damping alone relaunched at the third renewal
    assert body["status"]["plan"] == planned
    cond = held(body)
    assert (cond["status"], cond["reason"]) == ("True", "CodeChanged")
    assert "a new plan (" in cond["message"] and "1 minds" in cond["message"]
    assert "the plan in force (" in cond["message"] and "4 minds" in cond["message"]
    assert "a change of the operator's code, not of the node" in cond["message"]
    assert f"{ACCEPT_ANNOTATION}=" in cond["message"]
    assert conditions(body)["Ready"] == ("True", "PodReady")


def test_a_person_accepting_the_held_plan_relaunches_it_at_once(
    upgrade: Callable[[], None],
) -> None:
    body, mem, snap = _serving()
    upgrade()
    body, mem, _ = renewals(body, mem, snap, 2)
    new_args = shrinking_plan(
        snap.boards["a"].board, _spec(body), _spec(body).model.facts
    ).engine_args
    stale = {**body, "metadata": {**body["metadata"], "annotations": {ACCEPT_ANNOTATION: "0" * 12}}}
    _, _, events = renewals(stale, mem, snap, 2, start=20.0)
    assert events == [[], []]  # another plan's id accepts nothing
    accepted = {
        **body,
        "metadata": {**body["metadata"], "annotations": {ACCEPT_ANNOTATION: plan_id(new_args)}},
    }
    w = reconcile(accepted, snap, mem, NOW + 30, SETTINGS)
    assert [e.reason for e in w.events if e.reason == "Relaunching"] == ["Relaunching"]
    out = after(accepted, w)
    assert out["status"]["plan"]["mindsGrantable"] == 1
    assert held(out)["status"] == "False"


def test_once_the_node_reads_otherwise_damping_weighs_the_new_plan_as_ever(
    upgrade: Callable[[], None],
) -> None:
    body, mem, snap = _serving()
    upgrade()
    body, mem, _ = renewals(body, mem, snap, 2)
    # Another process takes 8 GiB of the GPU: the agent writes the board, the node changed.
    own = snap.boards["a"].board.pools["device/0"].used_bytes
    assert own is not None
    moved = replace(snap, boards={"a": discrete("a", 80, used_gib=8, own=own)})
    body, mem, events = renewals(body, mem, moved, 4, start=20.0)
    assert events == [[], [], ["Relaunching"], []]  # three readings agree, as damping asks
    assert body["status"]["plan"]["mindsGrantable"] == 1


def test_a_plan_of_an_earlier_operator_without_a_reading_is_held_and_records_one(
    upgrade: Callable[[], None],
) -> None:
    body, mem, snap = _serving()
    upgrade()
    old = {**body, "status": {**body["status"], "plan": dict(body["status"]["plan"])}}
    del old["status"]["plan"]["reading"]
    body, mem, events = renewals(old, mem, snap, 4)
    assert events == [[]] * 4
    assert held(body)["status"] == "True"
    assert body["status"]["plan"]["reading"]


def test_the_same_planner_on_the_same_board_holds_nothing() -> None:
    body, mem, snap = _serving()
    planned = body["status"]["plan"]
    body, mem, events = renewals(body, mem, snap, 4)
    assert events == [[]] * 4 and body["status"]["plan"] == planned
    assert (held(body)["status"], held(body)["reason"]) == ("False", "PlanInForce")


def _spec(body: dict[str, Any]) -> EngineSpec:
    return engine(body).spec


def test_a_board_with_other_usage_is_another_reading() -> None:
    snap = snapshot([discrete("a", 80)])
    other = snapshot([discrete("a", 80, used_gib=1)])
    body, _, _ = _serving()
    spec = _spec(body)
    assert spec.model.facts is not None
    board, moved = snap.boards["a"].board, other.boards["a"].board
    assert board is not None and moved is not None
    one = replan_module.engine_reading(board, spec, spec.model.facts, [])
    assert one == replan_module.engine_reading(board, spec, spec.model.facts, [])
    assert one != replan_module.engine_reading(moved, spec, spec.model.facts, [])


# --- `continuum plan --replay`: the check before the upgrade ------------------------------------


def write_cluster(tmp_path: Path, body: dict[str, Any], snap: Any) -> tuple[Path, Path]:
    """What `kubectl get engines -A -o yaml` and `kubectl get nodeboards -o yaml` would save."""
    b = snap.boards["a"].board
    pools = [
        {"kind": str(p.kind), **({"device": p.device} if p.device is not None else {}),
         "capacityBytes": p.capacity_bytes, "usedBytes": p.used_bytes}
        for p in b.pools.values()
    ]  # fmt: skip
    boards = tmp_path / "boards"
    boards.mkdir()
    (boards / "boards.yaml").write_text(json.dumps(board_body("discrete", pools, name="a")))
    engine = {"apiVersion": "continuum.dev/v1alpha1", "kind": "Engine", **body}
    engines = tmp_path / "engines.yaml"
    engines.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [engine]}))
    return engines, boards


def test_the_replay_lists_the_engine_the_new_planner_would_hold_before_it_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], upgrade: Callable[[], None]
) -> None:
    body, mem, snap = _serving()
    body, mem, _ = renewals(body, mem, snap, 1)
    engines, boards = write_cluster(tmp_path, body, snap)
    argv = ["plan", "--replay", "--engines", str(engines), "--boards", str(boards)]
    assert cli.main(argv) == 0  # the planner the engine runs with: nothing would change
    assert "ns/coder on a: Same: " in capsys.readouterr().out
    upgrade()
    assert cli.main([*argv, "-o", "json"]) == 3
    [row] = json.loads(capsys.readouterr().out)["engines"]
    assert (row["engine"], row["verdict"]) == ("ns/coder", "Held")
    assert (row["was"]["mindsGrantable"], row["now"]["mindsGrantable"]) == (4, 1)
    # What the replay says the operator does, it does: hold it, under that very plan id.
    w = reconcile(body, snap, mem, NOW + 30, SETTINGS)
    assert f"{ACCEPT_ANNOTATION}={row['planId']}" in held(after(body, w))["message"]
    assert cli.main(argv) == 3
    out = capsys.readouterr().out
    assert "ns/coder on a: Held: 33/33 layers, 4 minds" in out and "-> 33/33 layers, 1 minds" in out
    assert out.rstrip().endswith("1 of 1 engine(s) would change plan")


def test_replay_without_its_files_says_what_it_needs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["plan", "--replay"]) == 2
    assert "--replay needs --engines FILE" in capsys.readouterr().err
    assert cli.main(["plan"]) == 2
    assert "plan needs --board FILE and --engine FILE" in capsys.readouterr().err
