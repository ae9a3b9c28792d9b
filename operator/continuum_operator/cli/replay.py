"""`continuum plan --replay --engines FILE --boards DIR`: the check before an upgrade.

Runs this `continuum`'s planner (the one the new operator will run) against every placed Engine
of the file and its node's board, as the operator re-plans a running engine (`core.replan`:
crediting its own lease, the other Engines' leases on the node, its plan's receipt, its GPUs),
and lists each engine whose plan would change, before anything is relaunched. The seed's lesson
(docs/design.md): replay the serving plan against the board before any redeploy.

Each engine's verdict:
- `Same`: the plan's arguments and bytes would not move;
- `Recharged`: the same arguments, other bytes (the lease is rewritten, nothing relaunches);
- `Held`: other arguments while the node reads as it did when the plan was made: the new
  operator holds it (condition `PlanHeld`) until a person accepts it (`accept` is the
  annotation that does) or the node changes;
- `Relaunch`: other arguments on a node that reads otherwise: damping weighs it as ever;
- `NoLongerFits`: the node no longer takes the engine as planned;
- `Skipped`: not placed, no board for its node, or no facts to plan from (the note says which).

Offline, as `continuum plan` and `continuum place`: the files are what `kubectl get engines -A
-o yaml` and `kubectl get nodeboards -o yaml` print. EmbedLanes' leases are not in them: on a
node that also holds lanes the replay credits their bytes as free. Exit codes: 0 no plan would
change, 2 invalid input, 3 at least one engine listed as Held, Relaunch or NoLongerFits.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from continuum_operator.cli.errors import fail
from continuum_operator.cli.output import render
from continuum_operator.cli.place import PlaceError, load_boards
from continuum_operator.core.placements import engine_leases
from continuum_operator.core.pools import Board
from continuum_operator.core.replan import ACCEPT_ANNOTATION, plan_id, replan
from continuum_operator.kube.engines.runtime_report import receipts_of
from continuum_operator.manifests import ManifestError, load_all
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.engine import Engine
from continuum_operator.model.plan_status import PlanStatus

__all__ = ["cmd_replay", "replay"]

EXIT_OK, EXIT_INVALID, EXIT_CHANGES = 0, 2, 3
#: Verdicts a person should look at before the upgrade.
CHANGES = frozenset({"Held", "Relaunch", "NoLongerFits"})


def _summary(p: PlanStatus) -> dict[str, Any]:
    return {
        "layersOnDevice": p.layers_on_device,
        "totalLayers": p.total_layers,
        "mindsGrantable": p.minds_grantable,
        "poolTokens": p.pool_tokens,
        "engineArgs": list(p.engine_args),
    }


def _skipped(name: str, note: str) -> dict[str, Any]:
    return {"engine": name, "verdict": "Skipped", "note": note}


def replay_one(e: Engine, boards: dict[str, Board], engines: Sequence[Engine]) -> dict[str, Any]:
    """One Engine's verdict (`cli_replay`'s module doc) with its plan in force and the new one."""
    name = f"{e.metadata.namespace}/{e.metadata.name}"
    was, placement = e.status.plan, e.status.placement
    if was is None or placement is None:
        return _skipped(name, "not placed: nothing runs that a new plan could relaunch")
    board = boards.get(placement.node)
    if board is None:
        return _skipped(name, f"no board of node {placement.node} in --boards")
    facts = e.spec.model.facts
    if e.spec.model.source is not None and e.status.model_facts is not None:
        facts = e.status.model_facts.facts
    if facts is None:
        return _skipped(name, "no facts: neither spec.model.facts nor status.modelFacts")
    me = (e.metadata.namespace, e.metadata.name)
    others = [
        o
        for o in engines
        if (o.metadata.namespace, o.metadata.name) != me
        and o.status.placement is not None
        and o.status.placement.node == placement.node
    ]
    status = e.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    runtime = status.get("runtime") or {}
    replayed = replan(
        board,
        e.spec,
        facts,
        f"Engine/{name}",
        [(x.pool, x.bytes) for x in placement.pools],
        engine_leases(others),
        engine_leases(o for o in others if o.status.placement and o.status.placement.assumed),
        receipts=receipts_of(status, was, e.spec.model.sha256, None).receipts,
        llama_build=runtime.get("llamaBuild"),
        on_gpus=was.gpus,
    )
    now = replayed.plan
    doc = PlanStatus.model_validate(now.to_dict())
    out: dict[str, Any] = {
        "engine": name,
        "node": placement.node,
        "was": _summary(was),
        "now": _summary(doc),
    }
    if not now.schedulable:
        why = now.reasons[-1].message if now.reasons else ""
        return {**out, "verdict": "NoLongerFits", "note": why}
    if now.engine_args != was.engine_args:
        unchanged = was.reading in (None, replayed.reading)
        accept = f"{ACCEPT_ANNOTATION}={plan_id(now.engine_args)}"
        if unchanged:
            note = f"held by the new operator until accepted: {accept}"
            return {**out, "verdict": "Held", "planId": plan_id(now.engine_args), "note": note}
        note = "the node reads otherwise than when the plan was made: damping relaunches it"
        return {**out, "verdict": "Relaunch", "planId": plan_id(now.engine_args), "note": note}
    if doc.bytes != was.bytes or doc.charges != was.charges:
        return {**out, "verdict": "Recharged", "note": "the same arguments, other bytes"}
    return {**out, "verdict": "Same", "note": ""}


def replay(engines: Sequence[Engine], boards: Sequence[NodeBoard]) -> list[dict[str, Any]]:
    """Every Engine's verdict, by namespace and name."""
    by_node = {b.metadata.name: Board.from_resource(b) for b in boards}
    ordered = sorted(engines, key=lambda e: (e.metadata.namespace or "", e.metadata.name))
    return [replay_one(e, by_node, engines) for e in ordered]


