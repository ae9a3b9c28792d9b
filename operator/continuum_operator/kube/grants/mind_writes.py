"""The Minds' side of a grants pass: each Mind's `status.grant` and conditions projected from
her Engine's ledger (`kube.grants.mind_status`) and written when they differ, and the grant
finalizer on a Mind holding a slot (her deletion must release it first) and off a deleted one once
the ledger no longer holds her. The loop (`kube.grants.loop`) decides; this builds the writes, run
as asyncio tasks by `kube.grants.write_queue` (each API call awaited on the event loop, where its
answer is recorded in the cache). Neighbours: `kube.state.mind_cache` (the
Minds as last seen, and our writes' answers fed back to it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial

from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.base import crash
from continuum_operator.kube.base.grant_settings import GrantSettings
from continuum_operator.kube.client.api import ApiError, crd_path
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.client.body import bodies
from continuum_operator.kube.grants import mind_status
from continuum_operator.kube.grants.mind_status import Projection
from continuum_operator.kube.grants.quota_use import ClassNotes
from continuum_operator.kube.grants.write_queue import FINALIZER_WRITE, PROJECTION_WRITE, Write
from continuum_operator.kube.ledger import cached, grant_ledger, routing
from continuum_operator.kube.state.cache import EngineKey
from continuum_operator.kube.state.mind_cache import MindCache
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.json_body import integer, object_at
from continuum_operator.model.mind import HOLDING_STATES

__all__ = ["FINALIZER", "Job", "MindWrites"]

log = logging.getLogger("continuum.grants")

FINALIZER = "continuum.dev/grant"

#: A write for the writer: its priority, the key its writes are ordered by, and the write.
Job = tuple[int, str, Write]


def _without_nulls(value: object) -> object:
    """A merge patch's effect: null removes a key, so compare without them."""
    # Tuples, not unions, and a dict before a Mapping: the ABC's check costs several times a
    # type's, and this runs for every field of every Mind's status a pass compares.
    if isinstance(value, (str, int, float)) or value is None:
        return value
    if isinstance(value, (dict, Mapping)):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _patched_same(old: object, new: object) -> bool:
    """Whether merging `new` into `old` leaves it as it is. Equal values first: a status that
    says it already is most of them, and removing the nulls of both sides (a
    merge patch's null is an absent key) cost most of a full pass's CPU."""
    return old == new or _without_nulls(old) == _without_nulls(new)


