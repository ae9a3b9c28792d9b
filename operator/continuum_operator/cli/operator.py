"""`continuum operator`: its flags, read into `OperatorSettings`, and its exit codes; the
process itself (kopf's watches, the loops, the webhook, metrics) is `kube.process.run`.

Every setting of `kube.base.settings` that an operator of a cluster would tune has a flag, one
`SettingFlag` row each (the grants', the leader's and the children's webhook's rows are
`cli.operator_sections`'). Exit codes as in `cli`: 0 stopped, 2 a bad flag (argparse's message
names it and what it takes) or two flags that disagree (`operator_sections.refusal` says how).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
from dataclasses import replace

from continuum_operator.cli import operator_sections
from continuum_operator.cli.args import SettingFlag, add_flags, at_least_one, settings_from_flags
from continuum_operator.cli.errors import EXIT_INVALID, fail
from continuum_operator.core.heartbeat import LEASE_NAMESPACE
from continuum_operator.kube.base.settings import GpuClaims, GpuSharing, OperatorSettings
from continuum_operator.kube.process.run import serve
from continuum_operator.kube.workloads import lane_objects

__all__ = ["add_arguments", "cmd_operator", "selector_labels", "settings_from"]


def cmd_operator(args: argparse.Namespace) -> int:
    refusal = operator_sections.refusal(args)
    if refusal is not None:
        return fail(refusal, EXIT_INVALID)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # kopf logs every watch event it hands over; the loop logs what it decides.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's login reads it too
    labels = selector_labels(args.engine_selector)
    return asyncio.run(serve(settings_from(args), args.kubeconfig, args.metrics_port, labels))


#: A count of 1 or more (whole CPUs keep an engine pod in the Guaranteed class).
_whole_cpus = at_least_one("1 or more")


def _cpu_quantity(text: str) -> str:
    """A Kubernetes CPU quantity above 0: whole or decimal CPUs (`2`, `1.5`) or millicores
    (`500m`), as a pod's resources take it."""
    value = lane_objects.cpu_cores(text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a CPU quantity above 0 (write 2, 1.5 or 500m)"
        )
    return text


def _runtime_class(text: str) -> str:
    """A RuntimeClass's name (a DNS subdomain), or "" for the node's default runtime."""
    if text and not _SUBDOMAIN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a RuntimeClass name (lowercase letters, digits, '-' and '.'; "
            "`kubectl get runtimeclass` lists the cluster's)"
        )
    return text


_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")


def _share(text: str) -> float:
    """A fraction in (0, 1]: of a node's allocatable CPUs."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not a fraction above 0 and at most 1")
    return value


def _host_directory(text: str) -> str:
    """An absolute host directory without `..` segments (trailing slashes dropped)."""
    path = text.rstrip("/") or "/"
    if not path.startswith("/") or ".." in path.split("/"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an absolute directory without '..' segments (e.g. /srv/models)"
        )
    return path


def selector_labels(text: str) -> dict[str, str]:
    """`a=b,c=d` into labels: an equality selector (`model.base.label_selector` writes it
    back for the watch). A part that is not KEY=VALUE is an `argparse.ArgumentTypeError`
    (`--engine-selector`'s type checks it as the command line is parsed)."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise argparse.ArgumentTypeError(
                f"{part!r} is not KEY=VALUE (write app=coder, or app=coder,tier=gold)"
            )
        labels[key] = value
    return labels


