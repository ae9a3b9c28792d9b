"""`continuum place` from the outside: the node the operator would choose across a directory of
boards, and `message` exactly the condition text the operator writes for the same boards (one
function makes both); every bad input exits 2 saying what was wrong and what to do."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator.cli import main
from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, EXIT_UNSCHEDULABLE
from continuum_operator.kube.engines.engine_pass import Memory
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.state.cache import BoardEntry, NodeEntry, Snapshot
from continuum_operator.kube.state.lease_renewal import LeaseEntry
from tests.support.builders import ROOT, board
from tests.support.reconcile import NOW, SETTINGS, after

EXAMPLES = ROOT / "examples"
BOARDS = sorted((EXAMPLES / "boards").glob("*.yaml"))
AGENT = EXAMPLES / "engines" / "agent-32b.yaml"
HUGE = EXAMPLES / "engines" / "llama-405b-f16.yaml"


def place(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["place", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def boards(tmp_path: Path) -> Path:
    directory = tmp_path / "boards"
    directory.mkdir()
    for b in BOARDS:
        shutil.copy(b, directory / b.name)
    return directory


def operator_conditions(engine_file: Path) -> dict[str, dict[str, Any]]:
    """The conditions the operator writes for that Engine with every example board fresh."""
    bodies = [yaml.safe_load(b.read_text()) for b in BOARDS]
    entries = {x["metadata"]["name"]: BoardEntry(board(x), resource_version="1") for x in bodies}
    snap = Snapshot(
        boards=entries,
        leases={n: LeaseEntry(NOW - 1, 3600, "1") for n in entries},
        nodes={n: NodeEntry({}, 1) for n in entries},
        engines={},
        deployments={},
    )
    body = yaml.safe_load(engine_file.read_text())
    body["metadata"].update({"uid": "u", "generation": 1, "resourceVersion": "1"})
    written = after(copy.deepcopy(body), reconcile(body, snap, Memory(), NOW, SETTINGS))
    return {c["type"]: c for c in written["status"]["conditions"]}


def test_an_engine_that_fits_is_placed_where_the_operator_places_it_with_its_planned_message(
    capsys: pytest.CaptureFixture[str], boards: Path
) -> None:
    code, out, _ = place(capsys, "--boards", boards, "--engine", AGENT, "-o", "json")
    doc = json.loads(out)
    planned = operator_conditions(AGENT)["Planned"]
    assert code == EXIT_OK
    assert doc["node"] == "m5-studio" and doc["schedulable"] is True
    assert (doc["condition"], doc["reason"], doc["message"]) == (
        "Planned",
        planned["reason"],
        planned["message"],
    )
    assert doc["plan"]["node"] == "m5-studio" and doc["plan"]["schedulable"] is True
    assert {r["node"] for r in doc["reasons"]} == {yaml.safe_load(b.read_text())["metadata"]["name"]
                                                   for b in BOARDS}  # fmt: skip


def test_an_engine_no_board_takes_exits_3_with_the_operators_unschedulable_message(
    capsys: pytest.CaptureFixture[str], boards: Path
) -> None:
    code, out, err = place(capsys, "--boards", boards, "--engine", HUGE, "-o", "json")
    doc = json.loads(out)
    unschedulable = operator_conditions(HUGE)["Unschedulable"]
    assert code == EXIT_UNSCHEDULABLE
    assert doc["node"] is None and doc["plan"] is None
    assert doc["reason"] == unschedulable["reason"] == "InsufficientMemory"
    assert doc["message"] == unschedulable["message"]
    assert doc["closest"] == "gpu-a100-01" and f"closest: {doc['closest']}, " in doc["message"]
    assert f"unschedulable: InsufficientMemory: {doc['message']}" in err
    # Node by node, what the condition leaves out: every board, why, and by how much.
    assert len(doc["reasons"]) == len(BOARDS)
    assert all(
        r["code"] == "InsufficientMemory" and r["shortfallBytes"] > 0 for r in doc["reasons"]
    )
    assert doc["groups"] == [
        {
            "code": "InsufficientMemory",
            "count": len(BOARDS),
            "nodes": sorted(r["node"] for r in doc["reasons"]),
        }
    ]


def test_the_table_and_yaml_say_the_same(capsys: pytest.CaptureFixture[str], boards: Path) -> None:
    _, as_json, _ = place(capsys, "--boards", boards, "--engine", HUGE, "-o", "json")
    code, as_yaml, _ = place(capsys, "--boards", boards, "--engine", HUGE, "-o", "yaml")
    assert code == EXIT_UNSCHEDULABLE and yaml.safe_load(as_yaml) == json.loads(as_json)
    _, table, _ = place(capsys, "--boards", boards, "--engine", HUGE)
    lines = table.splitlines()
    assert lines[0].split() == ["Node:", "none"]
    assert lines[1].startswith("Unschedulable: InsufficientMemory: no node has room: 0/7 nodes fit")
    assert lines[3].split() == ["NODE", "FITS", "CODE", "MESSAGE"]
    assert [x.split()[1:3] for x in lines[4:]] == [["no", "InsufficientMemory"]] * len(BOARDS)


def test_a_nodeselector_matches_the_boards_own_labels(
    capsys: pytest.CaptureFixture[str], boards: Path
) -> None:
    body = yaml.safe_load(AGENT.read_text())
    body["spec"].setdefault("placement", {})["nodeSelector"] = {"rack": "r7"}
    engine = boards.parent / "engine.yaml"
    engine.write_text(yaml.safe_dump(body))
    code, out, _ = place(capsys, "--boards", boards, "--engine", engine, "-o", "json")
    assert code == EXIT_UNSCHEDULABLE
    assert json.loads(out)["reason"] == "NoMatchingNode"
    l4 = boards / "l4x2-discrete.yaml"
    doc = yaml.safe_load(l4.read_text())
    doc["metadata"]["labels"] = {"rack": "r7"}
    l4.write_text(yaml.safe_dump(doc))
    code, out, _ = place(capsys, "--boards", boards, "--engine", engine, "-o", "json")
    assert (code, json.loads(out)["node"]) == (EXIT_OK, "gpu-l4-07")


def test_a_lease_on_the_chosen_node_moves_the_engine_elsewhere(
    capsys: pytest.CaptureFixture[str], boards: Path
) -> None:
    other = yaml.safe_load(AGENT.read_text())
    other["metadata"]["name"] = "first"
    pools = [{"pool": "unified", "bytes": 40 * 2**30}]
    other["status"] = {"placement": {"node": "m5-studio", "assumed": False, "pools": pools}}
    lease = boards.parent / "lease.yaml"
    lease.write_text(yaml.safe_dump(other))
    code, out, _ = place(
        capsys, "--boards", boards, "--engine", AGENT, "--lease", lease, "-o", "json"
    )
    assert code == EXIT_OK and json.loads(out)["node"] != "m5-studio"


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "does not exist; --boards takes a directory of NodeBoard files"),
        ("a-file", "is not a directory; --boards takes a directory"),
        ("empty", "no NodeBoard in its .yaml, .yml, .json files; write the cluster's boards"),
        ("twice", "board m5-studio is also in"),
        ("bad-board", "status.pools[0].capacityBytes"),
        ("no-facts", "spec.model.facts: this Engine names a model source but no inline facts"),
    ],
)
def test_bad_input_exits_2_saying_what_was_wrong_and_what_to_do(
    capsys: pytest.CaptureFixture[str], boards: Path, case: str, expected: str
) -> None:
    engine = AGENT
    directory = boards
    if case == "missing":
        directory = boards.parent / "nowhere"
    elif case == "a-file":
        directory = AGENT
    elif case == "empty":
        directory = boards.parent / "empty"
        directory.mkdir()
        (directory / "README.txt").write_text("not a board")
    elif case == "twice":
        shutil.copy(boards / "m5-unified.yaml", boards / "m5-again.yml")
    elif case == "bad-board":
        doc = yaml.safe_load((boards / "m5-unified.yaml").read_text())
        doc["status"]["pools"][0]["capacityBytes"] = "lots"
        (boards / "m5-unified.yaml").write_text(yaml.safe_dump(doc))
    elif case == "no-facts":
        body = yaml.safe_load(AGENT.read_text())
        del body["spec"]["model"]["facts"]
        body["spec"]["model"]["source"] = {"kind": "hostPath", "path": "/models/m.gguf"}
        engine = boards.parent / "sourced.yaml"
        engine.write_text(yaml.safe_dump(body))
    code, out, err = place(capsys, "--boards", directory, "--engine", engine)
    assert code == EXIT_INVALID and out == ""
    assert err.startswith("error: ") and expected in err
