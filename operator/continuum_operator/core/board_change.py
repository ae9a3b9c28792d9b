"""Whether a new board is worth writing: no write storms across a thousand nodes.

The agent probes every few seconds; the board is written only when it changed past a threshold
against the board last *written* (not the last probed, so a slow drift still gets written once
it adds up). Anything structural is a change at once: the memory mode or its reason, a pool's
capacity or coherence, the GPUs, the per-process cap, the cap mechanisms, which consumers are
present. Usage is a change when it moved by at least `max(min_bytes, fraction * capacity)` of
its pool, or when a pool went from unsampled to sampled (or back). Freshness is not the board's
job: the node's Lease carries it (core/heartbeat.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from continuum_operator.model.board import NodeBoardStatus, PoolKind

__all__ = ["Change", "Thresholds", "board_change"]

MiB = 2**20


@dataclass(frozen=True, slots=True)
class Thresholds:
    """How far measured usage must move before the board is rewritten."""

    # Fraction of the pool's capacity; 2% of an 80 GiB GPU is 1.6 GiB.
    used_fraction: float = 0.02
    # Floor in bytes, so a small pool is not rewritten for noise; 256 MiB by default.
    used_min_bytes: int = 256 * MiB

    def step(self, capacity_bytes: int) -> int:
        return max(self.used_min_bytes, int(capacity_bytes * self.used_fraction))


@dataclass(frozen=True, slots=True)
class Change:
    write: bool
    reason: str  # what changed, or why nothing did: for the agent's log


def _shape(status: NodeBoardStatus) -> dict[str, Any]:
    """The status with each measured usage reduced to whether it was sampled: must match exactly."""
    doc = status.model_dump(mode="json")
    for pool in doc["pools"]:
        pool["used_bytes"] = pool["used_bytes"] is not None
    for consumer in doc["consumers"]:
        del consumer["used_bytes"]
    return doc


def _pool_name(kind: PoolKind, device: int | None) -> str:
    return f"device/{device}" if device is not None else str(kind)


def board_change(
    written: NodeBoardStatus | None, new: NodeBoardStatus, thresholds: Thresholds = Thresholds()
) -> Change:
    """Compare the board last written with a new one; `write` says whether to send it."""
    if written is None:
        return Change(True, "no board written yet")
    old_shape, new_shape = _shape(written), _shape(new)
    if old_shape != new_shape:
        changed = [name for name in new_shape if old_shape.get(name) != new_shape[name]]
        return Change(True, "changed: " + ", ".join(changed))
    capacity = {(p.kind, p.device): p.capacity_bytes for p in new.pools}
    for old_pool, new_pool in zip(written.pools, new.pools, strict=True):
        if old_pool.used_bytes is None or new_pool.used_bytes is None:
            continue  # both None: `_shape` already matched them
        delta = abs(new_pool.used_bytes - old_pool.used_bytes)
        if delta >= thresholds.step(new_pool.capacity_bytes):
            return Change(
                True,
                f"{_pool_name(new_pool.kind, new_pool.device)} usage moved {delta / MiB:,.0f} MiB",
            )
    for old_c, new_c in zip(written.consumers, new.consumers, strict=True):
        delta = abs(new_c.used_bytes - old_c.used_bytes)
        if delta >= thresholds.step(capacity[(new_c.pool, new_c.device)]):
            return Change(
                True, f"{new_c.kind} {new_c.namespace}/{new_c.name} moved {delta / MiB:,.0f} MiB"
            )
    return Change(False, "within thresholds")
