"""The `continuum` command: offline planning now; operator, agent and engine as they land.

Exit codes follow one rule across subcommands: 0 done, 2 invalid input (a message naming the
file, the field path and what is wrong), 3 a valid request that cannot be satisfied (reasons
printed).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from continuum_operator import (
    checklog,
    cli_facts,
    cli_model,
    cli_place,
    cli_replay,
    procclass,
    scenario,
)
from continuum_operator.agent import cli as agent_cli
from continuum_operator.cli_args import Subcommand
from continuum_operator.cli_errors import fail
from continuum_operator.cli_output import add_output_argument, render
from continuum_operator.core.placements import engine_leases
from continuum_operator.core.plan import ServingPlan, plan
from continuum_operator.core.pools import Board, BoardLeases
from continuum_operator.embed import runtime as embed_runtime
from continuum_operator.engine import runtime as engine_runtime
from continuum_operator.engine import turn as turn_cli
from continuum_operator.engine.receipts import ReceiptFileError, load_receipts
from continuum_operator.kube.process import release as release_cli
from continuum_operator.kube.process import run as operator_cli
from continuum_operator.manifests import ManifestError, load_all, load_one
from continuum_operator.model.board import NodeBoard
from continuum_operator.model.engine import Engine

EXIT_OK = 0
EXIT_INVALID = 2
EXIT_UNSCHEDULABLE = 3


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f} MiB"


def plan_table(p: ServingPlan) -> str:
    rows = [
        ("Node", p.node),
        ("Memory mode", f"{p.memory_mode}" + ("" if p.governed else " (device ungoverned)")),
        ("Schedulable", "yes" if p.schedulable else "no"),
        ("Layers on device", f"{p.layers_on_device}/{p.total_layers}"
         + (" (GPU-servable)" if p.gpu_servable else "")),
        ("Minds grantable", f"{p.minds_grantable} x {p.context_tokens_per_mind} tokens"),
        ("Pool tokens", f"{p.pool_tokens} ({p.kv_cache_type})"),
        ("Budget", f"device {_mib(p.budget.device)}, host {_mib(p.budget.host)}, "
         f"per-process cap {_mib(p.budget.per_process_cap)}"),
    ]  # fmt: skip
    out = [f"{k + ':':<18} {v}" for k, v in rows]
    out.append("")
    out.append(
        f"{'BYTES':<8} {'WEIGHTS':>12} {'KV':>12} {'COMPUTE':>12} {'RESERVE':>12} {'TOTAL':>12}"
    )
    for side, part in (("device", p.device), ("host", p.host)):
        cells = (part.weights, part.kv, part.compute, part.reserve, part.total)
        out.append(f"{side:<8} " + " ".join(f"{_mib(c):>12}" for c in cells))
    out.append("")
    out.append("Charges: " + (", ".join(f"{pool} {_mib(n)}" for pool, n in p.charges) or "none"))
    out.append("Engine args: " + " ".join(p.engine_args))
    out.append("Reasons:")
    out.extend(f"  {r.code}: {r.message}" for r in p.reasons)
    return "\n".join(out)


def _print_plan(p: ServingPlan, output: str) -> None:
    doc: dict[str, Any] = p.to_dict()
    print(render(doc, output, lambda: plan_table(p)))


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or why there is none."""
    try:
        return package_version("continuum-operator")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (continuum-operator is not installed: pip install -e .)"


def cmd_plan(args: argparse.Namespace) -> int:
    if args.replay:
        return cli_replay.cmd_replay(args)
    if args.board is None or args.engine is None:
        return fail(
            "plan needs --board FILE and --engine FILE (or --replay, with --engines and "
            "--boards, to re-plan every placed Engine before an upgrade)",
            EXIT_INVALID,
        )
    try:
        board = load_one(NodeBoard, args.board)
        engine = load_one(Engine, args.engine)
        others = [e for path in args.lease for e in load_all(Engine, path)]
        receipts = load_receipts(args.receipt)
    except (ManifestError, ReceiptFileError) as err:
        return fail(str(err), EXIT_INVALID)
    facts = engine.spec.model.facts
    if facts is None:
        return fail(
            f"{args.engine}: spec.model.facts: this Engine names a model source but no "
            "inline facts; run `continuum facts MODEL.gguf` and put its output in "
            "spec.model.facts to plan offline",
            EXIT_INVALID,
        )
    me = (engine.metadata.namespace, engine.metadata.name)
    leases = engine_leases(e for e in others if (e.metadata.namespace, e.metadata.name) != me)
    core_board = Board.from_resource(board)
    result = plan(
        core_board, engine.spec, facts, BoardLeases.of(core_board, leases), receipts=receipts
    )
    _print_plan(result, args.output)
    if not result.schedulable:
        for reason in result.reasons:
            print(f"unschedulable: {reason.code}: {reason.message}", file=sys.stderr)
        return EXIT_UNSCHEDULABLE
    return EXIT_OK


