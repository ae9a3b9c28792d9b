"""The gateway's cut path: a new grant table acted on at once (`set_table`), her turn and
requests cut at a reclaim (`_cut`), her slot parked, erased and released by the deadline
(`_release`), a slot erased before its next holder's first request (`_ensure_clean`), and a
park she asks for (`park_now`). docs/gateway.md, "Reclaim" and "Parked contexts".
Neighbours: `engine.gateway_state` (what it holds), `engine.gateway_requests` (above it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
from aiohttp import web

from continuum_operator.core.grants import GrantReason
from continuum_operator.engine.admission import (
    Answer,
    Cut,
    GrantTable,
    Refusal,
    Release,
    reconcile,
    still_reported,
)
from continuum_operator.engine.gateway_state import (
    CUT_TURNS_KEPT,
    GatewayState,
    SlotRelease,
)
from continuum_operator.engine.park import PARKING, NotParked, Parked, Parking
from continuum_operator.engine.parking import Resumed
from continuum_operator.engine.upstream import UpstreamDown
from continuum_operator.model.mind import GrantState

__all__ = ["GatewayCuts"]

log = logging.getLogger(__name__)


class GatewayCuts(GatewayState):
    # --- the grant table ----------------------------------------------------------------------

    def set_table(self, table: GrantTable | None) -> None:
        """Take a new grant table and act on it at once: cut, erase, release. None: the table
        is withdrawn (its ledger deleted): every turn and request is refused until the next,
        and nothing is cut or released meanwhile (the next table decides)."""
        self.table = table
        if table is None:
            self._changed()
            return
        self._reconcile()
        if self.park is not None:
            self.park.forget(table)  # her Mind deleted or her grant refused: her park goes
        kept = still_reported(table, self.released)
        if kept != set(self.released):
            self.released = {k: v for k, v in self.released.items() if k in kept}
            self._changed()

    def _serving(self) -> dict[str, int]:
        serving = {t.mind: t.slot for t in self.turns.values()}
        for mind, flights in self.flights.items():
            for f in flights:
                serving.setdefault(mind, f.slot)
        return serving

    def _reconcile(self) -> None:
        if self.table is None:
            return
        done = set(self.released) | set(self._releasing)
        plan = reconcile(self.table, self._serving(), done)
        for cut in plan.cuts:
            self._cut(cut)
        for rel in plan.releases:
            self._releasing[rel.key] = asyncio.create_task(self._release(rel))

    def _cut(self, cut: Cut) -> None:
        turns = [t for t, turn in self.turns.items() if turn.mind == cut.mind]
        flights = [f for f in self.flights.get(cut.mind, ()) if not f.cut.is_set()]
        if not turns and not flights:
            return  # already cut; her requests are on their way out
        for tid in turns:
            del self.turns[tid]
            self._cut_turns[tid] = (cut.mind, cut.reason, cut.by)
            while len(self._cut_turns) > CUT_TURNS_KEPT:
                del self._cut_turns[next(iter(self._cut_turns))]
        for f in flights:
            f.end(cut.reason, cut.by)
        self.metrics.turn_cut(cut.reason)
        log.info("cut the turn of %s (%s)", cut.mind, cut.reason)

    async def _release(self, rel: Release) -> None:
        deadline = (
            rel.deadline
            if rel.deadline is not None
            else (self.clock() + self.settings.grace_seconds)
        )
        try:
            # Her requests were cut; each lands as soon as the gateway has let go of it. Her
            # context is saved where the save can finish before the deadline (the park store's
            # rule), behind the release: the save and the erase hold the slot's lock, so they
            # delay the slot's next holder's first request, if it comes that soon, not the
            # reclaim.
            parked: Parked | NotParked | Parking = NotParked.NO_TIME
            erased: int | None = None
            try:
                async with asyncio.timeout(max(0.0, deadline - self.clock())):
                    async with self._flights_done:
                        await self._flights_done.wait_for(lambda: not self.flights.get(rel.mind))
                    if self._still_reclaiming(rel):
                        parked = await self._park_behind(rel, deadline)
                    if parked is not PARKING:
                        erased = await self._erase_while_reclaiming(rel)
            except TimeoutError:
                # llama-server did not save or erase by the deadline (stalled, restarting): the
                # release is recorded on time all the same, parked or not as the save went; the
                # slot stays marked as holding her context, so it is erased before its next
                # holder's first request.
                log.warning(
                    "slot %d of %s not erased by its deadline; released now, erased before its "
                    "next holder's first request",
                    rel.slot,
                    rel.mind,
                )
            if not self._still_reclaiming(rel):
                return  # the operator moved on (forced at the deadline): nothing to report
            record = SlotRelease(rel.mind, rel.slot, rel.reason, rel.since, self.clock(), erased)
            record = record.as_parked(parked, erased)
            self.released[rel.key] = record
            self.metrics.slot_released(rel.reason)
            log.info("released slot %d of %s (%s)", rel.slot, rel.mind, rel.reason)
            self._changed()
        finally:
            self._releasing.pop(rel.key, None)

    async def _park_behind(self, rel: Release, deadline: float) -> NotParked | Parking:
        """Start saving her slot to the park store, then erasing it, behind the release, where
        the save can finish before the reclaim's deadline: PARKING, the slot's lock taken for
        them; else why not (the slot is erased as without a store)."""
        if self.park is None:
            return NotParked.NO_STORE
        if self.slot_owner.get(rel.slot) != rel.mind:
            return NotParked.EMPTY  # erased already, or another's: nothing of hers to save
        why = self.park.verdict(self.slot_tokens.get(rel.slot, 0), deadline)
        if why is not None:
            return why
        lock = self._slot_locks.setdefault(rel.slot, asyncio.Lock())
        await lock.acquire()
        task = asyncio.create_task(self._save_then_erase(rel, deadline, lock))
        self._parking.add(task)
        task.add_done_callback(self._parking.discard)
        return PARKING

    async def _save_then_erase(self, rel: Release, deadline: float, lock: asyncio.Lock) -> None:
        """Her slot saved, then erased, the slot's `lock` held (taken for this by the release):
        by the deadline at the latest, when the lock is let go, her slot still marked hers
        if not erased (so erased before its next holder's first request)."""
        parked: Parked | NotParked = NotParked.NO_TIME
        erased: int | None = None
        try:
            async with asyncio.timeout(max(0.0, deadline - self.clock())):
                parked = await self._save(rel.mind, rel.slot, deadline)
                erased = await self._erase_held(rel.slot)
        except (TimeoutError, UpstreamDown) as err:
            log.warning("slot %d of %s: park, erase unfinished: %r", rel.slot, rel.mind, err)
        finally:
            lock.release()
        record = self.released.get(rel.key)
        if record is not None:  # still reported: said as it went
            self.released[rel.key] = record.as_parked(parked, erased)
            self._changed()

    async def _save(self, mind: str, slot: int, deadline: float) -> Parked | NotParked:
        """Her slot saved to the park store (the slot's lock held)."""
        assert self.park is not None
        try:
            return await self.park.park(mind, slot, self.slot_tokens.get(slot, 0), deadline)
        except UpstreamDown as err:
            log.warning("slot %d of %s not parked: %s", slot, mind, err)
            return NotParked.SAVE_FAILED

    async def _erase_while_reclaiming(self, rel: Release) -> int | None:
        """Erase her slot, again while llama-server is down; None if the reclaim moved on."""
        while self._still_reclaiming(rel):
            try:
                return await self._erase(rel.slot)
            except UpstreamDown as err:
                log.info("erase of slot %d failed (%s); trying again", rel.slot, err)
                await asyncio.sleep(self.settings.erase_retry_seconds)
        return None

    def _still_reclaiming(self, rel: Release) -> bool:
        e = self.table.entry(rel.mind) if self.table is not None else None
        return (
            e is not None
            and e.state is GrantState.RECLAIMING
            and e.slot == rel.slot
            and e.since == rel.since
        )

    def releases(self) -> list[SlotRelease]:
        return sorted(self.released.values(), key=lambda r: (r.at, r.mind))

    # --- llama-server -------------------------------------------------------------------------

    def engine_restarted(self) -> None:
        """llama-server started afresh: every slot is empty and every turn on it is over."""
        self.slot_owner.clear()
        self.slot_count = None
        for mind in list(self._serving()):
            self._cut(Cut(mind, GrantReason.ENGINE_RELAUNCHING.value))

    async def _erase(self, slot: int) -> int:
        """Erase a slot's cache; the tokens it held. Serialised per slot."""
        async with self._slot_locks.setdefault(slot, asyncio.Lock()):
            return await self._erase_held(slot)

    async def _erase_held(self, slot: int) -> int:
        """`_erase`, the slot's lock already held."""
        try:
            async with self.session.post(
                f"{self.settings.upstream}/slots/{slot}?action=erase"
            ) as resp:
                payload = await resp.json(content_type=None)
                if resp.status != 200:
                    raise UpstreamDown(f"erase answered {resp.status}: {payload}")
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            raise UpstreamDown(str(err)) from err
        self.slot_owner.pop(slot, None)
        self.slot_tokens.pop(slot, None)
        return int(payload.get("n_erased", 0)) if isinstance(payload, dict) else 0

    async def park_now(self, request: web.Request) -> web.Response:
        """`POST /v1/park`: she goes idle; her context is saved to the park store and her
        slot erased, and her next request restores it (docs/gateway.md, "Parked contexts")."""
        mind, refused = await self._who(request)
        if refused is not None:
            return self._answer(refused)
        adm = self._admit_turn(mind, None)
        if adm.answer is not Answer.ADMIT:
            return self._answer(adm)
        assert adm.slot is not None
        if self.park is None:
            message = "this engine parks nothing (its Engine has no spec.park): keep your slot"
            return self._refuse(Refusal.BAD_REQUEST, 400, {"message": message})
        if self.flights.get(mind):
            message = "requests of yours are in flight: park once they are answered"
            return self._refuse(Refusal.BAD_REQUEST, 409, {"message": message})
        deadline = self.clock() + self.settings.grace_seconds
        # Held through the save and the erase: a request of hers waits, then restores.
        async with self._slot_locks.setdefault(adm.slot, asyncio.Lock()):
            if self.slot_owner.get(adm.slot) != mind:
                return web.json_response({"parked": False, "reason": NotParked.EMPTY.value})
            parked = await self._save(mind, adm.slot, deadline)
            if isinstance(parked, NotParked):
                return web.json_response({"parked": False, "reason": parked.value})
            with contextlib.suppress(UpstreamDown):  # still hers: restored on another slot only
                await self._erase_held(adm.slot)
        self.park.went_idle(mind)  # her slot goes to whoever waits, until she asks again
        return web.json_response({"parked": True, "tokens": parked.tokens, "slot": adm.slot})

    async def _ensure_clean(self, slot: int, mind: str) -> Resumed | None:
        """Erase a slot that may still hold another mind's context, then mark it hers; where
        it does not hold hers and she has a parked context, restore it into the slot first
        (her first request of a new grant): what was restored."""
        # All under the slot's lock: a second request of hers waits for the first one's
        # restore, rather than finding the slot marked hers and running without it.
        async with self._slot_locks.setdefault(slot, asyncio.Lock()):
            owner = self.slot_owner.get(slot)
            if owner is not None and owner != mind:
                await self._erase_held(slot)
            self.slot_owner[slot] = mind  # from here the slot may hold hers
            if owner == mind or self.park is None or not self.park.waiting(mind):
                return None
            resumed = await self.park.resume(mind, slot)
        if resumed is not None:
            self.slot_tokens[slot] = resumed.tokens
        return resumed
