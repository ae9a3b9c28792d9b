"""NodeBoard: one node's memory mode and pools, as its agent measures them.

The board's status is written only by the node agent, its spec (the pods the operator placed
there) only by the operator; its freshness is the node's coordination Lease,
not the board itself (a quiet board is not a stale one). The shape encodes docs/design.md rule 1: a
unified board has exactly one `unified` pool, a discrete board one `host` pool and one `device`
pool per GPU, and an unknown board governs only its `host` pool. `consumers` tells the memory
of the engines and lanes the operator placed apart from the rest of each pool's usage (the
external part), `consumerGpus` which GPUs their processes run on (NVML's per-device process lists:
the GPU a device plugin handed a pod, which the operator charges it to), and `capMechanisms` says
which per-process caps the node offers; the operator decides which to apply (it writes the
Engine's `status.enforcement`, the agent does not).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from continuum_operator.model.base import Bytes, Conditions, Resource, Spec


class MemoryMode(StrEnum):
    """`unified` (device and host memory are one pool), `discrete` (each GPU has its own) or
    `unknown` (no backend reported: device memory is ungoverned)."""

    UNIFIED = "unified"
    DISCRETE = "discrete"
    UNKNOWN = "unknown"


class PoolKind(StrEnum):
    """`unified` (the one pool of a unified board), `device` (one GPU's memory), `host`, or
    `disk` (the node's disk where engines' park stores live; not memory, beside any mode's)."""

    UNIFIED = "unified"
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class PoolReading(Spec):
    """One pool as measured: capacity is a fixed fact, pressure shows up only as usage."""

    # Fields are checked in declaration order; each check names its own field, so an error
    # points at `status.pools[1].device` rather than at the pool as a whole.
    kind: PoolKind
    device: int | None = Field(
        default=None,
        ge=0,
        le=1023,
        validate_default=True,
        description="GPU index (device pools only).",
    )
    capacity_bytes: Bytes = Field(description="Capacity net of the OS's own reserve.")
    used_bytes: Bytes | None = Field(
        default=None,
        description="Measured usage; absent when the agent has not sampled yet "
        "(unknown, never full).",
    )
    coherent: bool | None = Field(
        default=None,
        description="Device pools only: the GPU can address system memory (HMM/ATS). "
        "Still its own pool.",
    )

    @field_validator("device")
    @classmethod
    def _device_only_on_device_pools(cls, value: int | None, info: ValidationInfo) -> int | None:
        kind = info.data.get("kind")
        if kind is PoolKind.DEVICE and value is None:
            raise ValueError("a device pool needs `device`, the GPU index it belongs to")
        if kind is not None and kind is not PoolKind.DEVICE and value is not None:
            raise ValueError(f"`device` belongs to device pools only, not a {kind} pool")
        return value

    @field_validator("used_bytes")
    @classmethod
    def _used_within_capacity(cls, value: int | None, info: ValidationInfo) -> int | None:
        capacity = info.data.get("capacity_bytes")
        if value is not None and capacity is not None and value > capacity:
            raise ValueError(
                f"usedBytes {value} exceeds capacityBytes {capacity}; "
                "capacity is the fixed size of the pool, report pressure as usage within it"
            )
        return value

    @field_validator("coherent")
    @classmethod
    def _coherent_only_on_device_pools(
        cls, value: bool | None, info: ValidationInfo
    ) -> bool | None:
        kind = info.data.get("kind")
        if kind is not None and kind is not PoolKind.DEVICE and value is not None:
            raise ValueError(f"`coherent` belongs to device pools only, not a {kind} pool")
        return value


class CapMechanism(StrEnum):
    """A per-process GPU memory cap the node can enforce on a pod (docs/design.md rule 2)."""

    HAMI = "hami"  # HAMi's device plugin and libvgpu: `nvidia.com/gpumem` on the pod
    MPS = "mps"  # an NVIDIA MPS control daemon: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT


class CapMechanismReading(Spec):
    """A per-process cap mechanism the agent found on the node, and its evidence."""

    mechanism: CapMechanism
    evidence: str = Field(default="", description="What the agent saw that shows it.")


class ConsumerUsage(Spec):
    """Measured memory of one engine or lane the operator placed, in one pool."""

    kind: Literal["Engine", "EmbedLane"] = Field(description="Engine or EmbedLane.")
    namespace: str = Field(description="Its namespace.")
    name: str = Field(description="Its name.")
    pool: PoolKind
    device: int | None = Field(default=None, ge=0, le=1023, description="Device pools only.")
    used_bytes: Bytes = Field(description="Its measured usage in the pool: part of usedBytes.")


class ConsumerGpus(Spec):
    """The GPUs one placed engine's or lane's processes were found on (NVML per process, matched
    by pod or process), whether or not NVML could say how much memory they hold there."""

    kind: Literal["Engine", "EmbedLane"] = Field(description="Engine or EmbedLane.")
    namespace: str = Field(description="Its namespace.")
    name: str = Field(description="Its name.")
    gpus: list[Annotated[int, Field(ge=0, le=1023)]] = Field(
        min_length=1,
        max_length=1024,
        description="Indices of the GPUs its processes use (ascending), as device pools name "
        "them: the GPU its pod was given, which may not be the one its plan charged.",
    )

    @field_validator("gpus")
    @classmethod
    def _ascending_once_each(cls, value: list[int]) -> list[int]:
        if value != sorted(set(value)):
            raise ValueError(f"gpus lists each index once, ascending; got {value}")
        return value


class GpuInfo(Spec):
    """A GPU the agent saw."""

    index: int = Field(ge=0, le=1023, description="Its index, as device pools name it.")
    name: str = Field(default="", description="Its product name, as the driver reports it.")
    uuid: str = Field(default="", description="Its UUID, where the driver reports one.")


class PlacedPod(Spec):
    """A pod of an engine or lane the operator placed on this node: the agent matches a
    process's cgroup to `uid` and charges its usage to the Engine or EmbedLane named."""

    uid: str = Field(min_length=1, max_length=64, description="The pod's UID.")
    kind: Literal["Engine", "EmbedLane"] = Field(description="Engine or EmbedLane.")
    namespace: str = Field(max_length=63, description="Its namespace.")
    name: str = Field(max_length=253, description="The Engine's or EmbedLane's name.")


class NodeBoardSpec(Spec):
    """What the operator tells the node's agent: the pods it placed there. The operator is its
    one writer, so the agent needs no right to list pods (docs/security.md, "The node agent")."""

    placed: list[PlacedPod] = Field(
        default_factory=list,
        max_length=1024,
        description="Engine and lane pods on this node (written by the operator), by UID.",
    )


class NodeBoardStatus(Spec):
    """The node's memory as its agent measures it; the agent is its one writer."""

    memory_mode: MemoryMode = MemoryMode.UNKNOWN
    memory_mode_reason: str = Field(
        default="", description="What the agent saw that decided the mode, in words."
    )
    per_process_cap_bytes: Bytes | None = Field(
        default=None,
        description="A cap on one process's GPU memory (Metal working set, HAMi, MPS).",
    )
    pools: list[PoolReading] = Field(
        default_factory=list,
        max_length=1025,
        validate_default=True,
        description="unified: one unified pool; discrete: one host pool and a device pool per "
        "GPU; unknown: the host pool only.",
    )
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=1024, description="GPUs seen.")
    consumers: list[ConsumerUsage] = Field(
        default_factory=list,
        max_length=4096,
        description="Usage of the engines and lanes the operator placed (matched by pod or "
        "process); the rest of each pool's usedBytes is external.",
    )
    consumer_gpus: list[ConsumerGpus] = Field(
        default_factory=list,
        max_length=4096,
        description="Which GPUs the processes of the engines and lanes the operator placed run "
        "on (NVML per process); empty where the agent attributes none (it needs hostPID).",
    )
    cap_mechanisms: list[CapMechanismReading] = Field(
        default_factory=list,
        max_length=8,
        description="Per-process GPU caps the node offers; the operator decides which apply.",
    )
    conditions: Conditions = Field(
        default_factory=list, description="Conditions of the board (the agent writes none yet)."
    )
    # For people only (kubectl cannot print bytes as GiB): written by the board's writer from
    # the fields above with `capacity_text` and `gib_text`; nothing reads them back.
    capacity: str = Field(
        default="",
        max_length=4096,
        description="The pools' capacities in GiB, for `kubectl get nodeboards` "
        "(from pools[].capacityBytes).",
    )
    per_process_cap: str = Field(
        default="",
        max_length=64,
        description="perProcessCapBytes in GiB, for `kubectl get nodeboards -o wide` "
        "('none' when the node has no per-process cap).",
    )

    @field_validator("consumer_gpus")
    @classmethod
    def _consumer_gpus_seen(
        cls, value: list[ConsumerGpus], info: ValidationInfo
    ) -> list[ConsumerGpus]:
        seen = {g.index for g in info.data.get("gpus") or []}
        for c in value:
            unseen = [g for g in c.gpus if g not in seen]
            if unseen:
                raise ValueError(
                    f"consumer {c.kind} {c.namespace}/{c.name} is on GPU {unseen}, which the "
                    "board's gpus do not list"
                )
        return value

    @field_validator("pools")
    @classmethod
    def _pools_match_memory_mode(
        cls, pools: list[PoolReading], info: ValidationInfo
    ) -> list[PoolReading]:
        mode = info.data.get("memory_mode")
        if [p.kind for p in pools].count(PoolKind.DISK) > 1:
            raise ValueError("a board has at most one `disk` pool (the node's disk)")
        kinds: list[PoolKind] = [p.kind for p in pools if p.kind is not PoolKind.DISK]
        if mode is MemoryMode.UNIFIED:
            if kinds != [PoolKind.UNIFIED]:
                raise ValueError(
                    "a unified board has exactly one pool of kind `unified` "
                    "(device and host memory are one pool); got " + _kinds(kinds)
                )
        elif mode is MemoryMode.DISCRETE:
            if (
                kinds.count(PoolKind.HOST) != 1
                or PoolKind.UNIFIED in kinds
                or PoolKind.DEVICE not in kinds
            ):
                raise ValueError(
                    "a discrete board has one `host` pool and one `device` pool per GPU; got "
                    + _kinds(kinds)
                )
            devices = [p.device for p in pools if p.kind is PoolKind.DEVICE]
            if len(set(devices)) != len(devices):
                raise ValueError(f"device pools repeat a GPU index: {devices}")
        elif mode is MemoryMode.UNKNOWN and kinds not in ([], [PoolKind.HOST]):
            raise ValueError(
                "an unknown-mode board governs only a `host` pool "
                "(device memory is unmeasured); got " + _kinds(kinds)
            )
        return pools

    @field_validator("consumers")
    @classmethod
    def _consumers_within_their_pools(
        cls, consumers: list[ConsumerUsage], info: ValidationInfo
    ) -> list[ConsumerUsage]:
        pools = {(p.kind, p.device): p for p in info.data.get("pools") or []}
        charged: dict[tuple[PoolKind, int | None], int] = {}
        for c in consumers:
            key = (c.pool, c.device)
            if key not in pools:
                raise ValueError(
                    f"consumer {c.kind} {c.namespace}/{c.name} is charged to pool "
                    f"{c.pool}{'' if c.device is None else f'/{c.device}'}, which the board lacks"
                )
            charged[key] = charged.get(key, 0) + c.used_bytes
        for key, total in charged.items():
            used = pools[key].used_bytes
            if used is None or total > used:
                raise ValueError(
                    f"consumers hold {total} bytes of pool {key[0]}, more than its "
                    f"usedBytes {used}; attributed usage is a part of measured usage"
                )
        return consumers


def gib_text(n: int | None) -> str:
    """Bytes as people read them in a column: '79.2 GiB'; 'none' for no value."""
    return "none" if n is None else f"{n / 2**30:.1f} GiB"


def capacity_text(pools: list[PoolReading]) -> str:
    """The pools' capacities, one phrase: 'unified 119.2 GiB', 'device0 79.2 GiB, host 503.5
    GiB' (device pools by GPU index)."""
    return (
        ", ".join(
            f"{p.kind}{'' if p.device is None else p.device} {gib_text(p.capacity_bytes)}"
            for p in pools
        )
        or "no pools"
    )


def _kinds(kinds: list[PoolKind]) -> str:
    return "[" + ", ".join(str(k) for k in kinds) + "]" if kinds else "no pools"


class NodeBoard(Resource):
    """One node's memory mode and pools, written by its node agent (cluster-scoped, named after
    the node); fresh while the agent renews the node's Lease (docs/agent.md)."""

    KIND = "NodeBoard"
    PLURAL = "nodeboards"
    SHORT_NAMES = ("board", "boards")
    NAMESPACED = False
    PRINTER_COLUMNS = (
        {"name": "Mode", "type": "string", "jsonPath": ".status.memoryMode"},
        {"name": "Capacity", "type": "string", "jsonPath": ".status.capacity"},
        {"name": "Cap", "type": "string", "jsonPath": ".status.perProcessCap", "priority": 1},
    )

    kind: Literal["NodeBoard"] = "NodeBoard"
    spec: NodeBoardSpec = Field(default_factory=NodeBoardSpec)
    status: NodeBoardStatus = Field(default_factory=NodeBoardStatus)
