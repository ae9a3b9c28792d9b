"""NodeBoard: one node's memory mode and pools, as its agent measures them.

The board is written only by the node agent; its freshness is the node's coordination Lease,
not the board itself (a quiet board is not a stale one). The shape encodes DESIGN.md rule 1: a
unified board has exactly one `unified` pool, a discrete board one `host` pool and one `device`
pool per GPU, and an unknown board governs only its `host` pool.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, Self

from pydantic import Field, model_validator

from continuum_operator.model.base import Bytes, Condition, ObjectMeta, Resource, Spec


class MemoryMode(StrEnum):
    UNIFIED = "unified"
    DISCRETE = "discrete"
    UNKNOWN = "unknown"


class PoolKind(StrEnum):
    UNIFIED = "unified"
    DEVICE = "device"
    HOST = "host"


class PoolReading(Spec):
    """One pool as measured: capacity is a fixed fact, pressure shows up only as usage."""

    kind: PoolKind
    device: int | None = Field(default=None, ge=0, le=1023, description="GPU index (device pools only).")
    capacity_bytes: Bytes = Field(description="Capacity net of the OS's own reserve.")
    used_bytes: Bytes | None = Field(
        default=None,
        description="Measured usage; absent when the agent has not sampled yet (unknown, never full).",
    )
    coherent: bool | None = Field(
        default=None,
        description="Device pools only: the GPU can address system memory (HMM/ATS). Still its own pool.",
    )

    @model_validator(mode="after")
    def _device_fields_only_on_device_pools(self) -> Self:
        if self.kind is PoolKind.DEVICE:
            if self.device is None:
                raise ValueError("a device pool needs `device`, the GPU index it belongs to")
        elif self.device is not None or self.coherent is not None:
            raise ValueError(f"`device` and `coherent` belong to device pools only, not a {self.kind} pool")
        if self.used_bytes is not None and self.used_bytes > self.capacity_bytes:
            raise ValueError(
                f"usedBytes {self.used_bytes} exceeds capacityBytes {self.capacity_bytes}; "
                "capacity is the fixed size of the pool, report pressure as usage within it"
            )
        return self


class GpuInfo(Spec):
    index: int = Field(ge=0, le=1023)
    name: str = ""
    uuid: str = ""


class NodeBoardSpec(Spec):
    """Empty on purpose: a board is all status, written by its node's agent."""


class NodeBoardStatus(Spec):
    memory_mode: MemoryMode = MemoryMode.UNKNOWN
    memory_mode_reason: str = ""
    per_process_cap_bytes: Bytes | None = Field(
        default=None, description="A cap on one process's GPU memory (Metal working set, HAMi, MPS)."
    )
    pools: list[PoolReading] = Field(default_factory=list, max_length=1025)
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=1024)
    conditions: list[Condition] = Field(default_factory=list)

    @model_validator(mode="after")
    def _pools_match_memory_mode(self) -> Self:
        kinds = [p.kind for p in self.pools]
        if self.memory_mode is MemoryMode.UNIFIED:
            if kinds != [PoolKind.UNIFIED]:
                raise ValueError(
                    "a unified board has exactly one pool of kind `unified` "
                    "(device and host memory are one pool); got " + _kinds(kinds)
                )
        elif self.memory_mode is MemoryMode.DISCRETE:
            if kinds.count(PoolKind.HOST) != 1 or PoolKind.UNIFIED in kinds or PoolKind.DEVICE not in kinds:
                raise ValueError(
                    "a discrete board has one `host` pool and one `device` pool per GPU; got " + _kinds(kinds)
                )
            devices = [p.device for p in self.pools if p.kind is PoolKind.DEVICE]
            if len(set(devices)) != len(devices):
                raise ValueError(f"device pools repeat a GPU index: {devices}")
        elif kinds not in ([], [PoolKind.HOST]):
            raise ValueError(
                "an unknown-mode board governs only a `host` pool (device memory is unmeasured); got "
                + _kinds(kinds)
            )
        return self


def _kinds(kinds: list[PoolKind]) -> str:
    return "[" + ", ".join(str(k) for k in kinds) + "]" if kinds else "no pools"


class NodeBoard(Resource):
    KIND = "NodeBoard"
    PLURAL = "nodeboards"
    SHORT_NAMES = ("board", "boards")
    NAMESPACED = False
    PRINTER_COLUMNS = (
        {"name": "Mode", "type": "string", "jsonPath": ".status.memoryMode"},
        {"name": "Cap", "type": "integer", "jsonPath": ".status.perProcessCapBytes", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    )

    kind: Literal["NodeBoard"] = "NodeBoard"
    metadata: ObjectMeta
    spec: NodeBoardSpec = Field(default_factory=NodeBoardSpec)
    status: NodeBoardStatus = Field(default_factory=NodeBoardStatus)
