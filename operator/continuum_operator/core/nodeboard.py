"""A node's board from its readings: the memory mode decided by docs/design.md's definitions.

Pure: the agent's probes produce `NodeReadings`; this module turns them into the `status` of the
node's NodeBoard, and the agent's writer sends it. The rules it keeps:

- unified when device allocations draw from host memory: Apple silicon (Metal), or every GPU's
  memory reported Not Supported by NVML (GB10). One `unified` pool, sized and used as the host.
- discrete when the GPUs report framebuffers of their own. NVML's HMM/ATS addressing mode sets
  a `coherent` flag on the device pool; it never makes a board unified. A GPU whose memory the OS
  also counts as a CPU-less NUMA node (GH200 in NUMA mode) has that node taken off the host pool,
  so no byte is counted twice.
- unknown, with the reason, when no backend reported, or reported something contradictory (some
  GPUs unified and some discrete). Never a guess (rule 3).

Host memory honours the cgroup limit the agent read: capacity is the smaller of the machine and
the limit, and availability the smaller of what each has left.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from continuum_operator.core.readings import (
    Addressing,
    ConsumerKindName,
    GpuMemoryStatus,
    GpuReading,
    HostReading,
    MetalReading,
    NodeReadings,
    NumaNode,
)
from continuum_operator.model.board import (
    CapMechanismReading,
    ConsumerGpus,
    ConsumerUsage,
    GpuInfo,
    MemoryMode,
    NodeBoardStatus,
    PoolKind,
    PoolReading,
    capacity_text,
    gib_text,
)

__all__ = ["HostPool", "board_status", "host_pool"]

GiB = 2**30


@dataclass(frozen=True, slots=True)
class HostPool:
    """Host capacity and usage after the cgroup limit and GPU NUMA nodes are applied."""

    capacity_bytes: int
    used_bytes: int
    notes: list[str]


def _gpu_numa_nodes(host: HostReading, gpus: Iterable[GpuReading]) -> list[tuple[int, NumaNode]]:
    """(GPU index, NUMA node) for GPUs whose memory the OS counts as a memory-only NUMA node."""
    nodes = {n.id: n for n in host.numa_nodes}
    found = []
    for gpu in gpus:
        node = nodes.get(gpu.numa_node) if gpu.numa_node is not None else None
        # A node with CPUs is the GPU's nearest CPU socket, not its memory.
        if node is not None and node.cpus == 0:
            found.append((gpu.index, node))
    return found


def host_pool(host: HostReading, gpus: Iterable[GpuReading] = ()) -> HostPool:
    notes: list[str] = []
    capacity = host.total_bytes
    available = host.available_bytes
    for index, node in _gpu_numa_nodes(host, gpus):
        capacity -= node.total_bytes
        available -= node.free_bytes
        notes.append(
            f"NUMA node {node.id} ({node.total_bytes / GiB:.1f} GiB) is GPU {index}'s memory: "
            "taken off host capacity, counted once in its device pool"
        )
    capacity = max(0, capacity)
    available = min(capacity, max(0, available))
    if host.cgroup is not None and host.cgroup.limit_bytes < capacity:
        cg = host.cgroup
        capacity = cg.limit_bytes
        available = min(available, max(0, cg.limit_bytes - cg.working_set_bytes))
        notes.append(f"host capacity is the cgroup limit of {cg.path}")
    return HostPool(capacity, capacity - available, notes)


def _coherent(addressing: Addressing) -> bool | None:
    if addressing is Addressing.UNREPORTED:
        return None
    return addressing in (Addressing.HMM, Addressing.ATS)


def _one_pool(host: HostPool, kind: PoolKind) -> PoolReading:
    return PoolReading(kind=kind, capacity_bytes=host.capacity_bytes, used_bytes=host.used_bytes)


def _board(
    readings: NodeReadings,
    mode: MemoryMode,
    reasons: list[str],
    pools: list[PoolReading],
    gpus: list[GpuInfo],
    cap: int | None,
) -> NodeBoardStatus:
    disk = readings.disk
    if disk is not None:  # not memory: a pool beside the mode's, for park stores on disk
        pools = [
            *pools,
            PoolReading(
                kind=PoolKind.DISK, capacity_bytes=disk.capacity_bytes, used_bytes=disk.used_bytes
            ),
        ]
    return NodeBoardStatus(
        memory_mode=mode,
        memory_mode_reason="; ".join(r for r in reasons if r),
        per_process_cap_bytes=cap,
        pools=pools,
        gpus=gpus,
        consumers=_consumers(readings, pools),
        consumer_gpus=_consumer_gpus(readings),
        cap_mechanisms=[
            CapMechanismReading(mechanism=m.mechanism, evidence=m.evidence)
            for m in sorted(readings.mechanisms, key=lambda m: m.mechanism)
        ],
        capacity=capacity_text(pools),
        per_process_cap=gib_text(cap),
    )


def board_status(readings: NodeReadings) -> NodeBoardStatus:
    """The NodeBoard status these readings support; unknown (with the reason) where none does."""
    nvml, metal = readings.nvml, readings.metal

    if metal is not None and metal.available:
        return _metal_board(readings, metal)

    measured = [g for g in nvml.gpus if g.memory is GpuMemoryStatus.MEASURED]
    shared = [g for g in nvml.gpus if g.memory is GpuMemoryStatus.NOT_SUPPORTED]
    failures = [
        f"GPU {g.index} unmeasured ({g.memory_error})"
        for g in nvml.gpus
        if g.memory is GpuMemoryStatus.FAILED
    ]
    gpus = [GpuInfo(index=g.index, name=g.name, uuid=g.uuid) for g in nvml.gpus]

    if nvml.available and shared and not measured:
        return _nvml_unified_board(readings, shared, failures, gpus)
    if nvml.available and measured and not shared:
        return _discrete_board(readings, measured, failures, gpus)
    return _unknown_board(readings, measured, shared, failures, gpus)


def _metal_board(readings: NodeReadings, metal: MetalReading) -> NodeBoardStatus:
    cap = readings.configured_cap_bytes
    host = host_pool(readings.host)
    if metal.wired_limit_bytes is not None:
        cap = metal.wired_limit_bytes if cap is None else min(cap, metal.wired_limit_bytes)
    default_limit = (
        "Metal working-set limit left at its default (iogpu.wired_limit_mb 0)"
        if metal.wired_limit_bytes is None
        else ""
    )
    return _board(
        readings,
        MemoryMode.UNIFIED,
        [
            f"Apple silicon ({metal.chip or 'Metal'}): device and host memory are one pool",
            *host.notes,
            default_limit,
        ],
        [_one_pool(host, PoolKind.UNIFIED)],
        [GpuInfo(index=0, name=metal.chip)],
        cap,
    )


def _nvml_unified_board(
    readings: NodeReadings, shared: list[GpuReading], failures: list[str], gpus: list[GpuInfo]
) -> NodeBoardStatus:
    """Every GPU's memory Not Supported by NVML (GB10): one pool, the host's."""
    host = host_pool(readings.host)
    names = ", ".join(f"GPU {g.index} ({g.name})" for g in shared)
    return _board(
        readings,
        MemoryMode.UNIFIED,
        [
            f"NVML memory info Not Supported on {names}: GPU allocations draw from host memory",
            *host.notes,
            *failures,
        ],
        [_one_pool(host, PoolKind.UNIFIED)],
        gpus,
        readings.configured_cap_bytes,
    )


def _discrete_board(
    readings: NodeReadings, measured: list[GpuReading], failures: list[str], gpus: list[GpuInfo]
) -> NodeBoardStatus:
    host = host_pool(readings.host, measured)
    pools = [_one_pool(host, PoolKind.HOST)]
    for g in measured:
        assert g.capacity_bytes is not None  # MEASURED carries it
        used = None if g.used_bytes is None else min(g.used_bytes, g.capacity_bytes)
        pools.append(
            PoolReading(
                kind=PoolKind.DEVICE,
                device=g.index,
                capacity_bytes=g.capacity_bytes,
                used_bytes=used,
                coherent=_coherent(g.addressing),
            )
        )
    coherent = [g for g in measured if _coherent(g.addressing)]
    coherence = (
        f"GPU {', '.join(str(g.index) for g in coherent)} can address system memory "
        f"({coherent[0].addressing.upper()}): coherent, still its own pool"
        if coherent
        else ""
    )
    return _board(
        readings,
        MemoryMode.DISCRETE,
        [
            "NVML reports a framebuffer of its own on every measured GPU",
            coherence,
            *host.notes,
            *failures,
        ],
        pools,
        gpus,
        readings.configured_cap_bytes,
    )


def _unknown_board(
    readings: NodeReadings,
    measured: list[GpuReading],
    shared: list[GpuReading],
    failures: list[str],
    gpus: list[GpuInfo],
) -> NodeBoardStatus:
    """No backend reported a memory mode, or the GPUs contradict each other: never a guess."""
    nvml, metal = readings.nvml, readings.metal
    if not nvml.available:
        reasons = [f"no NVIDIA: {nvml.reason}"]
        if metal is not None:
            reasons.append(f"no Metal: {metal.reason}")
    elif shared and measured:
        reasons = [
            f"GPUs disagree: {', '.join(str(g.index) for g in shared)} report no memory of "
            f"their own, {', '.join(str(g.index) for g in measured)} report framebuffers"
        ]
    elif not nvml.gpus:
        reasons = ["NVML reported no GPUs"]
    else:
        reasons = ["no GPU's memory could be read"]
    host = host_pool(readings.host)
    return _board(
        readings,
        MemoryMode.UNKNOWN,
        [*reasons, *host.notes, *failures],
        [_one_pool(host, PoolKind.HOST)],
        gpus,
        readings.configured_cap_bytes,
    )


def _consumer_gpus(readings: NodeReadings) -> list[ConsumerGpus]:
    """The GPUs each placed consumer's processes are on, from NVML's per-device process lists.

    Reported whether or not NVML tells the bytes (it does not on every platform): where a
    process runs is what the operator needs to charge the right pool when a device plugin, not
    the plan, chose the GPU (docs/operator.md, "The GPU charged is the GPU in use").
    """
    on: dict[tuple[ConsumerKindName, str, str], set[int]] = {}
    for gpu in readings.nvml.gpus:
        for proc in gpu.processes:
            owner = readings.gpu_owners.get(proc.pid)
            if owner is not None:
                on.setdefault((owner.kind, owner.namespace, owner.name), set()).add(gpu.index)
    return [
        ConsumerGpus(kind=kind, namespace=namespace, name=name, gpus=sorted(gpus))
        for (kind, namespace, name), gpus in sorted(
            on.items(), key=lambda i: (i[0][1], i[0][2], i[0][0])
        )
    ]


def _consumers(readings: NodeReadings, pools: list[PoolReading]) -> list[ConsumerUsage]:
    """Charge each placed consumer's measured memory to the pool it lives in.

    GPU memory (NVML, per process) goes to its GPU's device pool, host memory (the pod's working
    set, or its processes' RSS) to the host pool; on a unified board both go to the one pool.
    What a pool's consumers hold is clamped to its measured usage, so the board never claims
    more attributed memory than was measured (the two are sampled a moment apart).
    """
    by_key = {(p.kind, p.device): p for p in pools}
    unified = PoolKind.UNIFIED in {p.kind for p in pools}
    charges: dict[tuple[ConsumerKindName, str, str, PoolKind, int | None], int] = {}

    def charge(
        kind: ConsumerKindName,
        namespace: str,
        name: str,
        pool: PoolKind,
        device: int | None,
        n: int,
    ) -> None:
        key = (kind, namespace, name, pool, device)
        charges[key] = charges.get(key, 0) + n

    for gpu in readings.nvml.gpus:
        for proc in gpu.processes:
            owner = readings.gpu_owners.get(proc.pid)
            if owner is None or not proc.used_bytes:
                continue
            if unified:
                charge(
                    owner.kind, owner.namespace, owner.name, PoolKind.UNIFIED, None, proc.used_bytes
                )
            elif (PoolKind.DEVICE, gpu.index) in by_key:
                charge(
                    owner.kind,
                    owner.namespace,
                    owner.name,
                    PoolKind.DEVICE,
                    gpu.index,
                    proc.used_bytes,
                )
    host_kind = PoolKind.UNIFIED if unified else PoolKind.HOST
    for owner, n in readings.consumer_host_bytes.items():
        if n > 0 and (host_kind, None) in by_key:
            charge(owner.kind, owner.namespace, owner.name, host_kind, None, n)

    left = {key: p.used_bytes or 0 for key, p in by_key.items()}
    out = []
    for (kind, namespace, name, pool, device), n in sorted(
        charges.items(),
        key=lambda item: (item[0][1], item[0][2], item[0][0], item[0][3], item[0][4] or 0),
    ):
        granted = min(n, left[(pool, device)])
        left[(pool, device)] -= granted
        if granted > 0:
            out.append(
                ConsumerUsage(
                    kind=kind,
                    namespace=namespace,
                    name=name,
                    pool=pool,
                    device=device,
                    used_bytes=granted,
                )
            )
    return out
