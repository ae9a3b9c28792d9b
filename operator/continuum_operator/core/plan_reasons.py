"""Why a serving plan is what it is: the reason codes `continuum plan` and Engine `status.plan`
show (docs/plan.md, "The plan's fields").

A module of its own so that the memory modes (`core.modes`), which say why a budget is what it
is, and the plan (`core.plan`), which says why the rest is, share one vocabulary without
importing each other; `core.plan` re-exports both names.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Reason", "ReasonCode"]


class ReasonCode(StrEnum):
    ALL_LAYERS_ON_DEVICE = "AllLayersOnDevice"
    LAYERS_LIMITED_BY_DEVICE = "LayersLimitedByDeviceBudget"
    LIMITED_BY_PER_PROCESS_CAP = "LimitedByPerProcessCap"
    OFFLOAD_NONE = "OffloadNone"
    OFFLOAD_FIXED = "OffloadFixed"
    MINDS_AT_MAX = "MindsAtMax"
    MINDS_LIMITED_BY_POOL = "MindsLimitedByPool"
    MEMORY_MODE_UNKNOWN = "MemoryModeUnknown"
    DEVICE_UNGOVERNED = "DeviceUngoverned"
    DEVICE_BUDGET_DECLARED = "DeviceBudgetDeclared"
    OFFLOAD_UNGOVERNED = "OffloadUngoverned"
    POOL_UNSAMPLED = "PoolUnsampled"
    COMPUTE_ESTIMATED = "ComputeEstimated"
    COHERENT_DEVICE = "CoherentDevice"
    NO_HOST_POOL = "NoHostPool"
    NOT_ENOUGH_GPUS = "NotEnoughGpus"
    OFFLOAD_DOES_NOT_FIT = "OffloadDoesNotFit"
    INSUFFICIENT_MEMORY = "InsufficientMemory"
    RECEIPT_USED = "ReceiptUsed"
    RECEIPT_REFUSED = "ReceiptRefused"
    EXPERT_OFFLOAD_NOT_PLANNED = "ExpertOffloadNotPlanned"
    SLIDING_WINDOW_KV = "SlidingWindowKv"
    NO_DISK_POOL = "NoDiskPool"
    INSUFFICIENT_DISK = "InsufficientDisk"


@dataclass(frozen=True, slots=True)
class Reason:
    code: ReasonCode
    message: str
