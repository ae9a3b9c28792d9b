"""`continuum engine`: its arguments and exit codes; the process itself (llama-server behind
the grant gateway) is `engine.runtime`, which takes them as `EngineProcessSettings`.

Exit codes as in `cli`: 0 stopped (SIGTERM, SIGINT, or llama-server stopped after too many
restarts), 2 bad arguments, a plan or grant file it cannot use, or no API server to log in to.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from continuum_operator.cli.args import at_least_one
from continuum_operator.cli.process import namespaced, on_all_addresses, run_process
from continuum_operator.engine.admission import GrantTableError, engine_audience
from continuum_operator.engine.runtime import EngineProcessSettings, PlanFileError, serve
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ENV

__all__ = ["add_arguments", "cmd_engine", "settings_from"]


def cmd_engine(args: argparse.Namespace) -> int:
    # ConnectionError: no API server to log in to.
    invalid = (GrantTableError, PlanFileError, ConnectionError)
    return run_process(_refusal(args), lambda: serve(settings_from(args)), invalid)


def _refusal(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line, and what to give instead; None: nothing."""
    if (args.grants is None) == (args.engine is None):
        return "give --grants FILE or --engine NAMESPACE/NAME (one of them)"
    if args.engine is not None and "/" not in args.engine:
        return f"--engine {args.engine}: expected NAMESPACE/NAME"
    if not args.model.is_file():
        return f"--model {args.model}: no such file"
    if args.park_budget < 0 or (args.park_budget > 0 and args.park_dir is None):
        return (
            f"--park-budget {args.park_budget}: a count of bytes, 0 or more, with --park-dir "
            "naming the store's directory"
        )
    if not args.unsafe_trust_mind_header and args.engine is None and not args.token_audience:
        return (
            "--grants FILE: give --token-audience AUDIENCE (minds' tokens are reviewed "
            "with the API server) or, on a machine of your own, --unsafe-trust-mind-header"
        )
    return None


def settings_from(args: argparse.Namespace) -> EngineProcessSettings:
    """The process's settings from its parsed arguments (`_refusal` found nothing wrong):
    `--port` and `--admin-port` are addresses on all interfaces, the Engine a (namespace,
    name), the audience the Engine's own unless given, none with the unsafe flag."""
    engine = namespaced(args.engine) if args.engine is not None else None
    audience: str | None = args.token_audience
    if args.unsafe_trust_mind_header:
        audience = None
    elif audience is None and engine is not None:
        audience = engine_audience(*engine)
    return EngineProcessSettings(
        model=args.model,
        grants=args.grants,
        engine=engine,
        plan=args.plan,
        status_file=args.status_file,
        model_sha256=args.model_sha256,
        verify_model=args.model_sha256 is not None or not args.no_receipt,
        rehash=args.rehash,
        threads=args.threads,
        max_restarts=args.max_restarts,
        restart_window_seconds=args.restart_window,
        llama_server=args.llama_server,
        upstream_port=args.upstream_port,
        llama_build=args.llama_build,
        llama_args=_llama_args(args.llama_args),
        park_dir=args.park_dir,
        park_budget_bytes=max(0, args.park_budget),
        grace_seconds=args.grace,
        token_audience=audience,
        listen=on_all_addresses(args.port, args.listen),
        admin_listen=on_all_addresses(args.admin_port, args.admin_listen),
        access_log=args.access_log,
        launch=os.environ.get(LAUNCH_ENV) or None,
    )


def _llama_args(values: list[str]) -> tuple[str, ...]:
    """llama-server's arguments after `--` (argparse keeps the `--` of a remainder)."""
    return tuple(values[1:] if values and values[0] == "--" else values)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum engine` (cli.py declares the command)."""
    p.add_argument("--model", type=Path, required=True, help="the GGUF model file")
    p.add_argument(
        "--model-sha256",
        "--sha256",
        dest="model_sha256",
        help="the digest the Engine names: the file is hashed and must match before "
        "llama-server starts (without it, the file's own digest keys the receipts)",
    )
    p.add_argument(
        "--no-receipt",
        action="store_true",
        help="without --sha256: do not hash the model, make no receipt",
    )
    p.add_argument(
        "--rehash",
        action="store_true",
        help="hash the model even where status.runtime.modelFile says this file was verified",
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        help="llama-server's --threads and --threads-batch (the pod's CPUs)",
    )
    p.add_argument(
        "--max-restarts",
        type=_positive_int,
        default=5,
        help="restarts of llama-server allowed in --restart-window; the next exit stops it",
    )
    p.add_argument(
        "--restart-window",
        type=float,
        default=600.0,
        help="seconds over which --max-restarts are counted",
    )
    p.add_argument("--plan", type=Path, help="the serving plan (plan -o json, or an Engine)")
    p.add_argument("--grants", type=Path, help="a grant table file, watched for changes")
    p.add_argument(
        "--engine",
        help="NAMESPACE/NAME: enforce its GrantLedger's grants, write its status.runtime",
    )
    p.add_argument("--listen", default="0.0.0.0:8080", help="the gateway's address (host:port)")
    p.add_argument("--port", type=int, help="the gateway's port on all addresses (for --listen)")
    p.add_argument("--llama-server", default="llama-server", help="the llama-server binary")
    p.add_argument("--upstream-port", type=int, default=0, help="llama-server's loopback port")
    p.add_argument("--llama-build", help="llama.cpp's build, when its log does not name it")
    p.add_argument("--status-file", type=Path, help="also write status.runtime here (JSON)")
    p.add_argument("--grace", type=float, default=30.0, help="reclaim grace without a deadline")
    p.add_argument(
        "--review-tokens",
        action="store_true",
        help="require each mind's service account token (Authorization: Bearer), reviewed "
        "with the API server (a TokenReview with the engine's audience); the default, said "
        "explicitly in the operator's pods",
    )
    p.add_argument(
        "--token-audience",
        help="the audience minds' tokens must carry (default with --engine NS/NAME: "
        "continuum.dev/engine/NS/NAME)",
    )
    p.add_argument(
        "--unsafe-trust-mind-header",
        action="store_true",
        help="believe the X-Continuum-Mind header without a token: anyone who reaches the "
        "port can spend any mind's grant (a machine of one's own only)",
    )
    _add_admin_arguments(p)
    _add_park_arguments(p)
    p.add_argument("llama_args", nargs=argparse.REMAINDER, help="-- then llama-server arguments")


def _add_admin_arguments(p: argparse.ArgumentParser) -> None:
    """The admin address (never served to minds) and the access log."""
    p.add_argument(
        "--admin-listen",
        default="127.0.0.1:0",
        help="address of /metrics, /v1/releases, /v1/runtime (not served to minds)",
    )
    p.add_argument("--admin-port", type=int, help="the admin port on all addresses")
    p.add_argument(
        "--access-log",
        action="store_true",
        help="log a line per request served to minds (off: the metrics count every request "
        "and refusal, and a line costs about a tenth of a request's CPU)",
    )


def _add_park_arguments(p: argparse.ArgumentParser) -> None:
    """The park store's arguments (docs/gateway.md, "A turn cut off")."""
    p.add_argument(
        "--park-dir",
        type=Path,
        help="the park store (llama-server's --slot-save-path): reclaimed minds' contexts "
        "are saved here and restored at their next grant",
    )
    p.add_argument(
        "--park-budget",
        type=int,
        default=0,
        help="bytes the park store may hold (the Engine's park budget); 0: never park",
    )


#: llama-server's counts (threads, restarts): 1 or more.
_positive_int = at_least_one("a positive count")
