"""Plain readings of one node, as the agent's probes return them.

The probes (agent/nvml.py over pynvml, agent/host.py over psutil and cgroup files,
agent/metal.py over sysctl) turn the raw structures of their backends into these values; the
board is then made from them by a pure function (core/nodeboard.py). Nothing here knows a
backend's API: a reading is what was measured, with the reason where something was not.
Sizes are bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from continuum_operator.model.board import CapMechanism

__all__ = [
    "Addressing",
    "CgroupLimit",
    "ConsumerKindName",
    "ConsumerRef",
    "DiskReading",
    "GpuMemoryStatus",
    "GpuProcess",
    "GpuReading",
    "HostReading",
    "MechanismReading",
    "MetalReading",
    "NodeReadings",
    "NumaNode",
    "NvmlReading",
]


ConsumerKindName = Literal["Engine", "EmbedLane"]


class Addressing(StrEnum):
    """NVML's addressing mode: whether the GPU can reach system memory. Never a memory mode."""

    NONE = "none"
    HMM = "hmm"  # heterogeneous memory management (x86 + recent driver)
    ATS = "ats"  # address translation services (Grace Hopper, Grace Blackwell)
    UNREPORTED = "unreported"  # the driver or the GPU does not say


class GpuMemoryStatus(StrEnum):
    MEASURED = "measured"
    NOT_SUPPORTED = "not-supported"  # GB10: the GPU has no framebuffer of its own
    FAILED = "failed"  # any other NVML error: the GPU is unmeasured


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    used_bytes: int | None  # None where NVML cannot tell (WDDM, some unified parts)


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    name: str
    uuid: str
    memory: GpuMemoryStatus
    capacity_bytes: int | None = None  # net of the driver's reserve (memory info v2)
    used_bytes: int | None = None
    memory_error: str = ""
    addressing: Addressing = Addressing.UNREPORTED
    numa_node: int | None = None  # set only where the GPU's memory is a NUMA node
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True, slots=True)
class NvmlReading:
    available: bool
    reason: str = ""  # why not, when not available
    driver: str = ""
    gpus: tuple[GpuReading, ...] = ()


@dataclass(frozen=True, slots=True)
class NumaNode:
    id: int
    total_bytes: int
    free_bytes: int
    cpus: int  # 0 for a memory-only node (a GPU's memory onlined as NUMA, CXL)


@dataclass(frozen=True, slots=True)
class CgroupLimit:
    """The tightest memory limit on the cgroup path the agent reads, and its working set."""

    path: str
    limit_bytes: int
    working_set_bytes: int


@dataclass(frozen=True, slots=True)
class HostReading:
    total_bytes: int  # MemTotal: already net of what the kernel reserved at boot
    available_bytes: int  # MemAvailable
    cgroup: CgroupLimit | None = None
    numa_nodes: tuple[NumaNode, ...] = ()


@dataclass(frozen=True, slots=True)
class MetalReading:
    """Apple silicon: one pool, and Metal's per-process working-set cap where sysctl shows it."""

    available: bool
    reason: str = ""
    chip: str = ""
    memory_bytes: int = 0
    wired_limit_bytes: int | None = None  # iogpu.wired_limit_mb; None when left at default


@dataclass(frozen=True, slots=True, order=True)
class ConsumerRef:
    """An engine or lane the operator placed on this node."""

    kind: ConsumerKindName
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class MechanismReading:
    mechanism: CapMechanism
    evidence: str


@dataclass(frozen=True, slots=True)
class DiskReading:
    """The filesystem that holds the node's emptyDir volumes (engines' park stores on disk)."""

    path: str
    capacity_bytes: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class NodeReadings:
    """Everything one probe cycle measured on a node."""

    host: HostReading
    nvml: NvmlReading
    metal: MetalReading | None = None
    # GPU process -> the consumer it belongs to (matched by pod or by process).
    gpu_owners: Mapping[int, ConsumerRef] = field(default_factory=dict)
    # Host memory (working set or RSS) of each placed consumer.
    consumer_host_bytes: Mapping[ConsumerRef, int] = field(default_factory=dict)
    mechanisms: tuple[MechanismReading, ...] = ()
    configured_cap_bytes: int | None = None  # an operator-configured per-process cap
    # The node's disk where park stores live (agent/disk.py); None: not probed.
    disk: DiskReading | None = None
