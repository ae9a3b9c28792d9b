"""`continuum operator`: kopf's watches and the decision loop, together, until stopped.

Runs standalone (no kopf peering: docs/design.md chooses a coordination Lease for leadership, which
`kube.leader` holds), cluster-wide. Every setting of `kube.settings` that an operator of a cluster
would tune has a flag; tests use short timings. kopf and the Kubernetes client are imported
only when the operator starts, so the other subcommands stay quick.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from continuum_operator.core.damping import DampingSettings
from continuum_operator.core.heartbeat import LEASE_NAMESPACE
from continuum_operator.kube import grant_settings, lane_objects, webhook
from continuum_operator.kube.settings import (
    FreshnessSettings,
    GpuClaims,
    GpuSharing,
    LoopSettings,
    OperatorSettings,
    PlacementSettings,
    PodSettings,
)

if TYPE_CHECKING:
    from continuum_operator.kube.api import KubeApi
    from continuum_operator.kube.async_api import AsyncKubeApi
    from continuum_operator.kube.metrics import OperatorMetrics

__all__ = ["add_parser", "serve"]


def add_parser(sub: Any) -> None:
    d = OperatorSettings()
    p = sub.add_parser(
        "operator",
        help="run the operator against a cluster",
        description="Place, plan and run Engines from NodeBoards (docs/design.md) until stopped.",
    )
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    _add_pod_arguments(p, d)
    _add_freshness_arguments(p, d)
    _add_placement_arguments(p, d)
    _add_damping_arguments(p, d)
    _add_loop_arguments(p, d)
    webhook.add_arguments(p)
    grant_settings.add_arguments(p)
    p.add_argument("-v", "--verbose", action="store_true")
    p.set_defaults(func=cmd_operator)  # fmt: skip


def _add_pod_arguments(p: argparse.ArgumentParser, d: OperatorSettings) -> None:
    """How engine and lane pods are made: image, CPUs, GPUs, restarts, model paths."""
    p.add_argument("--engine-image", default=d.pods.image, help="image of `continuum engine`")
    p.add_argument(
        "--lane-cpu",
        "--engine-cpu",  # its first name, kept: it never sized an engine's pod
        dest="lane_cpu",
        type=_cpu_quantity,
        default=d.pods.cpu,
        help="CPU of an EmbedLane's pod (request = limit; its llama.cpp threads follow it)",
    )
    p.add_argument(
        "--gpu-claims",
        choices=[str(c) for c in GpuClaims],
        default=str(d.pods.gpu_claims),
        help="how an engine pod asks for its planned GPUs: nvidia.com/gpu (device-plugin) or "
        "a DRA ResourceClaim for the planned devices by index (dra)",
    )
    p.add_argument(
        "--dra-device-class",
        default=d.pods.dra_device_class,
        help="the DeviceClass of --gpu-claims dra",
    )
    p.add_argument(
        "--dra-driver",
        default=d.pods.dra_driver,
        help="the DRA driver whose device attribute index the claim selects by",
    )
    p.add_argument(
        "--engine-cpu-min",
        type=_whole_cpus,
        default=d.pods.cpu_min,
        help="CPUs of an engine with every layer on the device (request=limit)",
    )
    p.add_argument(
        "--engine-cpu-share",
        type=_share,
        default=d.pods.cpu_share,
        help="most of a node's allocatable CPUs an engine with every layer on the host gets",
    )
    p.add_argument(
        "--engine-cpu-max", type=_whole_cpus, default=d.pods.cpu_max, help="most CPUs of any engine"
    )
    p.add_argument(
        "--engine-max-restarts",
        type=_whole_cpus,
        default=d.pods.max_restarts,
        help="restarts of llama-server in an engine pod allowed in --engine-restart-window",
    )
    p.add_argument(
        "--engine-restart-window",
        type=float,
        default=d.pods.restart_window_seconds,
        help="seconds over which --engine-max-restarts are counted",
    )
    p.add_argument(
        "--gpu-sharing",
        choices=[str(g) for g in GpuSharing],
        default=str(d.pods.gpu_sharing),
        help="per-process GPU memory caps to apply besides the engine's arguments",
    )
    p.add_argument(
        "--allowed-host-path-prefix",
        dest="allowed_host_path_prefixes",
        action="append",
        type=_host_directory,
        default=[],
        metavar="DIR",
        help="a host directory whose files hostPath model sources may name; repeatable "
        "(default: none, every hostPath source is refused)",
    )


def _add_freshness_arguments(p: argparse.ArgumentParser, d: OperatorSettings) -> None:
    """When a node's board counts as fresh, and where its Lease is."""
    p.add_argument(
        "--board-ttl",
        type=float,
        default=d.freshness.default_ttl_seconds,
        help="seconds a node Lease without leaseDurationSeconds stays fresh",
    )
    p.add_argument(
        "--agent-lease-namespace",
        default=os.environ.get("POD_NAMESPACE") or LEASE_NAMESPACE,
        help="namespace of the node agents' Leases, their --lease-namespace "
        f"(default: $POD_NAMESPACE, else {LEASE_NAMESPACE})",
    )


