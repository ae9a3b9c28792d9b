"""`continuum place --boards DIR --engine FILE`: which node the operator would place an Engine on.

Offline best fit across many boards, by the operator's own decision: the same `core.bestfit.choose`
over the same node views (an assumed lease counted as usage, `with_unmeasured`), and, when no node
takes the Engine, the same `core.unfit.summarise` that writes its Unschedulable condition. So
`message` is, to the byte, what the operator writes into the Engine's condition (Planned when a
node takes it, Unschedulable when none does), and `reasons` is the node-by-node detail the
condition leaves out at fleet size.

Offline there are no agent Leases and no Node objects: every board is taken as fresh and its Node
as existing, with the board's own `metadata.labels` as the node's labels (what
`spec.placement.nodeSelector` and `nodePool` match). Exit codes as in `cli`: 0 placed, 2 invalid
input (what was wrong and what to do), 3 no node takes it (the summary on stderr).
Neighbours: `cli.py` (`continuum plan`: one board), `core.unfit`, `core.bestfit`.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, EXIT_UNSCHEDULABLE, fail
from continuum_operator.cli.output import add_output_argument, render
from continuum_operator.core import conditions as cond
from continuum_operator.core import unfit
from continuum_operator.core.bestfit import Decision, NodeView, choose, with_unmeasured
from continuum_operator.core.placements import engine_leases
from continuum_operator.core.pools import Board, Lease
from continuum_operator.core.receipts import Receipt
from continuum_operator.engine.receipts import ReceiptFileError, load_receipts
from continuum_operator.manifests import ManifestError, load_all, load_one
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.engine import Engine

__all__ = ["add_arguments", "cmd_place", "place_doc"]


#: Files read from --boards (not its subdirectories), in name order.
BOARD_SUFFIXES = (".yaml", ".yml", ".json")


class PlaceError(Exception):
    """Input `continuum place` cannot use; the message says what is wrong and what to do."""


def load_boards(directory: Path) -> list[NodeBoard]:
    """Every NodeBoard in DIR's YAML and JSON files (several documents or a List per file)."""
    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise PlaceError(
            f"{directory}: {what}; --boards takes a directory of NodeBoard files "
            "(kubectl get nodeboards -o yaml > DIR/boards.yaml), or use `continuum plan "
            "--board FILE` for one board"
        )
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in BOARD_SUFFIXES)
    boards: list[NodeBoard] = []
    seen: dict[str, Path] = {}
    for path in files:
        for board in load_all(NodeBoard, path):
            name = board.metadata.name
            if name in seen:
                raise PlaceError(
                    f"{path}: metadata.name: board {name} is also in {seen[name]}; a node has "
                    "one board: remove one of them"
                )
            seen[name] = path
            boards.append(board)
    if not boards:
        raise PlaceError(
            f"{directory}: no NodeBoard in its {', '.join(BOARD_SUFFIXES)} files; write the "
            "cluster's boards there (kubectl get nodeboards -o yaml > DIR/boards.yaml)"
        )
    return boards


def decide(
    boards: Sequence[NodeBoard],
    engine: Engine,
    others: Sequence[Engine],
    receipts: Sequence[Receipt] = (),
) -> Decision:
    """The operator's placement decision (`kube.engines.reconcile`'s `place`) on these files."""
    facts = engine.spec.model.facts
    assert facts is not None  # checked by the caller
    me = (engine.metadata.namespace, engine.metadata.name)
    placed = [e for e in others if (e.metadata.namespace, e.metadata.name) != me]
    leases = engine_leases(placed)
    # A lease whose pod has not started yet is in no measurement: counted as usage, as the
    # operator counts it (`with_unmeasured`).
    assumed: dict[str, list[Lease]] = defaultdict(list)
    for lease in engine_leases(
        e for e in placed if e.status.placement is not None and e.status.placement.assumed
    ):
        assumed[lease.node].append(lease)
    views = [
        NodeView(
            board=with_unmeasured(core, assumed.get(core.node, ())),
            fresh=True,
            labels=dict(b.metadata.labels),
        )
        for b in boards
        for core in (Board.from_resource(b),)
    ]
    return choose(views, engine.spec, facts, leases, receipts=receipts)


