"""EmbedLanes in the operator: placed beside their engine, charged where they reside.

One pass over one EmbedLane, from the snapshot to a status patch (no API calls; `LaneLoop`
applies it). A lane beside an engine goes to the engine's node once the engine is placed; its
residence follows the backend (the lane runtime's `gpuOffload`, else the engine runtime's) and
the engine's layers on the device (`core.embed.residence`); its bytes come from the lane's
receipts or the estimate, and its lease is sized against the node's ledger: every engine's
placement, every other lane's, and the lane's own (credited back). A lane with a model of its
own (inline facts) goes to the fresh board that holds the largest context, on the host.

The operator writes `status.placement` (residence, bytes per pool, floors) and the `Placed`
condition; `status.runtime` is the lane runtime's (docs/design.md "One writer per status field").
Floors only rise: the placement's floors are carried from one pass to the next. Nothing is
re-placed on a stale board. The lane's placement is read back into every engine's ledger
(`core.placements.lane_placement_leases`, through `kube.state.occupancy.other_leases`), so an engine
planned on that node accounts for the lane's bytes.
Neighbours: `core.embed`, `kube.state.cache` (the snapshot), `kube.base.kernel` (runs `LaneLoop`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from continuum_operator.core import conditions as cond
from continuum_operator.core.bestfit import with_unmeasured
from continuum_operator.core.embed import (
    LaneAsk,
    LanePlacement,
    LaneReason,
    LaneSizer,
    LaneVerdict,
    Residence,
    place_lane,
    residence,
)
from continuum_operator.core.placements import consumer_name, lane_placement_leases
from continuum_operator.core.pools import Board, BoardLeases, ConsumerKind, Lease
from continuum_operator.core.receipts import Receipt
from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.base import events
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.merge_patch import merge_patch, status_patch
from continuum_operator.kube.ledger.cached import engine_only
from continuum_operator.kube.state.cache import Snapshot
from continuum_operator.kube.state.occupancy import LaneKey, is_fresh, lane_leases_in, other_leases
from continuum_operator.kube.workloads import lane_objects
from continuum_operator.model.base import Condition
from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
from continuum_operator.model.engine import Engine, EnginePlacement, ModelFacts
from continuum_operator.model.json_body import (
    at,
    integer,
    items_at,
    namespaced_name,
    object_at,
    text,
)
from continuum_operator.model.plan_status import PlanStatus

__all__ = [
    "LaneConditionType",
    "LaneWrites",
    "lane_leases_in",
    "reconcile_lane",
]

log = logging.getLogger("continuum.operator.embedlanes")


class LaneConditionType(StrEnum):
    PLACED = "Placed"


class LaneWaitReason(StrEnum):
    """Why a lane is not placed yet, besides what `core.embed` says of the pools."""

    INVALID_SPEC = "InvalidSpec"
    ENGINE_NOT_FOUND = "EngineNotFound"
    ENGINE_NOT_PLACED = "EngineNotPlaced"
    FACTS_MISSING = "FactsMissing"
    NO_FRESH_BOARD = "NoFreshBoard"
    BOARD_STALE = "BoardStale"


#: Reasons a person need not look at: the lane waits for something that is on its way.
_QUIET = frozenset({LaneWaitReason.ENGINE_NOT_PLACED.value, LaneReason.POOL_UNSAMPLED.value})


@dataclass(frozen=True, slots=True)
class LaneWrites:
    status_patch: dict[str, Any] | None
    events: tuple[events.Event, ...] = ()
    deployment: dict[str, Any] | None = (
        None  # the lane's pod (`kube.workloads.lane_objects`), wanted
    )
    #: its ServiceAccount, Role, RoleBinding, and ClusterRoleBinding (token review)
    identity: tuple[dict[str, Any], ...] = ()
    network_policy: dict[str, Any] | None = None  # who may reach the pod, on which port
    no_pod: str | None = None  # why the lane gets no pod, when it does not


def _engine_leases(snap: Snapshot) -> tuple[list[Lease], list[Lease]]:
    """(every engine's and lane's leases, those of engines whose pods have not started yet)."""
    nobody = ("", "")
    return other_leases(snap, nobody), other_leases(snap, nobody, assumed_only=True)


def is_deleting(body: Mapping[str, object]) -> bool:
    return bool(at(body, "metadata", "deletionTimestamp"))


def _fresh(snap: Snapshot, node: str, now: float, settings: OperatorSettings) -> bool:
    return is_fresh(snap, node, now, settings.freshness.default_ttl_seconds)


def _facts_of_engine(engine: Mapping[str, object]) -> ModelFacts | None:
    inline = at(engine, "spec", "model", "facts")
    read = at(engine, "status", "modelFacts", "facts")
    for raw in (inline, read):
        if raw:
            try:
                return ModelFacts.model_validate(raw)
            except ValidationError:
                return None
    return None


def _in_force(engine: Mapping[str, object]) -> tuple[PlanStatus, EnginePlacement] | None:
    """An Engine's plan and placement in force; None where it has not both (not placed, or a
    part that does not validate: not guessed)."""
    plan, placement = at(engine, "status", "plan"), at(engine, "status", "placement")
    if not plan or not placement:
        return None
    try:
        return PlanStatus.model_validate(plan), EnginePlacement.model_validate(placement)
    except ValidationError:
        return None


def _receipts(status: Mapping[str, object], model_sha256: str | None) -> tuple[Receipt, ...]:
    """The lane runtime's receipts; where the model's digest is known, only that model's."""
    out = []
    for raw in items_at(status, "runtime", "receipts"):
        try:
            r = Receipt.model_validate(raw)
        except ValidationError:
            continue
        if model_sha256 is None or r.model_sha256 == model_sha256:
            out.append(r)
    return tuple(out)