def _line(r: dict[str, Any]) -> str:
    if r["verdict"] == "Skipped":
        return f"{r['engine']}: Skipped: {r['note']}"
    was, now = r["was"], r["now"]

    def shape(p: dict[str, Any]) -> str:
        return (
            f"{p['layersOnDevice']}/{p['totalLayers']} layers, {p['mindsGrantable']} minds, "
            f"{p['poolTokens']} pool tokens"
        )

    note = f" ({r['note']})" if r["note"] else ""
    return f"{r['engine']} on {r['node']}: {r['verdict']}: {shape(was)} -> {shape(now)}{note}"


def cmd_replay(args: argparse.Namespace) -> int:
    if args.engines is None or args.boards is None:
        return fail(
            "--replay needs --engines FILE (kubectl get engines -A -o yaml > FILE) and "
            "--boards DIR (kubectl get nodeboards -o yaml > DIR/boards.yaml)",
            EXIT_INVALID,
        )
    try:
        engines = load_all(Engine, args.engines)
        boards = load_boards(args.boards)
    except (ManifestError, PlaceError) as err:
        return fail(str(err), EXIT_INVALID)
    results = replay(engines, boards)
    if args.output == "table":
        for r in results:
            print(_line(r))
        changed = sum(1 for r in results if r["verdict"] in CHANGES)
        print(f"{changed} of {len(results)} engine(s) would change plan")
    else:
        print(render({"engines": results}, args.output))
    return EXIT_CHANGES if any(r["verdict"] in CHANGES for r in results) else EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`continuum plan`'s replay arguments."""
    p.add_argument(
        "--replay",
        action="store_true",
        help="before an upgrade: re-plan every placed Engine of --engines on its board of "
        "--boards with this planner, and list each whose plan would change",
    )
    p.add_argument(
        "--engines", type=Path, help="with --replay: kubectl get engines -A -o yaml, saved"
    )
    p.add_argument("--boards", type=Path, help="with --replay: a directory of NodeBoard files")