def _add_placement_arguments(p: argparse.ArgumentParser, d: OperatorSettings) -> None:
    """How long a placement waits for its pod, and what a failed one costs."""
    p.add_argument(
        "--pod-start-timeout",
        type=float,
        default=d.placement.pod_start_timeout_seconds,
        help="seconds before an assumed lease whose pod is not ready is released",
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=d.placement.backoff_seconds,
        help="seconds a node where a pod never started is skipped for that engine",
    )


def _add_damping_arguments(p: argparse.ArgumentParser, d: OperatorSettings) -> None:
    """When a better plan is worth relaunching an engine for."""
    p.add_argument(
        "--damping-readings",
        type=int,
        default=d.damping.readings_required,
        help="consecutive board readings a new plan must hold before a relaunch",
    )
    p.add_argument(
        "--damping-min-gain",
        type=float,
        default=d.damping.min_gain,
        help="least relative gain (tokens or layers) worth a relaunch",
    )
    p.add_argument(
        "--relaunch-cooldown",
        type=float,
        default=d.damping.cooldown_seconds,
        help="seconds after a relaunch before the next",
    )


def _add_loop_arguments(p: argparse.ArgumentParser, d: OperatorSettings) -> None:
    """How often the loop passes, over which Engines, and its metrics."""
    p.add_argument(
        "--resync",
        type=float,
        default=d.loop.resync_seconds,
        help="seconds between passes when nothing changes",
    )
    p.add_argument(
        "--full-resync",
        type=float,
        default=d.loop.full_resync_seconds,
        help="seconds between passes that decide every engine, changed or not (each "
        "Engine's placement, and each Engine's grant ledger)",
    )
    p.add_argument(
        "--engine-selector",
        default="",
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="serve only the Engines with these labels (default: every Engine)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics on this port (0: not served)",
    )


def _whole_cpus(text: str) -> int:
    """A count of 1 or more (whole CPUs keep an engine pod in the Guaranteed class)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not 1 or more")
    return value


def _cpu_quantity(text: str) -> str:
    """A Kubernetes CPU quantity above 0: whole or decimal CPUs (`2`, `1.5`) or millicores
    (`500m`), as a pod's resources take it."""
    value = lane_objects.cpu_cores(text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a CPU quantity above 0 (write 2, 1.5 or 500m)"
        )
    return text


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


def settings_from(args: argparse.Namespace) -> OperatorSettings:
    return OperatorSettings(
        freshness=FreshnessSettings(
            lease_namespace=args.agent_lease_namespace, default_ttl_seconds=args.board_ttl
        ),
        placement=PlacementSettings(
            pod_start_timeout_seconds=args.pod_start_timeout, backoff_seconds=args.backoff
        ),
        pods=PodSettings(
            image=args.engine_image,
            cpu=args.lane_cpu,
            gpu_claims=GpuClaims(args.gpu_claims),
            dra_device_class=args.dra_device_class,
            dra_driver=args.dra_driver,
            cpu_min=args.engine_cpu_min,
            cpu_share=args.engine_cpu_share,
            cpu_max=args.engine_cpu_max,
            max_restarts=args.engine_max_restarts,
            restart_window_seconds=args.engine_restart_window,
            gpu_sharing=GpuSharing(args.gpu_sharing),
            allowed_host_path_prefixes=tuple(args.allowed_host_path_prefixes),
            children_priority_class=args.children_priority_class,
        ),
        damping=DampingSettings(
            readings_required=args.damping_readings,
            min_gain=args.damping_min_gain,
            cooldown_seconds=args.relaunch_cooldown,
        ),
        loop=LoopSettings(resync_seconds=args.resync, full_resync_seconds=args.full_resync),
        children=webhook.settings_from(args),
    )