class _LanePass:
    def __init__(
        self, body: Mapping[str, object], snap: Snapshot, now: float, settings: OperatorSettings
    ) -> None:
        self.body, self.snap, self.now, self.settings = body, snap, now, settings
        self.key: LaneKey = namespaced_name(body)
        self.me = consumer_name(ConsumerKind.EMBED_LANE, *self.key)
        self.generation = integer(body, "metadata", "generation")
        self.status = object_at(body, "status")
        self.runtime = object_at(self.status, "runtime")
        conditions = items_at(self.status, "conditions")
        self.old_conditions = [Condition.model_validate(c) for c in conditions]
        self.held: EmbedLanePlacement | None = None
        try:
            raw = self.status.get("placement")
            self.held = EmbedLanePlacement.model_validate(raw) if raw else None
        except ValidationError:
            self.held = None

    def finish(
        self, placement: Mapping[str, object] | None, placed: bool, reason: str, message: str
    ) -> LaneWrites:
        c = Condition(
            type=str(LaneConditionType.PLACED),
            status="True" if placed else "False",
            reason=reason,
            message=message[:4096],
            observed_generation=self.generation,
        )
        conditions = cond.merge(self.old_conditions, [c], format_seconds(self.now))
        new: dict[str, object] = {
            "placement": placement,
            "conditions": [x.model_dump(by_alias=True, exclude_none=True) for x in conditions],
            "observedGeneration": self.generation,
        }
        patch = status_patch(self.status, new)
        notes = tuple(
            events.Event(
                "Normal" if x.status == "True" or x.reason in _QUIET else "Warning",
                x.reason,
                x.message,
            )
            for x in cond.transitions(self.old_conditions, conditions)
        )
        return LaneWrites({"status": patch} if patch else None, notes)

    def keep(self, reason: str, message: str) -> LaneWrites:
        """Keep what the lane holds (its bytes are still resident), and say why."""
        held = self.status.get("placement")
        if not isinstance(held, Mapping):
            return self.finish(None, False, reason, message)
        return self.finish(held, self._fits(held), reason, message)

    def release(self, reason: str, message: str) -> LaneWrites:
        """Not placed, holding only its floors as a waiting lane (its pod goes), and why."""
        held = object_at(self.status, "placement")
        pools = [
            {"pool": at(x, "pool"), "bytes": floor, "floorBytes": floor}
            for x in items_at(held, "pools")
            if (floor := at(x, "floorBytes"))
        ]
        kept = {"verdict": "Waits", "reason": reason, "message": message, "contextTokens": 0}
        doc = {**held, **kept, "pools": pools} if pools else None
        return self.finish(doc, False, reason, message)

    @staticmethod
    def _fits(held: Mapping[str, object]) -> bool:
        return held.get("verdict") == str(LaneVerdict.FITS)

    def ask(self, lane: EmbedLane, node: str) -> LaneAsk:
        # What it has embedded holds only where it holds a lease, and only within that lease:
        # its runtime admits against status.placement, and its pod writes the report (a claim
        # past the lease would raise floors, kept for good, past what the node has). On another
        # node its pod starts afresh, with no floor.
        floors: dict[str, int] = {}
        largest = 0
        if self.held is not None and self.held.node == node:
            floors = {p.pool: p.floor_bytes for p in self.held.pools if p.floor_bytes > 0}
            reported = integer(self.runtime, "largestContextTokens") or 0
            largest = max(min(reported, self.held.context_tokens), self.held.floor_tokens)
        largest = min(largest, lane.spec.max_context_tokens)
        own = lane.spec.model.facts if lane.spec.model is not None else None
        weights = 0
        if own is not None:  # a model of its own: its weights are the lane's too
            weights = sum(own.layer_bytes_list()) + own.input_bytes + own.output_bytes
        return LaneAsk(self.me, lane.spec.max_context_tokens, largest, floors, weights)

    def board_leases(self, board: Board) -> tuple[Board, BoardLeases]:
        """Every engine's and every other lane's leases, and the lane's own (to credit back)."""
        everyone, assumed = _engine_leases(self.snap)
        measured = with_unmeasured(board, [x for x in assumed if x.consumer != self.me])
        mine = lane_placement_leases(self.me, self.held) if self.held is not None else []
        others = [lease for lease in everyone if lease.consumer != self.me]
        return measured, BoardLeases.of(measured, [*others, *mine])

    def place_on(
        self,
        lane: EmbedLane,
        board: Board,
        facts: ModelFacts,
        where: Residence,
        why: LaneReason,
        gpus: list[int],
        sha256: str | None = None,
    ) -> LanePlacement:
        measured, ledger = self.board_leases(board)
        sizer = LaneSizer(facts, _receipts(self.status, sha256))
        return place_lane(
            measured, ledger, self.ask(lane, board.node), sizer,
            where=where, residence_reason=why, gpus=gpus,
        )  # fmt: skip

    def written(self, p: LanePlacement, gpus: list[int]) -> LaneWrites:
        doc: dict[str, object] | None = {
            **p.to_dict(),
            "gpus": list(gpus) if p.residence is not Residence.HOST else [],
        }
        if p.verdict is LaneVerdict.FITS:
            return self.finish(doc, True, str(p.reason), p.message)
        # Waiting or failing: what the lane already holds (its floors) stays leased.
        if p.floors and doc is not None:
            doc["pools"] = [
                {"pool": pool, "bytes": n, "floorBytes": n} for pool, n in sorted(p.floors.items())
            ]
        else:
            doc = None
        return self.finish(doc, False, str(p.reason), p.message)

    # -- a lane beside an engine ----------------------------------------------------------

    def beside(self, lane: EmbedLane, engine_name: str) -> LaneWrites:
        W = LaneWaitReason
        engine = self.snap.engines.get((self.key[0], engine_name))
        if engine is None:
            return self.release(
                W.ENGINE_NOT_FOUND,
                f"Engine {self.key[0]}/{engine_name} not found (or not served by this operator): "
                f"create it, or name an Engine of namespace {self.key[0]} in spec.engine",
            )
        in_force = _in_force(engine)
        if in_force is None:
            return self.keep(
                W.ENGINE_NOT_PLACED,
                f"Engine {engine_name} is not placed yet; the lane goes where the engine goes",
            )
        plan, placement = in_force
        node = placement.node
        entry = self.snap.boards.get(node)
        if entry is None or entry.board is None:
            return self.keep(W.NO_FRESH_BOARD, f"node {node} has no readable NodeBoard")
        if not _fresh(self.snap, node, self.now, self.settings):
            return self.keep(W.BOARD_STALE, f"node {node}'s board is stale; nothing re-placed")
        facts = _facts_of_engine(engine)
        if facts is None:
            return self.keep(W.FACTS_MISSING, f"Engine {engine_name}'s model facts are not known")
        offloads = self.runtime.get("gpuOffload")
        if offloads is None:
            offloads = at(engine, "status", "runtime", "gpuOffload")
        where, why = residence(
            backend_offloads=offloads if isinstance(offloads, bool) else None,
            layers_on_device=plan.layers_on_device,
            total_layers=plan.total_layers,
        )
        gpus = list(placement.gpus)
        sha = text(engine, "spec", "model", "sha256")
        p = self.place_on(lane, entry.board, facts, where, why, gpus, sha)
        return self.written(p, gpus)

    # -- a lane with a model of its own -----------------------------------------------------

    def own_model(self, lane: EmbedLane) -> LaneWrites:
        W = LaneWaitReason
        model = lane.spec.model
        facts = model.facts if model is not None else None
        if model is None or facts is None:
            return self.keep(
                W.FACTS_MISSING,
                "a lane with its own model needs spec.model.facts (`continuum facts MODEL.gguf`)",
            )
        held_on = self.held.node if self.held is not None else ""  # gone with its board: anew
        if self.held is not None and (held_on in self.snap.boards or held_on in self.snap.nodes):
            entry = self.snap.boards.get(self.held.node)
            if entry is None or entry.board is None:
                return self.keep(W.NO_FRESH_BOARD, f"node {self.held.node} has no NodeBoard")
            if not _fresh(self.snap, self.held.node, self.now, self.settings):
                return self.keep(W.BOARD_STALE, f"node {self.held.node}'s board is stale")
            where, why = residence(backend_offloads=None, layers_on_device=0, total_layers=1)
            p = self.place_on(lane, entry.board, facts, where, why, [], model.sha256)
            return self.written(p, [])
        best: LanePlacement | None = None
        for name in sorted(self.snap.boards):
            entry = self.snap.boards[name]
            if entry.board is None or not _fresh(self.snap, name, self.now, self.settings):
                continue
            where, why = residence(backend_offloads=None, layers_on_device=0, total_layers=1)
            p = self.place_on(lane, entry.board, facts, where, why, [], model.sha256)
            rank = (_VERDICT_ORDER[p.verdict], p.context_tokens)
            if best is None or rank > (_VERDICT_ORDER[best.verdict], best.context_tokens):
                best = p
        if best is None:
            return self.keep(W.NO_FRESH_BOARD, "no node has a fresh NodeBoard")
        return self.written(best, [])


