"""`continuum turn NAMESPACE/NAME`: take a turn as a mind on her engine's gateway, from the shell
(the token from `--token-file` or `CONTINUUM_TOKEN`); the turn itself is `engine.turn`."""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path

from continuum_operator.cli.errors import fail
from continuum_operator.engine.turn import EXIT_INVALID, read_mind, take_turn


def cmd_turn(args: argparse.Namespace) -> int:
    namespace, _, name = args.mind.partition("/")
    if not namespace or not name:
        return fail(f"{args.mind}: expected NAMESPACE/NAME of a Mind", EXIT_INVALID)
    token = os.environ.get("CONTINUUM_TOKEN") or None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as err:
            return fail(
                f"--token-file {args.token_file}: cannot read it ({err}); give the file of "
                "her service account token projected with the engine's audience "
                "(docs/gateway.md), or set CONTINUUM_TOKEN",
                EXIT_INVALID,
            )
    gateway, deadline = args.gateway, args.deadline
    if gateway is None or deadline is None:
        try:
            mind = read_mind(namespace, name)
        except Exception as err:  # no cluster, no such Mind: say which and what to give
            return fail(
                f"cannot read Mind {args.mind} ({err}); give --gateway URL "
                "(and --deadline SECONDS) to take a turn without the cluster",
                EXIT_INVALID,
            )
        gateway = gateway or (mind.get("status") or {}).get("endpoint")
        if deadline is None:
            deadline = float((mind.get("spec") or {}).get("turnDeadlineSeconds", 1500))
        if not gateway:
            return fail(
                f"Mind {args.mind} has no status.endpoint yet (no engine serves her); "
                "give --gateway URL",
                EXIT_INVALID,
            )
    return asyncio.run(take_turn(args, str(gateway), float(deadline), token))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum turn` (cli.py declares the command)."""
    p.add_argument("mind", help="NAMESPACE/NAME of the Mind")
    p.add_argument("prompt", help="what to say")
    p.add_argument("--gateway", help="the engine's URL (default: the Mind's status.endpoint)")
    p.add_argument(
        "--token-file",
        type=Path,
        help="her service account token, projected with the engine's audience (default: "
        "$CONTINUUM_TOKEN)",
    )
    p.add_argument("--max-tokens", type=int, help="the most tokens to generate (the grant caps)")
    p.add_argument(
        "--deadline",
        type=float,
        help="seconds to wait for a grant (default: the Mind's spec.turnDeadlineSeconds)",
    )
