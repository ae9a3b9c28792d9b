"""`continuum agent`: the node agent, as a DaemonSet (in-cluster) or on a bare machine.

    continuum agent --print                       # probe once, print the board; no cluster
    continuum agent --print --from-capture F.json # the board of a recorded machine
    continuum agent --node-name n1 --once         # one cycle against the kubeconfig's cluster
    continuum agent --in-cluster                  # the DaemonSet: NODE_NAME from the downward API
    continuum agent --in-cluster --metrics-port 9102   # and Prometheus metrics at :9102/metrics

Exit codes: 0 done, 1 the API server refused or could not be reached (with --once), 2 bad flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from continuum_operator.agent import attribution, probe
from continuum_operator.agent.metrics import AgentMetrics
from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, fail
from continuum_operator.cli.output import add_output_argument, render
from continuum_operator.core.board_change import Thresholds
from continuum_operator.core.heartbeat import LEASE_NAMESPACE
from continuum_operator.core.nodeboard import board_status

if TYPE_CHECKING:
    from continuum_operator.agent.run import Agent, AgentSettings

__all__ = ["add_arguments", "cmd_agent"]

EXIT_API = 1
MiB = 2**20


def _settings(args: argparse.Namespace) -> AgentSettings:
    # Imported here, as below: the agent's writer imports the `kubernetes` package, and every
    # process's command table imports this module (`cli.command`).
    from continuum_operator.agent.run import AgentSettings

    return AgentSettings(
        node_name=args.node_name,
        interval_seconds=args.interval,
        thresholds=Thresholds(
            used_fraction=args.threshold_fraction, used_min_bytes=args.threshold_mib * MiB
        ),
        probe=probe.ProbeSettings(
            cgroup_dir=args.cgroup_dir,
            cgroup_root=args.cgroup_root,
            scan_environ=not args.in_cluster if args.scan_environ is None else args.scan_environ,
            configured_cap_bytes=args.per_process_cap_bytes,
            disk_path=args.disk_path,
            mps_roots=tuple(args.mps_roots or attribution.MPS_PIPE_DIRS),
        ),
    )


def _print_board(agent: Agent, output: str, capture: Path | None) -> int:
    from continuum_operator.agent.run import board_resource

    if capture is not None:
        try:
            recorded = json.loads(capture.read_text())
            status = board_status(
                probe.readings(recorded, agent.settings.probe.configured_cap_bytes)
            )
        except (OSError, ValueError, KeyError, TypeError) as err:
            return fail(
                f"{capture}: not a probe capture ({type(err).__name__}: {err})", EXIT_INVALID
            )
        timings: dict[str, float] = {}
    else:
        status, timings = agent.probe()
    doc: dict[str, Any] = board_resource(agent.settings.node_name, status).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )
    print(render(doc, output))
    if timings:
        spent = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in timings.items())
        print(f"# probe: {spent}", file=sys.stderr)
    return EXIT_OK


def cmd_agent(args: argparse.Namespace) -> int:
    try:
        from continuum_operator.agent.run import Agent, run_forever
        from continuum_operator.agent.writer import AgentApi, AgentApiError, connect
    except ModuleNotFoundError as err:  # the agent alone needs it: an extra (pyproject.toml)
        if err.name != "kubernetes":
            raise
        return fail(
            "continuum agent needs the Kubernetes client package: install "
            "'continuum-operator[agent]' (the agent's image has it)",
            EXIT_INVALID,
        )
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not 0 <= args.metrics_port <= 65535:
        return fail(f"--metrics-port {args.metrics_port}: a port is 1-65535 (0: off)", EXIT_INVALID)
    if args.interval <= 0 or args.lease_seconds <= args.interval:
        return fail(
            f"--lease-seconds ({args.lease_seconds}) must exceed --interval "
            f"({args.interval}) > 0, or the Lease lapses between renewals",
            EXIT_INVALID,
        )
    settings = _settings(args)
    if args.from_capture is not None and not args.print:
        return fail("--from-capture goes with --print", EXIT_INVALID)
    if args.print:
        return _print_board(Agent(settings), args.output, args.from_capture)
    try:
        api_client = connect(args.kubeconfig, in_cluster=args.in_cluster)
    except Exception as err:  # the config loaders raise several unrelated types
        return fail(f"no cluster configuration: {err}", EXIT_INVALID)
    api = AgentApi(
        api_client,
        args.node_name,
        identity=os.environ.get("POD_NAME") or f"continuum-agent@{socket.gethostname()}",
        lease_namespace=args.lease_namespace,
        lease_seconds=args.lease_seconds,
    )
    metrics = None
    if args.metrics_port and not args.once:
        metrics = AgentMetrics(args.node_name)
        try:
            metrics.serve(args.metrics_port)
        except OSError as err:
            return fail(f"--metrics-port {args.metrics_port}: cannot listen: {err}", EXIT_INVALID)
    agent = Agent(settings, api, metrics=metrics)
    if args.once:
        try:
            cycle = agent.cycle()
        except AgentApiError as err:
            return fail(str(err), EXIT_API)
        print(
            f"node {args.node_name}: {cycle.status.memory_mode}, board "
            + ("written" if cycle.wrote else "unchanged")
            + f" ({cycle.change.reason}), lease renewed"
        )
        return EXIT_OK
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run_forever(agent, stop)
    return EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum agent` (cli.py declares the command)."""
    p.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME") or socket.gethostname(),
        help="the Node measured (default: $NODE_NAME, else the host name)",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="one cycle, then exit")
    mode.add_argument(
        "--print", action="store_true", help="probe once and print the board; no cluster needed"
    )
    # yaml by default: --print writes the NodeBoard the agent would apply.
    add_output_argument(p, default="yaml", table="with --print, one row per field of the board")
    p.add_argument(
        "--from-capture",
        type=Path,
        default=None,
        help="with --print: the board of a recorded machine (tests/fixtures/probes/*.json, "
        "tools/device_probe.py's captures) instead of this one",
    )
    p.add_argument("--interval", type=float, default=10.0, help="seconds between cycles")
    p.add_argument(
        "--lease-seconds", type=int, default=40, help="the Lease's duration (> --interval)"
    )
    p.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or LEASE_NAMESPACE,
        help="namespace of the agent's Lease, the operator's --agent-lease-namespace "
        f"(default: $POD_NAMESPACE, else {LEASE_NAMESPACE})",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--kubeconfig", default=None, help="default: $KUBECONFIG or ~/.kube/config")
    where.add_argument("--in-cluster", action="store_true", help="the pod's service account")
    _add_probe_arguments(p)
    p.add_argument(
        "--per-process-cap-bytes",
        type=int,
        default=None,
        help="an operator-configured per-process GPU cap, where the platform reports none",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics at this port's /metrics (0: off; the chart uses 9102)",
    )
    p.add_argument("--threshold-fraction", type=float, default=Thresholds().used_fraction)
    p.add_argument("--threshold-mib", type=int, default=Thresholds().used_min_bytes // MiB)


def _add_probe_arguments(p: argparse.ArgumentParser) -> None:
    """Where the probes look on this node: cgroups, the disk pool, MPS pipes, environments."""
    p.add_argument(
        "--cgroup-dir",
        type=Path,
        default=None,
        help="cgroup whose memory limit bounds the host pool (a DaemonSet: the host's kubepods "
        "cgroup); default: the agent's own, up to the root",
    )
    p.add_argument("--cgroup-root", type=Path, default=Path("/sys/fs/cgroup"))
    p.add_argument(
        "--disk-path",
        type=Path,
        default=None,
        help="a directory on the filesystem of the node's emptyDirs (a DaemonSet: the host's "
        "kubelet root, mounted): its disk is the board's disk pool, where Engines park "
        "contexts on disk (spec.park.tier disk); default: no disk pool",
    )
    p.add_argument(
        "--mps-root",
        dest="mps_roots",
        type=Path,
        action="append",
        default=None,
        help="where MPS control daemons keep their pipes (a daemon's own directory, or NVIDIA's "
        "device plugin's <root>/<resource>/pipe); repeatable. Default: "
        + ", ".join(str(d) for d in attribution.MPS_PIPE_DIRS),
    )
    p.add_argument(
        "--scan-environ",
        dest="scan_environ",
        action="store_true",
        default=None,
        help="match bare-machine engines by CONTINUUM_CONSUMER (default: on unless --in-cluster)",
    )
    p.add_argument("--no-scan-environ", dest="scan_environ", action="store_false")