class MindWrites:
    """Builds and runs the writes that bring Minds in line with their Engines' ledgers."""

    def __init__(
        self,
        api: AsyncKubeApi,
        minds: MindCache,
        settings: GrantSettings,
        clock: Callable[[], float],
        pod_port: int,
        ledgers: Mapping[EngineKey, Mapping[str, object]] | None = None,
        holders: cached.HolderIndex | None = None,
    ) -> None:
        self.api = api
        self.minds = minds
        self.settings = settings
        self.clock = clock
        self.pod_port = pod_port
        #: Every GrantLedger as watched (`Cache.ledgers`), other operators' Engines' too.
        self.ledgers: Mapping[EngineKey, Mapping[str, object]] = (
            ledgers if ledgers is not None else {}
        )
        #: Who those ledgers hold a slot for (`Cache.holders`, kept with them).
        self.holders = holders if holders is not None else cached.HolderIndex()
        self.projections_written = 0

    async def write_quota(self, quota: Mapping[str, object], status: Mapping[str, object]) -> None:
        """A TokenQuota's status (`kube.grants.quota_use.quota_status`); a failure raises."""
        meta = object_at(quota, "metadata")
        path = crd_path("tokenquotas", str(meta["namespace"]), str(meta["name"]), "status")
        try:
            answer = await self.api.merge_patch(path, {"status": status})
        except ApiError as err:
            if err.status != 404:
                raise
            return
        self.minds.observe_quota(answer, deleted=False, nudge=False)

    def endpoint(self, key: EngineKey) -> str:
        ns, name = key
        return self.settings.engine_addresses.get(
            f"{ns}/{name}", f"http://{name}.{ns}.svc:{self.pod_port}"
        )

    def projection_jobs(
        self,
        key: EngineKey,
        engine: Mapping[str, object],
        ledger_entries: list[GrantEntry],
        minds: Sequence[Mapping[str, object]],
        refused: Mapping[str, routing.Refused] | None = None,
        notes: ClassNotes | None = None,
    ) -> list[Job]:
        """The writes that bring this engine's Minds in line with its ledger: projections, and
        finalizers (on a Mind holding a slot, whose deletion must release it first; off a
        deleted Mind once the ledger no longer holds her)."""
        entries = {e.mind: e for e in ledger_entries}
        pool = object_at(engine, "status", grant_ledger.CAPACITY_FIELD)
        slot_tokens = integer(pool, "tokensPerSlot") or 0
        name = f"{key[0]}/{key[1]}"
        parked = mind_status.parked_of(engine)
        engine_note = grant_ledger.engine_note(engine)  # the engine's: once, not once a Mind
        jobs: list[Job] = []
        for m in sorted(minds, key=routing.mind_key):
            meta = object_at(m, "metadata")
            mkey = routing.mind_key(m)
            entry = entries.get(mkey)
            if meta.get("deletionTimestamp"):
                finalized = FINALIZER in _finalizers(m)
                if entry is None and finalized and not self.held_anywhere(mkey):
                    jobs.append((FINALIZER_WRITE, mkey, partial(self.finalize, m)))
                continue
            asked = integer(m, "spec", "contextTokens") or 0
            refusal = (refused or {}).get(mkey)
            if refusal is not None:
                projected = mind_status.refused_projection(refusal)
            else:
                projected = mind_status.projection(
                    entry,
                    name,
                    slot_tokens,
                    asked,
                    class_note=notes.class_note(m) if notes else "",
                    namespace_note=notes.namespace_note(m) if notes else "",
                    quota_note=notes.quota_note(str(meta.get("namespace"))) if notes else "",
                    engine_note=engine_note,
                )
            projected = projected.at(self.endpoint(key), parked.get(mkey))
            if self._projection(m, projected) is not None:
                jobs.append((PROJECTION_WRITE, mkey, partial(self.project_one, mkey, projected)))
            holding = entry is not None and entry.state in HOLDING_STATES
            if holding and FINALIZER not in _finalizers(m):
                jobs.append((FINALIZER_WRITE, mkey, partial(self.add_finalizer_to, mkey)))
        return jobs

    def missing_engine_jobs(
        self, key: EngineKey, minds: Sequence[Mapping[str, object]]
    ) -> list[Job]:
        """The writes for Minds of an Engine the cache lacks: EngineNotFound projections where
        her status does not say so yet, and the finalizer off a deleted Mind. One job an
        engine, which first asks the API server whether the Engine exists, unless its
        GrantLedger is watched here. If not, nothing holds her grant. If so, it is another
        operator's (`--engine-selector`), whose Minds are its own to tell, and whose ledger's
        holders are its own to release (it reclaims the slot through the gateway first); the
        finalizer comes off a deleted Mind its GrantLedger holds no slot for (no operator may
        serve that Engine at all)."""
        ledger = self.ledgers.get(key)
        if ledger is not None:
            # Its GrantLedger is watched here, so the Engine lives (the garbage collector
            # deletes the ledger with it, and that deletion marks the engine again): another
            # operator's, asked nothing (a GET each full pass, each foreign engine, was the
            # most of what the API server did for this operator's grants at rest).
            return [
                (FINALIZER_WRITE, mkey, partial(self.drop_finalizer, m))
                for m in minds
                if object_at(m, "metadata").get("deletionTimestamp")
                and FINALIZER in _finalizers(m)
                and not self.held_anywhere(mkey := routing.mind_key(m))
            ]
        projected = mind_status.refused_projection(mind_status.engine_not_found(key))
        deleted, stale = [], []
        for m in sorted(minds, key=routing.mind_key):
            if object_at(m, "metadata").get("deletionTimestamp"):
                deleted.append(routing.mind_key(m))
            elif self._projection(m, projected) is not None:
                stale.append(routing.mind_key(m))
        if not deleted and not stale:
            return []
        job = partial(self.tell_missing, key, stale, deleted)
        return [(PROJECTION_WRITE, f"engine:{key[0]}/{key[1]}", job)]

    def held_anywhere(self, mkey: str) -> bool:
        """Whether any watched GrantLedger holds a slot for the Mind: not only her Engine's, as
        she names it now (`spec.engine` may change while she holds a slot of another, which
        reclaims it; her finalizer stays until that slot is released too)."""
        return self.holders.holds(mkey)

    async def tell_missing(self, key: EngineKey, stale: list[str], deleted: list[str]) -> None:
        ns, name = key
        try:
            await self.api.request("GET", crd_path("engines", ns, name))
        except ApiError as err:
            if err.status != 404:
                raise
        else:  # it exists: not this operator's (its selector), so not for it to say
            stale = []
        for mkey in [m for m in deleted if not self.held_anywhere(m)]:
            mind = self.minds.minds.get(mkey)  # as the cache has her now
            if mind is not None:
                await self.drop_finalizer(mind)
        projected = mind_status.refused_projection(mind_status.engine_not_found(key))
        for mkey in stale:
            await self.project_one(mkey, projected)

    async def add_finalizer_to(self, mkey: str) -> None:
        """Add the finalizer to the Mind as the cache has her now (after her projection)."""
        mind = self.minds.minds.get(mkey)
        if mind is None or object_at(mind, "metadata").get("deletionTimestamp"):
            return
        if FINALIZER not in _finalizers(mind):
            await self.add_finalizer(mind)

    async def finalize(self, mind: Mapping[str, object]) -> None:
        crash.reached(crash.CrashPoint.BEFORE_FINALIZER_REMOVAL)
        await self.drop_finalizer(mind)

    async def project_one(self, mkey: str, projected: Projection) -> None:
        mind = self.minds.minds.get(mkey)  # as the cache has her now
        if mind is None:
            return
        answer = await self.write_projection(mind, projected)
        if answer is None:
            return
        self.projections_written += 1
        if self.projections_written == 1:
            crash.reached(crash.CrashPoint.MID_PROJECTIONS)

    def _projection(
        self, mind: Mapping[str, object], projected: Projection
    ) -> dict[str, object] | None:
        """The Mind's new status part, or None when hers already says it."""
        meta = object_at(mind, "metadata")
        old = object_at(mind, "status")
        old_conds = {c.get("type"): c for c in bodies(old.get("conditions"))}
        generation = meta.get("generation")
        now = format_seconds(self.clock())
        conditions = []
        for type_, (ok, reason, message) in projected.conditions.items():
            status = "True" if ok else "False"
            prev = old_conds.get(str(type_)) or {}
            since = prev.get("lastTransitionTime") if prev.get("status") == status else None
            c: dict[str, object] = {
                "type": str(type_),
                "status": status,
                "reason": reason or "Unknown",
                "message": message,
                "lastTransitionTime": since or now,
            }
            if generation is not None:
                c["observedGeneration"] = generation
            conditions.append(c)
        grant = projected.grant
        new: dict[str, object] = {
            # Every field, nulls too: a merge patch's null removes what she held (her slot).
            "grant": grant.model_dump(mode="json", by_alias=True) if grant else None,
            "conditions": conditions,
            "endpoint": projected.endpoint,
            "parked": projected.parked,
        }
        if generation is not None:
            new["observedGeneration"] = generation
        if all(_patched_same(old.get(k), v) for k, v in new.items()):
            return None
        return new

    async def write_projection(
        self, mind: Mapping[str, object], projected: Projection
    ) -> Mapping[str, object] | None:
        """Write the Mind's projection if it differs; the Mind as written, or None. A failure
        (but her being gone) raises: the writer has her engine decided again."""
        new = self._projection(mind, projected)
        if new is None:
            return None
        meta = object_at(mind, "metadata")
        patch = {"status": new}
        path = crd_path("minds", str(meta["namespace"]), str(meta["name"]), "status")
        try:
            answer = await self.api.merge_patch(path, patch)
        except ApiError as err:
            if err.status != 404:
                raise
            return None
        self.minds.observe_mind(answer, deleted=False, nudge=False)
        return answer

    async def add_finalizer(self, mind: Mapping[str, object]) -> None:
        finalizers = [*_finalizers(mind), FINALIZER]
        await self._patch_finalizers(mind, finalizers)

    async def drop_finalizer(self, mind: Mapping[str, object]) -> None:
        if FINALIZER not in _finalizers(mind):
            return
        finalizers = [f for f in _finalizers(mind) if f != FINALIZER]
        await self._patch_finalizers(mind, finalizers)

    async def _patch_finalizers(self, mind: Mapping[str, object], finalizers: list[str]) -> None:
        """Patch her finalizers, conditioned on her resourceVersion. A failure (but her being
        gone) raises: a 409 (she changed meanwhile) or another, her engine is decided again
        after a backoff, from her as the cache has her then."""
        meta = object_at(mind, "metadata")
        patch = {
            "metadata": {"finalizers": finalizers, "resourceVersion": meta.get("resourceVersion")}
        }
        path = crd_path("minds", str(meta["namespace"]), str(meta["name"]))
        try:
            answer = await self.api.merge_patch(path, patch)
        except ApiError as err:
            if err.status != 404:
                raise
            return
        if object_at(answer, "metadata").get("deletionTimestamp") and not finalizers:
            self.minds.observe_mind(answer, deleted=True, nudge=False)
        else:
            self.minds.observe_mind(answer, deleted=False, nudge=False)


def _finalizers(obj: Mapping[str, object]) -> list[str]:
    """The object's finalizers (`metadata.finalizers`; the strings among them)."""
    found = object_at(obj, "metadata").get("finalizers")
    return [f for f in found if isinstance(f, str)] if isinstance(found, list) else []
