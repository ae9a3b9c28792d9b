"""`continuum turn NAMESPACE/NAME`: take a turn as a mind on her engine's gateway, from the shell
(the token from `--token-file` or `CONTINUUM_TOKEN`), the reply streamed to stdout and the grant,
slot and any cut-off said on stderr; the turn client itself is `engine.turn`.

Exit codes: 0 done, 1 refused or no grant by the deadline (`EXIT_REFUSED`), 2 bad arguments (as
in `cli`), 3 the turn was cut, her grant being reclaimed (`EXIT_CUT`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp

from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, fail
from continuum_operator.engine.turn import TurnCut, TurnError, turn

__all__ = ["EXIT_CUT", "EXIT_REFUSED", "add_arguments", "cmd_turn", "read_mind", "take_turn"]

#: Exit code of a turn refused, or with no grant by the deadline.
EXIT_REFUSED = 1
#: Exit code of a turn cut (her grant is being reclaimed).
EXIT_CUT = 3


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
    return asyncio.run(
        take_turn(args.mind, args.prompt, args.max_tokens, str(gateway), float(deadline), token)
    )


def read_mind(namespace: str, name: str) -> dict[str, Any]:
    """The Mind object (her endpoint and turn deadline), with the kubeconfig or in-cluster:
    one GET before any turn, on the CLI's blocking adapter (`kube.client.api.KubeApi`)."""
    # Imported here: the turn client itself needs no Kubernetes, only this command does.
    from continuum_operator.kube.client.api import KubeApi, crd_path

    return KubeApi().request("GET", crd_path("minds", namespace, name))


async def take_turn(
    mind: str,
    prompt: str,
    max_tokens: int | None,
    gateway: str,
    deadline: float,
    token: str | None,
) -> int:
    """One turn of `mind` saying `prompt`: the reply on stdout, the rest on stderr; the exit
    code."""
    err = sys.stderr
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    try:
        async with turn(
            gateway, mind, deadline_seconds=deadline, token=token, poll_seconds=1.0
        ) as t:
            for w in t.waits:
                print(f"waited {w.seconds:.1f} s: {w.reason}", file=err)
            print(f"turn {t.turn_id}: slot {t.slot}, grant {t.tokens} tokens", file=err)
            async for text in t.stream_chat(body):
                sys.stdout.write(text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            note = t.note
            summary = f"slot {note.get('slot')}, {note.get('nPredict')} tokens allowed"
            print(f"done: {summary} of a grant of {note.get('grantTokens')}", file=err)
            if note.get("cutOff"):
                print(f"cut off ({note['cutOff']}): {note.get('message')}", file=err)
    except TurnCut as cut:
        print(f"\n{cut}", file=err)
        return EXIT_CUT
    except TurnError as refused:
        print(f"error: {refused}", file=err)
        return EXIT_REFUSED
    except aiohttp.ClientError as down:
        print(f"error: {gateway}: {down}", file=err)
        return EXIT_REFUSED
    except TimeoutError:
        print(f"error: {gateway}: no answer within 30 s of connecting", file=err)
        return EXIT_REFUSED
    return EXIT_OK


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
