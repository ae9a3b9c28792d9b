"""Pools and the ledger of leases that charges bytes to them.

A pool is what the hardware shares (docs/design.md rule 1). On a unified board the device view and
the host view resolve to the same pool, so a byte charged through one is gone from the other
without any bookkeeping of its own. Available is capacity minus the larger of what is leased
and what is measured: leases not yet resident still count, and memory used outside every lease
("external") still counts. A pool that has not been sampled reports its availability as
unknown, never as full.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from continuum_operator.model.board import MemoryMode, NodeBoard, PoolKind


class ConsumerKind(StrEnum):
    ENGINE = "Engine"
    EMBED_LANE = "EmbedLane"


def pool_key(kind: PoolKind, device: int | None = None) -> str:
    """The name of a pool inside a node: `unified`, `host` or `device/<gpu index>`."""
    return f"device/{device}" if kind is PoolKind.DEVICE else str(kind)


@dataclass(frozen=True, slots=True)
class Pool:
    key: str
    kind: PoolKind
    capacity_bytes: int
    used_bytes: int | None
    device: int | None = None
    coherent: bool = False


@dataclass(frozen=True, slots=True)
class Board:
    """A node's board reduced to what planning reads."""

    node: str
    memory_mode: MemoryMode
    pools: Mapping[str, Pool]
    per_process_cap_bytes: int | None = None
    # The GPUs each placed consumer's processes were seen on ("Engine/<ns>/<name>" -> indices),
    # as the agent attributes them; empty where it attributes nothing (`core.gpu_check`).
    gpus_in_use: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # Each GPU's UUID as its driver reports it (index -> "GPU-..."), where the agent read one:
    # what a DRA claim selects a planned GPU by
    # (`kube.workloads.engine_objects.gpu_claim_template`).
    gpu_uuids: Mapping[int, str] = field(default_factory=dict)

    @classmethod
    def from_resource(cls, board: NodeBoard) -> Board:
        pools = {
            pool_key(p.kind, p.device): Pool(
                key=pool_key(p.kind, p.device),
                kind=p.kind,
                capacity_bytes=p.capacity_bytes,
                used_bytes=p.used_bytes,
                device=p.device,
                coherent=bool(p.coherent),
            )
            for p in sorted(board.status.pools, key=lambda p: (p.kind, p.device or 0))
        }
        return cls(
            node=board.metadata.name,
            memory_mode=board.status.memory_mode,
            pools=pools,
            per_process_cap_bytes=board.status.per_process_cap_bytes,
            gpus_in_use=_gpus_in_use(board),
            gpu_uuids={g.index: g.uuid for g in board.status.gpus if g.uuid},
        )

    def host_view(self) -> Pool | None:
        """The pool host allocations draw from: the unified pool on a unified board."""
        return self.pools.get("unified") or self.pools.get("host")

    def device_view(self, gpu: int) -> Pool | None:
        """The pool a GPU's allocations draw from: its own device pool, or on a unified board
        the one shared pool. The pools say it (a board's mode and its pools agree:
        `model.board`), so no memory mode is consulted here."""
        return self.pools.get(pool_key(PoolKind.DEVICE, gpu)) or self.pools.get("unified")


def _gpus_in_use(board: NodeBoard) -> dict[str, tuple[int, ...]]:
    """Which GPUs each consumer was seen on: its `consumerGpus` entry, and the device pools its
    measured bytes are charged to (the same attribution, for a board that gives only those)."""
    seen: dict[str, set[int]] = {}
    for c in board.status.consumer_gpus:
        seen.setdefault(f"{c.kind}/{c.namespace}/{c.name}", set()).update(c.gpus)
    for u in board.status.consumers:
        if u.pool is PoolKind.DEVICE and u.device is not None:
            seen.setdefault(f"{u.kind}/{u.namespace}/{u.name}", set()).add(u.device)
    return {name: tuple(sorted(gpus)) for name, gpus in sorted(seen.items())}


@dataclass(frozen=True, slots=True)
class Lease:
    """Bytes one consumer holds (or is assumed to hold) in one pool of one node."""

    consumer: str
    kind: ConsumerKind
    node: str
    pool: str
    bytes: int
    floor_bytes: int = 0


@dataclass(frozen=True, slots=True)
class BoardLeases:
    """Leases against one board; every figure is derived, none stored twice."""

    board: Board
    leases: tuple[Lease, ...] = field(default_factory=tuple)

    @classmethod
    def of(cls, board: Board, leases: Iterable[Lease]) -> BoardLeases:
        return cls(board, tuple(lease for lease in leases if lease.node == board.node))

    def leased_bytes(self, pool: str, *, excluding: str | None = None) -> int:
        return sum(
            lease.bytes
            for lease in self.leases
            if lease.pool == pool and lease.consumer != excluding
        )

    def external_bytes(self, pool: str) -> int | None:
        """Measured use outside every lease, shown as such; unknown before the first sample."""
        used = self.board.pools[pool].used_bytes
        return None if used is None else max(0, used - self.leased_bytes(pool))

    def available_bytes(self, pool: str, *, crediting: str | None = None) -> int | None:
        """capacity - max(leased, used); None while the pool is unsampled.

        `crediting` names a consumer whose own lease is handed back, as when planning the
        successor of a running engine: the relaunch frees what it holds. Its measured residency
        is taken off `used` up to the size of its lease.
        """
        p = self.board.pools[pool]
        if p.used_bytes is None:
            return None
        credit = self.leased_bytes(pool) - self.leased_bytes(pool, excluding=crediting)
        used = max(0, p.used_bytes - credit)
        leased = self.leased_bytes(pool, excluding=crediting)
        return max(0, p.capacity_bytes - max(leased, used))

    def lease(self, lease: Lease) -> BoardLeases:
        """A new ledger with one more lease; the pool must exist on the board."""
        if lease.node != self.board.node:
            raise ValueError(
                f"lease for node {lease.node} charged to the board of {self.board.node}"
            )
        if lease.pool not in self.board.pools:
            raise KeyError(f"node {self.board.node} has no pool {lease.pool}")
        return BoardLeases(self.board, (*self.leases, lease))
