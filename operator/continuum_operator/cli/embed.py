"""`continuum embed`: its arguments and exit codes; the process itself (one EmbedLane's
embeddings within its lease) is `embed.runtime`, which takes them as `LaneProcessSettings`.

Exit codes as in `cli`: 0 stopped (SIGTERM, SIGINT), 2 bad arguments, a lane or lane file it
cannot use, or no API server to log in to.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from continuum_operator.cli.process import namespaced, on_all_addresses, run_process
from continuum_operator.door.accounts import lane_audience
from continuum_operator.embed.runtime import Callers, LaneProcessSettings, serve

__all__ = ["add_arguments", "cmd_embed", "settings_from"]


def cmd_embed(args: argparse.Namespace) -> int:
    # OSError: a lane file it cannot read, or no API server to log in to (ConnectionError).
    invalid = (ValueError, OSError)
    return run_process(_refusal(args), lambda: serve(settings_from(args)), invalid)


def _refusal(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, and what to give instead; None: nothing."""
    if (args.lane is None) == (args.lane_file is None):
        return "give --lane NAMESPACE/NAME or --lane-file FILE (one of them)"
    if args.lane is not None and "/" not in args.lane:
        return f"--lane {args.lane}: expected NAMESPACE/NAME"
    if not args.model.is_file():
        return f"--model {args.model}: no such file"
    if args.unsafe_no_review and args.review_tokens:
        return "--review-tokens and --unsafe-no-review contradict each other: give one"
    reviewed = not args.unsafe_no_review
    if reviewed and args.lane is None and not (args.token_audience and args.callers_namespace):
        return (
            "--lane-file FILE: callers' tokens are reviewed with the API server; give "
            "--token-audience AUDIENCE and --callers-namespace NAMESPACE (whose service "
            "accounts are served), or, on a machine of your own, --unsafe-no-review"
        )
    return None


def settings_from(args: argparse.Namespace) -> LaneProcessSettings:
    """The process's settings from its parsed arguments (`_refusal` found nothing wrong):
    the lane a (namespace, name), `--admin-port` an address on all interfaces, the callers the
    lane's own audience and namespace unless given, none with the unsafe flag."""
    lane = namespaced(args.lane) if args.lane is not None else None
    callers: Callers | None = None
    if not args.unsafe_no_review:
        audience, namespace = args.token_audience, args.callers_namespace
        if lane is not None:
            audience = audience or lane_audience(*lane)
            namespace = namespace or lane[0]
        assert audience and namespace  # _refusal checked
        callers = Callers(audience, namespace)
    return LaneProcessSettings(
        model=args.model,
        model_sha256=args.model_sha256,
        lane=lane,
        lane_file=args.lane_file,
        max_context_tokens=args.max_context_tokens,
        listen=args.listen,
        admin_listen=on_all_addresses(args.admin_port, args.admin_listen),
        callers=callers,
        status_file=args.status_file,
        threads=args.threads,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum embed` (cli.py declares the command)."""
    p.add_argument("--model", type=Path, required=True, help="the GGUF model file")
    p.add_argument("--model-sha256", "--sha256", dest="model_sha256", help="the model's digest")
    p.add_argument("--lane", help="NAMESPACE/NAME: read its lease, write its status.runtime")
    p.add_argument("--lane-file", type=Path, help="an EmbedLane or placement file, watched")
    p.add_argument("--max-context-tokens", type=int, help="when the file is a bare placement")
    p.add_argument("--listen", default="0.0.0.0:8080", help="address of /v1/embeddings (host:port)")
    p.add_argument(
        "--admin-listen",
        default="127.0.0.1:0",
        help="address of /metrics and /v1/runtime (never served on --listen)",
    )
    p.add_argument("--admin-port", type=int, help="the admin port on all addresses")
    p.add_argument(
        "--review-tokens",
        action="store_true",
        help="require each caller's service account token (Authorization: Bearer), reviewed "
        "with the API server (a TokenReview with the lane's audience); the default, said "
        "explicitly in the operator's pods",
    )
    p.add_argument(
        "--token-audience",
        help="the audience callers' tokens must carry (default with --lane NS/NAME: "
        "continuum.dev/embedlane/NS/NAME)",
    )
    p.add_argument(
        "--callers-namespace",
        help="serve only service accounts of this namespace (default with --lane NS/NAME: NS)",
    )
    p.add_argument(
        "--unsafe-no-review",
        action="store_true",
        help="serve anyone who reaches --listen, without a token (a machine of one's own only)",
    )
    p.add_argument("--status-file", type=Path, help="also write status.runtime here (JSON)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