def place_doc(decision: Decision) -> dict[str, Any]:
    """What `-o json` prints: the node (or null), the condition's reason and message as the
    operator writes them, the groups and the closest node, every node's verdict, the plan."""
    chosen = decision.chosen
    verdicts = [
        {
            "node": v.node,
            "fits": v.excluded is None,
            "code": unfit.why_of(v),
            "message": v.message,
            "shortfallBytes": v.plan.shortfall_bytes if v.plan is not None else None,
        }
        for v in decision.verdicts
    ]
    if chosen is not None:
        return {
            "node": chosen.node,
            "schedulable": True,
            "condition": str(cond.ConditionType.PLANNED),
            "reason": str(cond.Reason.PLANNED),
            "message": cond.planned_message(
                chosen.node, chosen.layers_on_device, chosen.total_layers, chosen.minds_grantable
            ),
            "closest": None,
            "groups": [],
            "reasons": verdicts,
            "plan": chosen.to_dict(),
        }
    why = unfit.summarise(decision)
    return {
        "node": None,
        "schedulable": False,
        "condition": str(cond.ConditionType.UNSCHEDULABLE),
        "reason": str(why.reason),
        "message": why.message,
        "closest": why.closest.node if why.closest is not None else None,
        "groups": [
            {"code": g.why, "count": len(g.nodes), "nodes": list(g.nodes)} for g in why.groups
        ],
        "reasons": verdicts,
        "plan": None,
    }


def place_table(doc: dict[str, Any]) -> str:
    rows = [
        ("Node", doc["node"] or "none"),
        (doc["condition"], f"{doc['reason']}: {doc['message']}"),
    ]
    out = [f"{k + ':':<14} {v}" for k, v in rows]
    out.append("")
    width = max([4, *(len(r["node"]) for r in doc["reasons"])])
    out.append(f"{'NODE':<{width}}  {'FITS':<4}  {'CODE':<28}  MESSAGE")
    for r in doc["reasons"]:
        fits = "yes" if r["fits"] else "no"
        out.append(f"{r['node']:<{width}}  {fits:<4}  {r['code']:<28}  {r['message']}")
    return "\n".join(out)


def cmd_place(args: argparse.Namespace) -> int:
    try:
        boards = load_boards(args.boards)
        engine = load_one(Engine, args.engine)
        others = [e for path in args.lease for e in load_all(Engine, path)]
        receipts = load_receipts(args.receipt)
    except (ManifestError, ReceiptFileError, PlaceError) as err:
        return fail(str(err), EXIT_INVALID)
    if engine.spec.model.facts is None:
        return fail(
            f"{args.engine}: spec.model.facts: this Engine names a model source but no "
            "inline facts; run `continuum facts MODEL.gguf` and put its output in "
            "spec.model.facts to place offline",
            EXIT_INVALID,
        )
    doc = place_doc(decide(boards, engine, others, receipts))
    print(render(doc, args.output, lambda: place_table(doc)))
    if doc["node"] is None:
        print(f"unschedulable: {doc['reason']}: {doc['message']}", file=sys.stderr)
        return EXIT_UNSCHEDULABLE
    return EXIT_OK


def add_placed_inputs(p: argparse.ArgumentParser) -> None:
    """`--lease` and `--receipt`: what `continuum plan` and `place` plan beside and from."""
    p.add_argument(
        "--lease",
        type=Path,
        action="append",
        default=[],
        help="Engines already placed (with status.placement); repeatable",
    )
    p.add_argument(
        "--receipt",
        type=Path,
        action="append",
        default=[],
        help="llama.cpp receipts (YAML/JSON, docs/receipts.md); repeatable",
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum place` (cli.py declares the command)."""
    p.add_argument(
        "--boards",
        type=Path,
        required=True,
        metavar="DIR",
        help="a directory of NodeBoard YAML/JSON files (several documents or a List each)",
    )
    p.add_argument("--engine", type=Path, required=True, help="an Engine YAML file")
    add_placed_inputs(p)
    add_output_argument(p, table="the chosen node, the condition, one row per node")