def parse_selector(text: str) -> dict[str, str]:
    """`a=b,c=d` into labels; an equality selector is all kopf's label filters take."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise SystemExit(f"error: --engine-selector: {part!r} is not KEY=VALUE")
        labels[key] = value
    return labels


async def serve(
    settings: OperatorSettings,
    kubeconfig: str | None,
    metrics_port: int = 0,
    engine_labels: dict[str, str] | None = None,
    grants: grant_settings.GrantSettings | None = None,
    leadership: grant_settings.LeaderSettings | None = None,
) -> int:
    # Imported here: `continuum plan` and friends need not load kopf and the Kubernetes client.
    from continuum_operator.kube.api import KubeApi
    from continuum_operator.kube.async_api import AsyncKubeApi
    from continuum_operator.kube.metrics import OperatorMetrics

    metrics = OperatorMetrics()
    if metrics_port:
        metrics.serve(metrics_port)
    # The loops' calls are awaited on the event loop (`kube.async_api`); the leader Lease's
    # go out blocking, from a thread of its own (`kube.leader.lead`), so that no stretch of
    # work on the loop can delay a renewal.
    api = await AsyncKubeApi.connect(kubeconfig, on_request=metrics.record_api_request)
    lease_api = KubeApi(kubeconfig, on_request=metrics.record_api_request)
    try:
        return await _operate(
            settings, api, lease_api, metrics, engine_labels,
            grants or grant_settings.GrantSettings(), leadership,
        )  # fmt: skip
    finally:
        await api.close()


async def _operate(
    settings: OperatorSettings,
    api: AsyncKubeApi,
    lease_api: KubeApi,
    metrics: OperatorMetrics,
    engine_labels: dict[str, str] | None,
    grants: grant_settings.GrantSettings,
    leadership: grant_settings.LeaderSettings | None,
) -> int:
    import kopf

    from continuum_operator.kube.cache import Cache
    from continuum_operator.kube.embedlanes import LaneLoop
    from continuum_operator.kube.handlers import registry_for
    from continuum_operator.kube.leader import Elector, lead
    from continuum_operator.kube.loop import Loop
    from continuum_operator.kube.mind_cache import MindCache
    from continuum_operator.kube.mind_cache import register as register_minds
    from continuum_operator.kube.minds import GrantsLoop
    from continuum_operator.kube.placed_pods import PlacedPods

    cache = Cache(lease_namespace=settings.freshness.lease_namespace)
    loop = Loop(api, settings, cache, metrics=metrics)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    registry = registry_for(cache, engine_labels)
    # Minds through their engine's ledger; only the leader decides and writes.
    mind_cache = MindCache()
    # A pod her service account creates is her child (`children.mind_of_creator`).
    webhook.register(
        registry, api, settings.pods, settings.children, metrics,
        is_mind=lambda key: key in mind_cache.minds,
    )  # fmt: skip
    register_minds(registry, mind_cache)
    elector = Elector(
        lease_api, leadership or grant_settings.LeaderSettings(), on_change=metrics.set_leader
    )
    grants_loop = GrantsLoop(
        api,
        grants,
        cache,
        mind_cache,
        may_write=elector.is_leader,
        metrics=metrics,
        resync_seconds=settings.loop.resync_seconds,
        full_pass_seconds=settings.loop.full_resync_seconds,
        pod_port=settings.pods.port,
    )
    # Each node's engine and lane pods, told to its agent (which may not list pods itself).
    placed = PlacedPods(api, cache, settings.loop.resync_seconds)
    # EmbedLanes, on the controller kernel (as the Engines' and the grants' loops are).
    lanes = LaneLoop(api, settings, cache, time.time)
    decisions = asyncio.create_task(
        lead(elector, stop, [loop.run, grants_loop.run, placed.run, lanes.run])
    )
    decisions.add_done_callback(lambda _: stop.set())  # a lost Lease stops this replica
    try:
        await kopf.operator(
            registry=registry,
            standalone=True,
            clusterwide=True,
            stop_flag=stop,
        )
    finally:
        stop.set()
        code = await decisions
    return code


def cmd_operator(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # kopf logs every watch event it hands over; the loop logs what it decides.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's login reads it too
    labels = parse_selector(args.engine_selector)
    grants = grant_settings.grant_settings(args)
    leadership = grant_settings.leader_settings(args, labels)
    return asyncio.run(
        serve(settings_from(args), args.kubeconfig, args.metrics_port, labels, grants, leadership)
    )
