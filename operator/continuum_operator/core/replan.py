"""A running engine's plan made again, and whether a new one is a change of the node or of the
code (docs/operator.md, "Upgrades: a plan the node did not change is held").

The seed system's upgrade gave a 2 GB plan where 28 GB had been planned on the same machine, and
relaunched its engine 13 times in 4 minutes with half its weights on the CPU. Its lesson: replay
the serving plan against the board before any redeploy. Here a plan in force records the
reading of its node it was made on, or last confirmed on (`node_reading`: the board's pools and
mode as the agent wrote them, the other consumers' leases there, the receipts it may plan
from); a re-plan whose engine arguments differ while that reading is the same is the
operator's code changing its mind about an unchanged node, and is held (`HoldVerdict.HELD`)
until a person accepts it (`accepted_plan`, the Engine's annotation `ACCEPT_ANNOTATION`) or the
node's reading changes. Lease renewals, which damping counts as readings, are not part of it:
they say the board is fresh, not that it moved.

`replan` is the operator's re-plan of a running engine on its own node (crediting its own lease
less its reserve), shared by the operator and `continuum plan --replay`, so the replay lists
what the operator would do. Pure.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from continuum_operator.core.bestfit import with_unmeasured
from continuum_operator.core.plan import ServingPlan, plan, vet_receipts
from continuum_operator.core.pools import Board, BoardLeases, ConsumerKind, Lease
from continuum_operator.core.receipts import Receipt
from continuum_operator.model.engine import EngineSpec, ModelFacts
from continuum_operator.model.plan_status import PlanStatus

__all__ = [
    "ACCEPT_ANNOTATION",
    "HoldVerdict",
    "Replayed",
    "engine_reading",
    "held_message",
    "hold_verdict",
    "node_reading",
    "plan_id",
    "replan",
]

#: The Engine annotation by which a person accepts a held plan: its value is the plan's id.
ACCEPT_ANNOTATION = "continuum.dev/accept-plan"


def node_reading(board: Board, leases: Iterable[Lease], receipts: Iterable[Receipt]) -> str:
    """What a re-plan of an engine reads of its node, as a short digest: the board's mode, cap
    and pools (capacity and the usage the agent last wrote: it writes only past a threshold),
    the other consumers' leases there, and the receipts it may plan from. The same digest is
    the same node; the code that plans from it is not in it."""
    doc = {
        "node": board.node,
        "mode": str(board.memory_mode),
        "cap": board.per_process_cap_bytes,
        "pools": sorted(
            (p.key, p.capacity_bytes, p.used_bytes, p.coherent) for p in board.pools.values()
        ),
        "leases": sorted((x.consumer, x.pool, x.bytes, x.floor_bytes) for x in leases),
        "receipts": sorted(r.model_dump_json(by_alias=True) for r in receipts),
    }
    text = json.dumps(doc, separators=(",", ":"), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_id(engine_args: Sequence[str]) -> str:
    """A plan's id as a person accepts it: a digest of its engine arguments (what relaunches)."""
    return hashlib.sha256("\0".join(engine_args).encode()).hexdigest()[:12]


class HoldVerdict(StrEnum):
    NONE = "None"  # the same arguments, or the node changed: damping weighs it as ever
    HELD = "Held"  # new arguments on an unchanged node: not applied
    ACCEPTED = "Accepted"  # held, and a person accepted this very plan


def hold_verdict(
    running_args: Sequence[str],
    candidate: ServingPlan,
    recorded: str | None,
    reading: str,
    accepted: str | None,
) -> HoldVerdict:
    """Whether a schedulable re-plan of a running engine is held: its arguments differ from the
    plan in force's while the node reads as it did when that plan was made or last confirmed
    (`recorded`; None, a plan of an operator before this one: its node cannot be told to have
    changed, so it is held too)."""
    if tuple(candidate.engine_args) == tuple(running_args):
        return HoldVerdict.NONE
    if recorded is not None and recorded != reading:
        return HoldVerdict.NONE
    if accepted is not None and accepted == plan_id(candidate.engine_args):
        return HoldVerdict.ACCEPTED
    return HoldVerdict.HELD


def held_message(engine: str, was: PlanStatus, candidate: ServingPlan) -> str:
    """The PlanHeld condition's message: the old and new plans, why, and how to apply it."""
    ns, _, name = engine.partition("/")
    return (
        f"a new plan ({candidate.layers_on_device}/{candidate.total_layers} layers, "
        f"{candidate.minds_grantable} minds, {candidate.pool_tokens} pool tokens) differs from "
        f"the plan in force ({was.layers_on_device}/{was.total_layers} layers, "
        f"{was.minds_grantable} minds, {was.pool_tokens} pool tokens) while node "
        f"{candidate.node} reads as it did when that plan was made: a change of the operator's "
        "code, not of the node, so it is held and the engine keeps serving as it is. To apply "
        f"it: kubectl annotate engine -n {ns} {name} --overwrite "
        f"{ACCEPT_ANNOTATION}={plan_id(candidate.engine_args)}; it also applies once the "
        'node\'s readings change (docs/operator.md, "Upgrades")'
    )


@dataclass(frozen=True, slots=True)
class Replayed:
    """A running engine's re-plan, and what it read of its node."""

    plan: ServingPlan
    reading: str


def replan(
    board: Board,
    spec: EngineSpec,
    facts: ModelFacts,
    me: str,
    own: Iterable[tuple[str, int]],
    others: Sequence[Lease],
    assumed: Sequence[Lease],
    *,
    receipts: Sequence[Receipt] = (),
    llama_build: str | None = None,
    on_gpus: Sequence[int] = (),
) -> Replayed:
    """The plan a running engine would get on its own node now (`board`, its node's), crediting
    back what it holds (`own`: its lease, bytes per pool), on the GPUs it runs on (`on_gpus`).

    `others`: the other consumers' leases on the node; `assumed`: those of them no board has
    measured yet (their pods have not started), counted as usage.

    The agent measures the engine's bytes, not the reserve kept free beside them, so only the
    lease less its reserve is taken off the measured usage; crediting the whole lease would
    count the reserve as free, and every relaunch would find one reserve more room than the
    last (a ratchet to out-of-memory).
    """
    measured = with_unmeasured(board, assumed)
    reserve = spec.reserve_bytes
    mine = [
        Lease(me, ConsumerKind.ENGINE, board.node, pool, max(0, n - reserve)) for pool, n in own
    ]
    ledger = BoardLeases.of(measured, [*others, *mine])
    candidate = plan(
        measured,
        spec,
        facts,
        ledger,
        crediting=me,
        receipts=receipts,
        llama_build=llama_build,
        on_gpus=on_gpus,
    )
    return Replayed(candidate, engine_reading(board, spec, facts, others, receipts, llama_build))


def engine_reading(
    board: Board,
    spec: EngineSpec,
    facts: ModelFacts,
    others: Iterable[Lease],
    receipts: Sequence[Receipt] = (),
    llama_build: str | None = None,
) -> str:
    """`node_reading` of what a plan of `spec` reads there. Only the receipts it may plan from
    count: one beyond the bound changes no plan, and must not change the reading either (a pod
    writing its own report could lift a hold with it)."""
    usable, _ = vet_receipts(spec, facts, receipts, llama_build)
    return node_reading(board, others, usable)
