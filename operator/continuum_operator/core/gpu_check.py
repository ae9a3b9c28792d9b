"""Whether an engine's lease charges the GPUs its processes use, and where to move it if not.

With `--gpu-claims device-plugin` an engine's pod asks for `nvidia.com/gpu: N` and the device
plugin picks which N GPUs it gets; the plan charged `device/<i>` by its own choice, so on a node
of several GPUs the two may differ. The node agent reports which GPUs each placed engine's
processes run on (NodeBoard `consumerGpus`, from NVML's per-device process lists:
`core.nodeboard`, read into `core.pools.Board.gpus_in_use`). This module compares the two and,
on a mismatch, moves the lease's device charges to the GPUs in use, byte for byte: the ledger
then charges each byte once, in the pool it is in, and frees the pool it is not in
(docs/operator.md, "The GPU charged is the GPU in use", says why a re-charge and not a
relaunch).

Pure: the plan's GPUs and charges and the board's attribution in, a verdict and the charges to
write out. `kube.engines.reconcile` applies it to a running engine's status; `core.plan` keeps the
GPUs an engine runs on when it is re-planned (`plan(..., on_gpus=...)`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from continuum_operator.core.pools import pool_key
from continuum_operator.model.board import MemoryMode, PoolKind

__all__ = ["GpuCheck", "GpuVerdict", "check", "moved_charges"]


class GpuVerdict(StrEnum):
    """What the board's attribution says of the GPUs an engine is charged on."""

    NO_DEVICE_CHARGE = "NoDeviceCharge"  # not a discrete plan with layers on a GPU: nothing to move
    NOT_ATTRIBUTED = "NotAttributed"  # the board names no GPU of this engine's: nothing to go by
    AS_CHARGED = "AsCharged"  # every GPU it was seen on is one it is charged on
    INCOMPLETE = "Incomplete"  # seen on others, but not on as many as charged: not enough to move
    ELSEWHERE = "Elsewhere"  # on as many GPUs as charged, not all of them the charged ones


@dataclass(frozen=True, slots=True)
class GpuCheck:
    verdict: GpuVerdict
    charged: tuple[int, ...]
    in_use: tuple[int, ...]

    @property
    def moves(self) -> dict[int, int]:
        """Charged GPU -> the GPU in use its charge moves to (ELSEWHERE only; GPUs in both
        stay where they are)."""
        if self.verdict is not GpuVerdict.ELSEWHERE:
            return {}
        leaving = sorted(set(self.charged) - set(self.in_use))
        arriving = sorted(set(self.in_use) - set(self.charged))
        return dict(zip(leaving, arriving, strict=True))

    def message(self) -> str:
        """For the event of a re-charge: what was charged, what is in use, what moved."""
        moves = ", ".join(f"device/{a} to device/{b}" for a, b in self.moves.items())
        return (
            f"its processes run on GPU {_list(self.in_use)} (the node agent's NVML attribution), "
            f"not GPU {_list(self.charged)} as charged: the device plugin chose; lease moved "
            f"{moves} (the pools left are freed)"
        )


def _list(gpus: Sequence[int]) -> str:
    return ", ".join(str(g) for g in gpus)


def check(charged: Sequence[int], in_use: Sequence[int], memory_mode: MemoryMode | str) -> GpuCheck:
    """Compare the GPUs a plan charges with those the engine's processes were seen on.

    Only a discrete plan charges GPUs one by one (a unified pool is one pool whatever the GPU,
    an unknown device is not charged). A re-charge needs the whole answer: as many GPUs in use
    as charged. Seen on fewer (still loading, or one process of a split not yet on its second
    GPU) or more (a stray context) is not enough to move a lease, and is left as it is.
    """
    charged_t, in_use_t = tuple(sorted(set(charged))), tuple(sorted(set(in_use)))
    if str(memory_mode) != MemoryMode.DISCRETE or not charged_t:
        verdict = GpuVerdict.NO_DEVICE_CHARGE
    elif not in_use_t:
        verdict = GpuVerdict.NOT_ATTRIBUTED
    elif set(in_use_t) <= set(charged_t):
        verdict = GpuVerdict.AS_CHARGED
    elif len(in_use_t) != len(charged_t):
        verdict = GpuVerdict.INCOMPLETE
    else:
        verdict = GpuVerdict.ELSEWHERE
    return GpuCheck(verdict, charged_t, in_use_t)


def moved_charges(charges: Sequence[tuple[str, int]], gpu: GpuCheck) -> tuple[tuple[str, int], ...]:
    """The charges with each moved GPU's device pool renamed to the GPU in use, bytes kept, in
    the order a plan lists them (the host or unified pool first, then devices by index)."""
    rename = {
        pool_key(PoolKind.DEVICE, a): pool_key(PoolKind.DEVICE, b) for a, b in gpu.moves.items()
    }
    out = [(rename.get(pool, pool), n) for pool, n in charges]
    devices = sorted((c for c in out if c[0].startswith("device/")), key=lambda c: _index(c[0]))
    return (*(c for c in out if not c[0].startswith("device/")), *devices)


def _index(pool: str) -> int:
    return int(pool.partition("/")[2])
