"""The `continuum` command's table of subcommands (`SUBCOMMANDS`), its parser and `main`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

from continuum_operator.cli import agent as cli_agent
from continuum_operator.cli import check_log as cli_check_log
from continuum_operator.cli import embed as cli_embed
from continuum_operator.cli import engine as cli_engine
from continuum_operator.cli import facts as cli_facts
from continuum_operator.cli import model as cli_model
from continuum_operator.cli import operator as cli_operator
from continuum_operator.cli import place as cli_place
from continuum_operator.cli import plan as cli_plan
from continuum_operator.cli import release as cli_release
from continuum_operator.cli import run as cli_run
from continuum_operator.cli import simulate as cli_simulate
from continuum_operator.cli import turn as cli_turn
from continuum_operator.cli.args import Subcommand


def _version() -> str:
    """The installed distribution's version (pyproject.toml's), or why there is none."""
    try:
        return package_version("continuum-operator")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (continuum-operator is not installed: pip install -e .)"


#: The subcommands of `continuum`, in the order `continuum --help` lists them. Each module says
#: how its arguments are parsed and what runs; this table says what the command is called and
#: how `--help` presents it, so that every subcommand is registered the same way.
SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "plan",
        help="plan an Engine on one node's board, offline",
        description="Compute the serving plan of an Engine on a NodeBoard, as the operator would.",
        add_arguments=cli_plan.add_arguments,
        run=cli_plan.cmd_plan,
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
        add_arguments=cli_simulate.add_arguments,
        run=cli_simulate.cmd_simulate,
    ),
    Subcommand(
        "check-log",
        help="check the grant invariants over a transition log",
        description="Check a grant transition log (JSON lines, docs/transition-log.md) against "
        "the invariants of docs/design.md rule 7. Exits 0 when they hold, 1 with violations, 2 for "
        "an unreadable, malformed, empty or truncated log.",
        add_arguments=cli_check_log.add_arguments,
        run=cli_check_log.cmd_check_log,
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
        add_arguments=cli_engine.add_arguments,
        run=cli_engine.cmd_engine,
    ),
    Subcommand(
        "turn",
        help="take a turn as a mind: stream a chat reply, with the grant, slot and any cut-off",
        description="Open a turn for the Mind on her engine's gateway (waiting, with the "
        "reason, up to her spec.turnDeadlineSeconds), stream one chat reply to stdout, and say "
        "the grant, the slot and any cut-off on stderr. Exit 0 done, 1 refused or no grant by "
        "the deadline, 2 bad arguments, 3 the turn was cut (her grant is being reclaimed).",
        add_arguments=cli_turn.add_arguments,
        run=cli_turn.cmd_turn,
    ),
    Subcommand(
        "embed",
        help="serve embeddings for an EmbedLane within its lease (an embed lane's process)",
        description="llama-cpp-python in embedding mode (mean pooling): calibrates at the "
        "lane's largest context, admits requests against status.placement, and writes "
        "status.runtime (docs/embedlanes.md).",
        add_arguments=cli_embed.add_arguments,
        run=cli_embed.cmd_embed,
    ),
    Subcommand(
        "agent",
        help="run the node agent: probe memory, write the NodeBoard, renew the node's Lease",
        description="Probe this node's GPUs (NVML, Metal) and host memory (psutil, cgroups), "
        "write its NodeBoard when it changed past a threshold, and renew its Lease.",
        add_arguments=cli_agent.add_arguments,
        run=cli_agent.cmd_agent,
    ),
    Subcommand(
        "operator",
        help="run the operator against a cluster",
        description="Place, plan and run Engines from NodeBoards (docs/design.md) until stopped.",
        add_arguments=cli_operator.add_arguments,
        run=cli_operator.cmd_operator,
    ),
    Subcommand(
        "release-finalizers",
        help="take the operator's finalizers off Minds (before uninstalling the operator)",
        description="Stop the operator (optional), then remove continuum.dev/grant from every "
        "Mind, so that Minds deleted with no operator running do not stay Terminating. The "
        "chart runs it as a pre-delete hook.",
        add_arguments=cli_release.add_arguments,
        run=cli_release.cmd_release_finalizers,
    ),
    Subcommand(
        "run",
        help="run a command (and all it starts) in a process class",
        description=(
            "Run CMD and every process it starts at a process class: `background` is the "
            "OS's lowest ordinary priority (nice 19 on Unix, IDLE_PRIORITY_CLASS on Windows), "
            "for a mind's own work beside the engine that serves her (docs/design.md rule 8)."
        ),
        add_arguments=cli_run.add_arguments,
        run=cli_run.cmd_run,
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