_VERDICT_ORDER = {LaneVerdict.FAILS: 0, LaneVerdict.WAITS: 1, LaneVerdict.FITS: 2}


def reconcile_lane(
    body: Mapping[str, object], snap: Snapshot, now: float, settings: OperatorSettings
) -> LaneWrites:
    """The status patch one pass over one EmbedLane needs (None: nothing changed)."""
    p = _LanePass(body, snap, now, settings)
    try:
        lane = EmbedLane.model_validate(dict(body))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        return p.keep(
            LaneWaitReason.INVALID_SPEC,
            f"EmbedLane {p.key[0]}/{p.key[1]} is malformed: {where}: {first['msg']}",
        )
    engine = lane.spec.engine
    writes = p.beside(lane, engine) if engine is not None else p.own_model(lane)
    return _with_workload(writes, lane, p, settings)


def _with_workload(
    writes: LaneWrites, lane: EmbedLane, p: _LanePass, settings: OperatorSettings
) -> LaneWrites:
    """The pod the lane's placement calls for, after this pass's status patch."""
    status = merge_patch(p.status, (writes.status_patch or {}).get("status") or {})
    try:
        raw = status.get("placement")
        placement = EmbedLanePlacement.model_validate(raw) if raw else None
    except ValidationError:
        placement = None
    engine: Engine | None = None
    facts: ModelFacts | None = None
    if lane.spec.engine is not None:
        body = p.snap.engines.get((p.key[0], lane.spec.engine))
        try:
            engine = Engine.model_validate(engine_only(body)) if body is not None else None
        except ValidationError:
            engine = None
        facts = _facts_of_engine(body) if body is not None else None
    why = lane_objects.why_no_pod(lane, placement, engine, settings.pods)
    if why is not None or placement is None:
        return replace(writes, no_pod=why)
    uid = text(p.body, "metadata", "uid") or ""
    return replace(
        writes,
        deployment=lane_objects.lane_deployment(
            lane, uid, placement, engine, settings.pods, facts=facts
        ),
        identity=tuple(lane_objects.lane_identity(lane, uid)),
        network_policy=lane_objects.lane_network_policy(lane, uid, settings.pods),
    )
