"""The operator's settings: one object of documented topic sections (STYLE.md habit 6).

Every field says its unit, its default and why. `continuum operator` fills them from flags
(`cli.operator`, `cli.operator_sections`); tests build them directly with short timings. The
grants' and the leader election's sections live in `kube.base.grant_settings`; every reconciler's
kernel settings are read from this one object (`OperatorSettings.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from continuum_operator.core.damping import DampingSettings
from continuum_operator.core.heartbeat import LEASE_NAMESPACE
from continuum_operator.kube.base.grant_settings import GrantSettings, LeaderSettings
from continuum_operator.kube.base.kernel import KernelSettings


class GpuSharing(StrEnum):
    """How the plan's device bytes are enforced beyond the engine's own arguments."""

    NONE = "none"
    HAMI = "hami"
    """HAMi's device plugin: the pod asks for `nvidia.com/gpumem` (MiB per GPU)."""
    MPS = "mps"
    """NVIDIA MPS: `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` per device in the engine's environment."""
    AUTO = "auto"
    """What the node's board offers (`capMechanisms`, seen by its agent): HAMi first, then MPS."""


def resolve_sharing(configured: GpuSharing, offered: tuple[str, ...]) -> GpuSharing:
    """The caps to apply on one node: the configured ones, or with `auto` the node's own."""
    if configured is not GpuSharing.AUTO:
        return configured
    for choice in (GpuSharing.HAMI, GpuSharing.MPS):
        if str(choice) in offered:
            return choice
    return GpuSharing.NONE


class GpuClaims(StrEnum):
    """How an engine pod asks for the GPUs its plan charged."""

    DEVICE_PLUGIN = "device-plugin"
    """`nvidia.com/gpu: N`: the device plugin picks which N (maybe not the ones charged)."""
    DRA = "dra"
    """A ResourceClaim (from a ResourceClaimTemplate) for the planned GPUs by their `index`
    attribute: the scheduler allocates those devices or none (resource.k8s.io/v1)."""


@dataclass(frozen=True, slots=True)
class FreshnessSettings:
    lease_namespace: str = LEASE_NAMESPACE
    """Namespace of the agents' Leases whose renewal makes a board fresh (`core.heartbeat`)."""
    default_ttl_seconds: float = 40.0
    """TTL of a Lease that states no `leaseDurationSeconds` (seconds; the kubelet's default)."""
    max_ttl_seconds: float = 300.0
    """The longest a Lease vouches for its board, whatever its `leaseDurationSeconds` says
    (seconds): the agent writes its Lease, and a duration of years kept a dead node's board
    fresh, taking placements, for years."""


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    pod_start_timeout_seconds: float = 300.0
    """An assumed lease whose pod is not ready by then is released and re-planned (seconds)."""
    backoff_seconds: float = 600.0
    """A node where an engine pod never started is skipped this long for that engine (seconds)."""


@dataclass(frozen=True, slots=True)
class PodSettings:
    image: str = "ghcr.io/continuum-dev/continuum-engine:0.1.0"
    """The image with `continuum` and `llama-server` (the engine's gateway and server)."""
    image_pull_policy: str = "IfNotPresent"
    cpu: str = "2"
    """CPU requested and limited by an EmbedLane's pod (equal: Guaranteed QoS). An engine's
    CPUs follow its plan instead: `cpu_min`, `cpu_share`, `cpu_max`."""
    cpu_min: int = 2
    """CPUs of an engine with every layer on the device: the gateway, llama-server's HTTP and
    the thread driving the GPU (whole CPUs; request = limit, Guaranteed QoS)."""
    cpu_share: float = 0.5
    """The most of a node's allocatable CPUs one engine with every layer on the host gets
    (fraction): the rest is for the minds it serves and their children on the same node."""
    cpu_max: int | None = None
    """The most CPUs an engine gets, whatever the node has (whole CPUs; None: no bound)."""
    node_cpus: int | None = None
    """The allocatable CPUs of the node the engine runs on: filled per node by the operator
    (`kube.engines.engine_pass.pods_on`), never set by hand; None: unknown, the engine gets
    `cpu_min`."""
    max_restarts: int = 5
    """Restarts of llama-server inside an engine pod allowed in `restart_window_seconds`; the
    next exit stops it, Ready False with why (count; `continuum engine --max-restarts`)."""
    restart_window_seconds: float = 600.0
    """The window those restarts are counted in, and how long a restart keeps the engine
    Degraded (seconds)."""
    memory_overhead_bytes: int = 512 * 2**20
    """Added to the plan's host bytes for the gateway and llama-server's own heap (bytes)."""
    port: int = 8080
    """The gateway's port, served by the engine's Service."""
    engine_priority_class: str = "continuum-engine"
    engine_priority: int = 1_000_000
    """Engines outrank the minds they serve and every ordinary pod (scheduling, eviction)."""
    mind_priority_class: str = "continuum-mind"
    mind_priority: int = 1_000
    children_priority_class: str = "continuum-mind-children"
    children_priority: int = -1_000
    """A mind's child pods (builds, test runs): below every ordinary pod (0), never preempting
    (docs/children.md). Set on them by the children's webhook (`kube.children.webhook`)."""
    gpu_sharing: GpuSharing = GpuSharing.NONE
    gpu_claims: GpuClaims = GpuClaims.DEVICE_PLUGIN
    dra_device_class: str = "gpu.nvidia.com"
    """The DeviceClass an engine's claim names (NVIDIA's DRA driver installs this one)."""
    dra_driver: str = "gpu.nvidia.com"
    """The DRA driver whose device attributes (`uuid`) the claim's selector reads."""
    runtime_class: str = ""
    """The RuntimeClass of every engine and lane pod (`--runtime-class`; "": the node's default
    runtime). NVIDIA's where it is not containerd's default: the device plugin's `envvar`
    strategy only names the GPUs in NVIDIA_VISIBLE_DEVICES, which runc ignores."""
    node_gpu_uuids: tuple[tuple[int, str], ...] = ()
    """(index, UUID) of each GPU of the node the engine runs on, as its board reports them:
    filled per node by the operator (`kube.engines.engine_pass.pods_on`), never set by hand."""
    allowed_host_path_prefixes: tuple[str, ...] = ()
    """Directories under which a hostPath model source (an Engine's or an EmbedLane's) may
    name a file (`--allowed-host-path-prefix`, repeatable; the chart's
    `engineSources.allowedHostPathPrefixes`). None by default: a hostPath gives whoever may
    create an Engine a file of the node, so only the cluster admin says where models lie
    (docs/security.md)."""