def _plan_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum plan`."""
    p.add_argument("--board", type=Path, help="a NodeBoard YAML file")
    p.add_argument("--engine", type=Path, help="an Engine YAML file")
    cli_place.add_placed_inputs(p)
    cli_replay.add_arguments(p)
    add_output_argument(p, table="the plan's rows, bytes per side and its reasons")


#: The subcommands of `continuum`, in the order `continuum --help` lists them. Each module says
#: how its arguments are parsed and what runs; this table says what the command is called and
#: how `--help` presents it, so that every subcommand is registered the same way.
SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "plan",
        help="plan an Engine on one node's board, offline",
        description="Compute the serving plan of an Engine on a NodeBoard, as the operator would.",
        add_arguments=_plan_arguments,
        run=cmd_plan,
    ),
    Subcommand(
        "place",
        help="place an Engine by best fit across many boards, offline",
        description="Choose the node the operator would place an Engine on, from a directory "
        "of NodeBoards, and print the condition message it would write.",
        add_arguments=cli_place.add_arguments,
        run=cli_place.cmd_place,
    ),
    Subcommand(
        "simulate",
        help="simulate engines and minds in virtual time through the real allocator",
        description="Discrete-event simulation of grants, reclaims, relaunches and turns.",
        add_arguments=scenario.add_arguments,
        run=scenario.cmd_simulate,
    ),
    Subcommand(
        "check-log",
        help="check the grant invariants over a transition log",
        description="Check a grant transition log (JSON lines, docs/transition-log.md) against "
        "the invariants of docs/design.md rule 7. Exits 0 when they hold, 1 with violations, 2 for "
        "an unreadable, malformed, empty or truncated log.",
        add_arguments=checklog.add_arguments,
        run=checklog.cmd_check_log,
    ),
    Subcommand(
        "facts",
        help="print a GGUF model's facts for spec.model.facts",
        description="Read a GGUF file's header and tensor index (never its weights) and print "
        "the facts an Engine's spec.model.facts holds.",
        add_arguments=cli_facts.add_arguments,
        run=cli_facts.cmd_facts,
    ),
    Subcommand(
        "model",
        help="write a model file to try Engines with",
        description="Model files to try Engines with (nothing is downloaded).",
        add_arguments=cli_model.add_arguments,
        run=None,  # `model tiny` runs cli_model.cmd_model_tiny
    ),
    Subcommand(
        "engine",
        help="run llama-server behind the grant gateway (an engine pod's process)",
        description="Start llama-server with the plan's arguments, capture its load receipt, "
        "and serve the grant gateway of docs/gateway.md in front of it. Arguments after `--` "
        "go to llama-server instead of the plan's engineArgs.",
        add_arguments=engine_runtime.add_arguments,
        run=engine_runtime.cmd_engine,
    ),
    Subcommand(
        "turn",
        help="take a turn as a mind: stream a chat reply, with the grant, slot and any cut-off",
        description="Open a turn for the Mind on her engine's gateway (waiting, with the "
        "reason, up to her spec.turnDeadlineSeconds), stream one chat reply to stdout, and say "
        "the grant, the slot and any cut-off on stderr. Exit 0 done, 1 refused or no grant by "
        "the deadline, 2 bad arguments, 3 the turn was cut (her grant is being reclaimed).",
        add_arguments=turn_cli.add_arguments,
        run=turn_cli.cmd_turn,
    ),
    Subcommand(
        "embed",
        help="serve embeddings for an EmbedLane within its lease (an embed lane's process)",
        description="llama-cpp-python in embedding mode (mean pooling): calibrates at the "
        "lane's largest context, admits requests against status.placement, and writes "
        "status.runtime (docs/embedlanes.md).",
        add_arguments=embed_runtime.add_arguments,
        run=embed_runtime.cmd_embed,
    ),
    Subcommand(
        "agent",
        help="run the node agent: probe memory, write the NodeBoard, renew the node's Lease",
        description="Probe this node's GPUs (NVML, Metal) and host memory (psutil, cgroups), "
        "write its NodeBoard when it changed past a threshold, and renew its Lease.",
        add_arguments=agent_cli.add_arguments,
        run=agent_cli.cmd_agent,
    ),
    Subcommand(
        "operator",
        help="run the operator against a cluster",
        description="Place, plan and run Engines from NodeBoards (docs/design.md) until stopped.",
        add_arguments=operator_cli.add_arguments,
        run=operator_cli.cmd_operator,
    ),
    Subcommand(
        "release-finalizers",
        help="take the operator's finalizers off Minds (before uninstalling the operator)",
        description="Stop the operator (optional), then remove continuum.dev/grant from every "
        "Mind, so that Minds deleted with no operator running do not stay Terminating. The "
        "chart runs it as a pre-delete hook.",
        add_arguments=release_cli.add_arguments,
        run=release_cli.cmd_release_finalizers,
    ),
    Subcommand(
        "run",
        help="run a command (and all it starts) in a process class",
        description=(
            "Run CMD and every process it starts at a process class: `background` is the "
            "OS's lowest ordinary priority (nice 19 on Unix, IDLE_PRIORITY_CLASS on Windows), "
            "for a mind's own work beside the engine that serves her (docs/design.md rule 8)."
        ),
        add_arguments=procclass.add_arguments,
        run=procclass.cmd_run,
        usage="continuum run [--class {normal,background}] [--sweep SECONDS] -- CMD [ARGS...]",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="continuum", description="Memory and turns for local-model serving."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in SUBCOMMANDS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