def _selector(text: str) -> str:
    """argparse's type of `--engine-selector`: the selector as written, once its labels read."""
    selector_labels(text)
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of `continuum operator`."""
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    add_flags(p, _flags(), OperatorSettings())
    operator_sections.add_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true")


def _flags() -> tuple[SettingFlag, ...]:
    """The flags that set OperatorSettings, in the order `--help` shows them."""
    return (*_POD_FLAGS, *_freshness_flags(), *_PLACEMENT_FLAGS, *_DAMPING_FLAGS, *_LOOP_FLAGS)


#: How engine and lane pods are made: image, CPUs, GPUs, restarts, model paths.
_POD_FLAGS = (
    SettingFlag("--engine-image", "pods.image", "image of `continuum engine`"),
    SettingFlag(
        # --engine-cpu, its first name, kept: it never sized an engine's pod
        ("--lane-cpu", "--engine-cpu"),
        "pods.cpu",
        "CPU of an EmbedLane's pod (request = limit; its llama.cpp threads follow it)",
        type=_cpu_quantity,
    ),
    SettingFlag(
        "--gpu-claims",
        "pods.gpu_claims",
        "how an engine pod asks for its planned GPUs: nvidia.com/gpu (device-plugin) or "
        "a DRA ResourceClaim for the planned devices by UUID (dra)",
        choices=GpuClaims,
    ),
    SettingFlag(
        "--dra-device-class", "pods.dra_device_class", "the DeviceClass of --gpu-claims dra"
    ),
    SettingFlag(
        "--runtime-class",
        "pods.runtime_class",
        "the RuntimeClass of engine and lane pods (default: none, the node's default runtime)",
        type=_runtime_class,
    ),
    SettingFlag(
        "--dra-driver",
        "pods.dra_driver",
        "the DRA driver whose device attribute uuid the claim selects by",
    ),
    SettingFlag(
        "--engine-cpu-min",
        "pods.cpu_min",
        "CPUs of an engine with every layer on the device (request=limit)",
        type=_whole_cpus,
    ),
    SettingFlag(
        "--engine-cpu-share",
        "pods.cpu_share",
        "most of a node's allocatable CPUs an engine with every layer on the host gets",
        type=_share,
    ),
    SettingFlag("--engine-cpu-max", "pods.cpu_max", "most CPUs of any engine", type=_whole_cpus),
    SettingFlag(
        "--engine-max-restarts",
        "pods.max_restarts",
        "restarts of llama-server in an engine pod allowed in --engine-restart-window",
        type=_whole_cpus,
    ),
    SettingFlag(
        "--engine-restart-window",
        "pods.restart_window_seconds",
        "seconds over which --engine-max-restarts are counted",
        type=float,
    ),
    SettingFlag(
        "--gpu-sharing",
        "pods.gpu_sharing",
        "per-process GPU memory caps to apply besides the engine's arguments",
        choices=GpuSharing,
    ),
    SettingFlag(
        "--allowed-host-path-prefix",
        "pods.allowed_host_path_prefixes",
        "a host directory whose files hostPath model sources may name; repeatable "
        "(default: none, every hostPath source is refused)",
        type=_host_directory,
        action="append",
        metavar="DIR",
        dest="allowed_host_path_prefixes",
    ),
)


def _freshness_flags() -> tuple[SettingFlag, ...]:
    """When a node's board counts as fresh, and where its Lease is (a function: the default of
    --agent-lease-namespace is read from the environment when the parser is made)."""
    return (
        SettingFlag(
            "--board-ttl",
            "freshness.default_ttl_seconds",
            "seconds a node Lease without leaseDurationSeconds stays fresh",
            type=float,
        ),
        SettingFlag(
            "--board-max-ttl",
            "freshness.max_ttl_seconds",
            "the most seconds a node Lease stays fresh, whatever its leaseDurationSeconds",
            type=float,
        ),
        SettingFlag(
            "--agent-lease-namespace",
            "freshness.lease_namespace",
            "namespace of the node agents' Leases, their --lease-namespace "
            f"(default: $POD_NAMESPACE, else {LEASE_NAMESPACE})",
            default=os.environ.get("POD_NAMESPACE") or LEASE_NAMESPACE,
        ),
    )


#: How long a placement waits for its pod, and what a failed one costs.
_PLACEMENT_FLAGS = (
    SettingFlag(
        "--pod-start-timeout",
        "placement.pod_start_timeout_seconds",
        "seconds before an assumed lease whose pod is not ready is released",
        type=float,
    ),
    SettingFlag(
        "--backoff",
        "placement.backoff_seconds",
        "seconds a node where a pod never started is skipped for that engine",
        type=float,
    ),
)


#: When a better plan is worth relaunching an engine for.
_DAMPING_FLAGS = (
    SettingFlag(
        "--damping-readings",
        "damping.readings_required",
        "consecutive board readings a new plan must hold before a relaunch",
        type=int,
    ),
    SettingFlag(
        "--damping-min-gain",
        "damping.min_gain",
        "least relative gain (tokens or layers) worth a relaunch",
        type=float,
    ),
    SettingFlag(
        "--relaunch-cooldown",
        "damping.cooldown_seconds",
        "seconds after a relaunch before the next",
        type=float,
    ),
)


#: How often the loop passes, over which Engines, and its metrics.
_LOOP_FLAGS = (
    SettingFlag(
        "--resync",
        "loop.resync_seconds",
        "seconds between passes when nothing changes",
        type=float,
    ),
    SettingFlag(
        "--full-resync",
        "loop.full_resync_seconds",
        "seconds between passes that decide everything, changed or not (each "
        "Engine's placement and grant ledger, each EmbedLane, each node's placed pods)",
        type=float,
    ),
    SettingFlag(
        "--engine-selector",
        None,  # selector_labels reads it: the API server selects the watch of Engines by it
        "serve only the Engines with these labels, and the EmbedLanes with them or beside "
        "those Engines (default: every Engine and EmbedLane)",
        default="",
        type=_selector,
        metavar="KEY=VALUE[,KEY=VALUE]",
    ),
    SettingFlag(
        "--metrics-port",
        None,  # serve starts the metrics' server
        "serve Prometheus metrics on this port (0: not served)",
        type=int,
        default=0,
    ),
)


def settings_from(args: argparse.Namespace) -> OperatorSettings:
    """Every setting of the operator, in one object, from its flags (`cmd_operator` asked
    `operator_sections.refusal` first)."""
    settings = settings_from_flags(OperatorSettings(), _flags(), args)
    # The children's priority class is a flag of the webhook's (`operator_sections`).
    pods = replace(settings.pods, children_priority_class=args.children_priority_class)
    # The Lease's name takes the selector's digest.
    leader = operator_sections.leader_settings(args, selector_labels(args.engine_selector))
    return replace(
        settings,
        pods=pods,
        children=operator_sections.children_settings(args),
        grants=operator_sections.grant_settings(args),
        leader=leader,
    )
