"""`continuum release-finalizers`: its arguments and exit codes; the release itself is
`kube.process.release`. Exit codes: 0 released, 1 the API server refused or could not be reached
(`EXIT_API`), or the operator did not stop in time, 2 bad flags or no cluster configuration (as
in `cli`)."""

from __future__ import annotations

import argparse
import logging

from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, fail
from continuum_operator.kube.client.api import (
    ApiError,
    KubeApi,
)
from continuum_operator.kube.client.login import LoginError
from continuum_operator.kube.process.release import (
    StopTimeout,
    release_finalizers,
    stop_operator,
)

#: Exit code of a release the API server refused, could not be reached for, or an operator
#: that did not stop within --timeout.
EXIT_API = 1


def cmd_release_finalizers(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop: tuple[str, str] | None = None
    if args.stop_operator is not None:
        ns, slash, name = str(args.stop_operator).partition("/")
        if not slash or not ns or not name:
            return fail(
                f"--stop-operator {args.stop_operator!r}: expected NAMESPACE/NAME of "
                "the operator's Deployment",
                EXIT_INVALID,
            )
        stop = (ns, name)
    if args.timeout <= 0:
        return fail(f"--timeout {args.timeout}: must be > 0 seconds", EXIT_INVALID)
    try:
        api = KubeApi(args.kubeconfig)
    except LoginError as err:  # it says what was wrong and what to do
        return fail(str(err), EXIT_INVALID)
    try:
        if stop is not None:
            pods = stop_operator(api, *stop, timeout=args.timeout)
            print(f"operator {stop[0]}/{stop[1]} stopped ({pods} pod(s) waited for)")
        done = release_finalizers(api)
    except (StopTimeout, ApiError, OSError) as err:
        return fail(str(err), EXIT_API)
    for what in done.released:
        print(f"released {what}")
    print(f"{len(done.released)} of {done.seen} object(s) had the operator's finalizer")
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum release-finalizers` (cli.py declares the command)."""
    p.add_argument("--kubeconfig", help="default: in a pod its ServiceAccount, else $KUBECONFIG")
    p.add_argument(
        "--stop-operator",
        metavar="NAMESPACE/NAME",
        help="the operator's Deployment: scaled to 0 and waited for first (a running operator "
        "puts the finalizers back)",
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for its pods to go"
    )