@dataclass(frozen=True, slots=True)
class ChildrenSettings:
    """The mutating webhook for a mind's child pods (docs/children.md, `kube.children.webhook`)."""

    webhook: bool = False
    """Serve the webhook and install its MutatingWebhookConfiguration (`--webhook`). Off by
    default: the API server must reach the operator at `webhook_host`."""
    webhook_name: str = "continuum-mind-children"
    """Name of the cluster's MutatingWebhookConfiguration the operator installs."""
    listen: str = "0.0.0.0"
    """Address the webhook server listens on."""
    port: int = 9443
    """Port the webhook server listens on (HTTPS)."""
    host: str = "127.0.0.1"
    """Host name or IP the API server calls the webhook at; in the self-signed certificate's
    names. For an in-cluster operator, its Service's DNS name."""
    certfile: str | None = None
    keyfile: str | None = None
    """A serving certificate and key (cert-manager's Secret, mounted); None: self-signed,
    made at startup."""
    cafile: str | None = None
    """CA bundle the API server verifies the webhook with (cert-manager's `ca.crt`); None: the
    certificate itself."""
    service: tuple[str, str] | None = None
    """(namespace, name) of the Service in front of the webhook: the configuration then names
    it (`clientConfig.service`) instead of a URL, so the API server needs no cluster DNS to reach
    it (managed API servers run outside the cluster's DNS). None: the URL form, at `host`."""
    service_port: int | None = None
    """The Service's port for the webhook; None: `port`."""
    timeout_seconds: int = 5
    """How long the API server waits for the webhook before it admits the pod unmutated
    (failure policy Ignore). Short: a child is never held up long for a slow operator."""
    cpu_request: str = "1m"
    """CPU a child requests: the least, so its cgroup CPU weight is the least (cpu.weight 1). No
    CPU limit is set: children still use every idle core."""


@dataclass(frozen=True, slots=True)
class LoopSettings:
    resync_seconds: float = 5.0
    """A pass runs at least this often, besides on each watch event (seconds)."""
    debounce_seconds: float = 0.2
    """Watch events within this window are handled in one pass (seconds)."""
    full_resync_seconds: float = 60.0
    """Every engine is decided at least this often, changed or not (seconds); in between a
    pass decides only the engines whose inputs changed and those not quiet (`kube.engines.loop`).
    Every lane, mind and node's placed pods likewise: each reconciler's full resync."""
    engine_writers: int = 8
    """Engines whose writes are in flight at once, within a pass (the Engines' `writers`; the
    grants' is `GrantSettings.write_workers`)."""
    grants_debounce_seconds: float = 0.05
    """The grants' debounce (seconds): shorter than the others', a Mind waits for her grant."""
    grants_retry_seconds: float = 0.5
    """An engine whose grants' write failed is stepped again after this, doubled per failure in
    a row up to `grants_max_retry_seconds` (seconds)."""
    grants_max_retry_seconds: float = 30.0


@dataclass(frozen=True, slots=True)
class Kernels:
    """Each reconciler's kernel settings (`kube.base.kernel`), all read from one
    `OperatorSettings` (`OperatorSettings.kernels`): no reconciler holds timings of its own."""

    engines: KernelSettings
    lanes: KernelSettings
    grants: KernelSettings
    placed: KernelSettings


@dataclass(frozen=True, slots=True)
class OperatorSettings:
    freshness: FreshnessSettings = field(default_factory=FreshnessSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    pods: PodSettings = field(default_factory=PodSettings)
    damping: DampingSettings = field(default_factory=DampingSettings)
    loop: LoopSettings = field(default_factory=LoopSettings)
    children: ChildrenSettings = field(default_factory=ChildrenSettings)
    grants: GrantSettings = field(default_factory=GrantSettings)
    leader: LeaderSettings = field(default_factory=LeaderSettings)

    @property
    def kernels(self) -> Kernels:
        loop = self.loop
        # The Engines' and the grants' decisions change by the clock (deadlines, boards going
        # stale, reviews): a pass at least every `resync_seconds`.
        return Kernels(
            engines=KernelSettings(
                resync_seconds=loop.full_resync_seconds,
                debounce_seconds=loop.debounce_seconds,
                pass_seconds=loop.resync_seconds,
                writers=loop.engine_writers,
            ),
            lanes=KernelSettings(
                resync_seconds=loop.full_resync_seconds, debounce_seconds=loop.debounce_seconds
            ),
            grants=KernelSettings(
                resync_seconds=loop.full_resync_seconds,
                debounce_seconds=loop.grants_debounce_seconds,
                retry_seconds=loop.grants_retry_seconds,
                max_retry_seconds=loop.grants_max_retry_seconds,
                pass_seconds=loop.resync_seconds,
                writers=self.grants.write_workers,
            ),
            placed=KernelSettings(
                resync_seconds=loop.full_resync_seconds, debounce_seconds=loop.debounce_seconds
            ),
        )
