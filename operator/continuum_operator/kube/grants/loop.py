"""Minds reconciled through their engine's grant ledger: the leader's one writer of grants, a
reconciler on the controller kernel (`kube.base.kernel`) whose keys are engines.

Watches feed `MindCache` (Minds, MindClasses and TokenQuotas; Engines come from the plan loop's
`kube.state.cache`). The `GrantsLoop` runs only on the leader (`kube.process.leader`): a new leader
first lists every Mind, MindClass and TokenQuota (`mind_cache.seed`) and every GrantLedger
(`ledger_write.seed_ledgers`), then the kernel runs it. For
each engine a pass takes, in turn:

1. one allocation step (`kube.ledger.grant_ledger.step`: pure) from the Engine's GrantLedger, the
minds
   that want a grant, the gateway's slot releases (`status.runtime.slotReleases`) and the time,
   decided from the caches as they are now (`decide`, no API calls);
2. if the ledger changed, a replace of the GrantLedger's status subresource conditioned on its
   resourceVersion (never a blind merge): the ledger, the pool it was made for and the step's
   journal in one write; on 409 the ledger is read again and the step decided again
   (`kube.grants.ledger_write`). The object keeps the holders and the head of a long queue
   (`grant_ledger.bounded`); the rest is kept by `kube.grants.ledger_tails` (for a new leader, read
   from the log or the Minds' status);
3. the step's lines appended to the transition log (`kube.ledger.transition_log`);
4. each Mind's `status.grant` and conditions, a projection of her entry, written if changed;
5. finalizers: a Mind of a served Engine carries `continuum.dev/grant` until her entry has left
   the ledger (a deleted mind's grant is reclaimed and released first, through the gateway).
The Minds' writes (4, 5) go to `kube.grants.write_queue` (asyncio tasks, not waited for by the
pass); after the pass, each TokenQuota's status (tokens its namespace holds, minds it holds back) is
written there too, if changed, and the log is synced once (group commit).

Tenancy (docs/tenancy.md): a Mind goes to the Engine she names in her namespace or in
`spec.engineNamespace`; one whose class does not exist, or whose Engine does not serve her
namespace, wants no grant and is told why. A namespace's TokenQuota is what its minds may hold
over all engines: the tokens held are summed from every ledger at the start of a pass, and each
decision is assumed at once (`QuotaUse.assume`: a grant counts before its write lands, a
release only after), so the next engine decided sees it: two engines granting at once cannot
overshoot a quota.

A pass takes only the engines marked ("dirty"): the engine a Mind created, changed or deleted
names, and the one she named before (`MindCache` marks them); an Engine whose body is not the
one last stepped (another writer, or it is gone: its minds are told); one whose review time or
grace deadline has come (`before_pass`); one whose write failed, after its backoff (the kernel;
a Mind's failed write takes her engine again too). Every engine at a leader's first pass (it
also recovers every journal), when the MindClasses or TokenQuotas change, and every
`loop.full_resync_seconds` (60 s: the kernel's resync), a safety net. In a pass, the engines whose
grace deadline is due go first, each stepped at its deadline (the release is forced then) and
written one after another; then the engines with minds of a namespace under a TokenQuota; then
the rest, all stepped at one time after the due ones' writes, so the log's `t` stays in order.

Crash points (`kube.base.crash`) sit between these writes. Neighbours: `kube.ledger.grant_ledger`
(decides), `kube.grants.ledger_write` (the ledger's write), `kube.grants.mind_writes` (the Minds'
writes), `kube.client.async_api` (the adapter), `kube.process.leader` (who may write).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from continuum_operator.core.grants import MindDemand, PriorityPolicy
from continuum_operator.kube.base import kernel
from continuum_operator.kube.base.grant_settings import GrantSettings
from continuum_operator.kube.base.kernel import KernelSettings, WorkQueue
from continuum_operator.kube.base.metrics import OperatorMetrics
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.client.kept import resource_version
from continuum_operator.kube.grants.ledger_facts import LedgerFacts, grace_deadline
from continuum_operator.kube.grants.ledger_tails import LedgerTails
from continuum_operator.kube.grants.ledger_write import LedgerWriter, seed_ledgers
from continuum_operator.kube.grants.mind_writes import MindWrites
from continuum_operator.kube.grants.pass_inputs import (
    GrantWrites,
    PassView,
    engine_of_write,
    recover_journals,
)
from continuum_operator.kube.grants.quota_use import ClassNotes, QuotaUse, quota_status
from continuum_operator.kube.grants.write_queue import PROJECTION_WRITE, MindWriter
from continuum_operator.kube.ledger import cached, grant_ledger, routing
from continuum_operator.kube.ledger.transition_log import TransitionLog
from continuum_operator.kube.state.cache import Cache, EngineKey
from continuum_operator.kube.state.mind_cache import MindCache, seed
from continuum_operator.model.grant import GrantEntry
from continuum_operator.model.json_body import object_at

__all__ = ["GrantsLoop"]

log = logging.getLogger("continuum.grants")


class GrantsLoop:
    def __init__(
        self,
        api: AsyncKubeApi,
        settings: GrantSettings,
        engines: Cache,
        minds: MindCache,
        *,
        may_write: Callable[[], bool] = lambda: True,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.time,
        kernel: KernelSettings | None = None,
        pod_port: int = 8080,
    ) -> None:
        self.api = api
        self.settings = settings
        self.engines = engines
        self.minds = minds
        self.may_write = may_write
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        self.policy = PriorityPolicy(grace_seconds=settings.grace_seconds)
        self.log = TransitionLog(settings.transition_log)
        self.review_at: dict[EngineKey, float] = {}
        # The Minds' watches mark this queue; the Engines' wake it (`before_pass` compares). Not
        # reset here: a new loop's first pass takes every engine by itself (nothing seen yet),
        # and a leader's first pass is a resync (`kernel.run`).
        self.queue: WorkQueue[EngineKey] = minds.queue
        # Its kernel settings, from the one settings object (`OperatorSettings.kernels`).
        self.kernel = kernel or OperatorSettings(grants=settings).kernels.grants
        self.writer = MindWriter(settings.write_workers, lambda: self.may_write(), self._failed)
        # The loop reads the clock it has now (tests set it after construction).
        self.mind_writes = MindWrites(
            api,
            minds,
            settings,
            lambda: self.clock(),
            pod_port,
            ledgers=engines.ledgers,
            holders=engines.holders,
        )
        # What the last pass stepped with: each engine's body (stepped again once its body is
        # another), and the classes and quota limits (every engine when they change).
        self.engine_seen: dict[EngineKey, Mapping[str, Any]] = {}
        self.rules_seen: tuple[Any, ...] | None = None
        self.facts: dict[EngineKey, LedgerFacts] = {}
        self.view: PassView | None = None
        self._wake: asyncio.TimerHandle | None = None  # the next review or deadline
        self._running = False  # under `kernel.run` (not one pass of a test)
        self._syncs: set[asyncio.Task[None]] = set()  # the log's fsyncs in flight
        # Each engine's whole ledger as this leader last decided it (`grant_ledger.bounded` leaves
        # some out of the object); the loop's log as it is now (`run` opens it again).
        self.tails = LedgerTails(lambda: self.log, minds)
        self.ledger_writer = LedgerWriter(
            api,
            engines,
            settings,
            self.policy,
            self.tails,
            self.metrics,
            lambda: self.log,
            self._demands_of,
        )

    async def run(self, stop: asyncio.Event) -> None:
        # A new leader: the log as the last one left it, and any step it wrote but did not log
        # (its first pass takes every engine).
        self.log = TransitionLog(self.settings.transition_log)
        self.engine_seen.clear()
        self.rules_seen = None
        # Every Mind and MindClass listed before the first step: a leader that started a moment
        # ago may not have all of them from its watches yet, and a Mind missing from the cache
        # would be taken for a deleted one (her grant reclaimed); every GrantLedger likewise.
        while not stop.is_set():
            try:
                await seed(self.api, self.minds)
                await seed_ledgers(self.api, self.engines)
                break
            except (ApiError, OSError) as err:
                log.warning("listing Minds and GrantLedgers failed, retrying: %s", err)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
        self._running = True
        try:
            await kernel.run(
                self, self.queue, self.kernel, stop, may_write=self.may_write, clock=self.clock
            )
        finally:
            self._running = False
            if self._wake is not None:
                self._wake.cancel()
            self.writer.drop()  # stepping down: the writes not started are the next leader's
        await self.writer.drained()
        # The lines written so far on disk before another leader appends.
        await self._synced()
        await asyncio.to_thread(self.log.sync)

    async def drain(self) -> int:
        """One pass of the kernel, then every Mind write it queued (tests, the bench)."""
        n = await kernel.drain(
            self, self.queue, self.kernel, may_write=self.may_write, clock=self.clock
        )
        await self.writer.drained()
        await self._synced()
        return n

    async def _synced(self) -> None:
        if self._syncs:
            await asyncio.gather(*list(self._syncs), return_exceptions=True)

    def pass_once(self) -> int:
        """`drain` in an event loop of its own (a caller outside one: tests, the bench)."""
        return asyncio.run(self.drain())

    # -- the kernel's hooks ----------------------------------------------------------------

    def keys(self) -> set[EngineKey]:
        """Every engine with a ledger, minds, or a ledger last stepped (gone: minds told)."""
        return set(self.engines.engines) | self.minds.engine_keys() | set(self.engine_seen)

    def before_pass(self, queue: WorkQueue[EngineKey], now: float) -> None:
        """What the pass reads once; and the engines marked by the clock or by comparison:
        whose body is not the one last stepped, gone, whose review time or grace deadline has
        come; every engine when the classes or quotas changed."""
        classes, default = routing.classes_of(list(self.minds.classes.values()))
        limits = routing.quota_limits(list(self.minds.quotas.values()))
        engines = dict(self.engines.engines)
        facts = self.facts = LedgerFacts.of_each(self.facts, engines)
        rules = (classes, default, limits)
        if rules != self.rules_seen:
            self.rules_seen = rules
            queue.mark_all()
        marked = [k for k, b in engines.items() if self._body_changed(k, b)]
        marked += [k for k in self.engine_seen if k not in engines]
        marked += [k for k, t in self.review_at.items() if t <= now]
        marked += [k for k, f in facts.items() if f.due is not None and f.due <= now]
        queue.mark(*marked, wake=False)
        # Held over every engine's ledger, not only those stepped (from `facts`: read once per
        # body); and, where a quota reads them, over the GrantLedgers of Engines another
        # operator serves (`--engine-selector`): a namespace's quota spans them all. Only
        # where a TokenQuota reads them: nothing else does.
        counted = bool(limits) or bool(self.minds.quotas)
        held = (
            {k: self.tails.entries_of(k, f.body, f.entries) for k, f in facts.items()}
            if counted
            else {}
        )
        if limits:
            held = {**cached.others_entries(self.engines.ledgers, engines), **held}
        quotas = QuotaUse(limits, held, quotas=counted)
        self.view = PassView(classes, default, limits, facts, quotas, self.log.time(self.clock()))
        self.view.due_done.set()

    def _body_changed(self, key: EngineKey, body: Mapping[str, object]) -> bool:
        seen = self.engine_seen.get(key)
        if seen is body:
            return False
        # Another object: a watch event or the cache's copy of our own write; the same version
        # with the same content (the echo of our write) changes nothing the ledger reads.
        if seen is None or resource_version(seen) != resource_version(body) or seen != body:
            return True
        self.engine_seen[key] = body
        return False

    def order(self, keys: list[EngineKey]) -> list[EngineKey]:
        """Engines whose grace deadline is due first (by deadline), then those with minds of a
        namespace under a TokenQuota, then the rest. The journals of those still served are
        recovered first, before the pass appends anything to the log."""
        view = self._view()
        engines = self.engines.engines
        recover_journals(self.log, sorted(k for k in keys if k in engines), engines)
        due = sorted(
            (d, k)
            for k in keys
            if (f := view.facts.get(k)) is not None and (d := f.due) is not None and d <= view.at
        )
        first = [k for _, k in due]
        rest = sorted(set(keys) - set(first))
        bound = [k for k in rest if self._binds(k, view)]
        return [*first, *bound, *(k for k in rest if k not in set(bound))]

    def _binds(self, key: EngineKey, view: PassView) -> bool:
        if not view.limits:
            return False
        minds = self.minds.minds_of([key]).get(key, [])
        return any(m["metadata"]["namespace"] in view.limits for m in minds)

    def decide(self, key: EngineKey, now: float) -> GrantWrites | None:
        """The engine's step from the caches as they are now; a changed ledger is assumed in
        the pass's quota use at once, for the engines decided after it."""
        view = self._view()
        body = self.engines.engines.get(key)
        minds = self.minds.minds_of([key]).get(key, [])
        if body is None:  # gone: its minds are told, nothing holds their grant
            self.engine_seen.pop(key, None)
            self.review_at.pop(key, None)
            self.tails.forget(key)
            return GrantWrites(None, None, now, False, minds, {}) if minds else None
        routed, refused, demands = _wanted(key, body, minds, view.classes, view.default)
        # The entries as the pass read them (`LedgerFacts`, while the body is the same object),
        # for the whole step: each read validates every entry, and four a step were a fifth of
        # a full pass.
        facts = view.facts.get(key)
        if facts is None or facts.body is not body:
            facts = LedgerFacts.of(body)
        stored, due = facts.entries, facts.due
        # Due by the pass's time (`view.at`, when the rest are stepped), so its `t` comes first.
        is_due = due is not None and due <= view.at and not view.rest_started
        view.rest_started |= not is_due
        at = self.log.time(due) if is_due and due is not None else view.at
        left = view.quotas.left(key)
        s = self._step(key, body, demands, at, left, stored)
        if not s.changed:
            view.quotas.stepped(key, self.tails.entries_of(key, body, stored))
            return GrantWrites(body, None, at, False, routed, refused)
        view.quotas.assume(key, s.entries)
        if is_due:
            view.due_left += 1
            view.due_done.clear()
        return GrantWrites(body, s, at, is_due, routed, refused)

    async def write(self, key: EngineKey, writes: GrantWrites) -> None:
        """The ledger (raising if it was not written: the kernel takes the engine again after
        a backoff), then its Minds' writes, queued to the writer."""
        body = writes.body
        if body is None:
            self._tell_gone(key, writes.minds)
            return
        if writes.step is not None:
            answer = await (
                self._write_due(key, writes) if writes.due else self._write(key, writes)
            )
            if answer is None:  # not leading any more
                return
            body = answer
        self.engine_seen[key] = body
        view = self._view()
        notes = ClassNotes(view.classes, view.default, view.quotas)
        entries = self.tails.entries_of(key, body)
        jobs = self.mind_writes.projection_jobs(
            key, body, entries, writes.minds, writes.refused, notes
        )
        # Projections are queued before finalizers: a grant is seen as soon as the API allows.
        for priority, mkey, job in jobs:
            self.writer.submit(priority, mkey, job)

    def after_pass(self, now: float) -> None:
        """Each TokenQuota's status, if changed; the engines a landed release may now let
        grant; a wake-up for the next review time or deadline; one fsync for the pass's lines
        (group commit, `kube.ledger.transition_log`)."""
        view = self._view()
        for qkey, quota in sorted(self.minds.quotas.items()):
            new = quota_status(quota, view.quotas, self.clock())
            if new is not None:
                write = partial(self.mind_writes.write_quota, quota, new)
                self.writer.submit(PROJECTION_WRITE, f"tokenquota:{qkey}", write)
        if view.quotas.freed:
            self.queue.mark(*view.quotas.held_back(view.quotas.freed))
        self._wake_for_deadlines()
        # In a thread, so its fsync does not hold up the event loop; the next pass's appends
        # may go on meanwhile (the log's lock), to be synced by that pass.
        sync = asyncio.get_running_loop().create_task(asyncio.to_thread(self.log.sync))
        self._syncs.add(sync)
        sync.add_done_callback(self._syncs.discard)

    # -- the steps and writes of one engine ------------------------------------------------

    def _view(self) -> PassView:
        assert self.view is not None, "before_pass runs first"
        return self.view

    def _step(
        self,
        key: EngineKey,
        body: Mapping[str, object],
        demands: Mapping[str, MindDemand],
        now: float,
        quota_left: Mapping[str, int] | None,
        stored: list[GrantEntry] | None = None,
    ) -> grant_ledger.LedgerStep:
        """One allocation step (pure); its review time kept; an unchanged ledger remembered.
        `stored`: the body's entries, where the caller read them."""
        if stored is None:
            stored = grant_ledger.read_entries(object_at(body, "status").get("grants"))
        tail = self.tails.tail_of(key, body, demands, stored)
        s = grant_ledger.step(body, demands, now, self.policy, quota_left, tail, stored)
        if s.review_at is not None:
            self.review_at[key] = s.review_at
        else:
            self.review_at.pop(key, None)
        if not s.changed:
            self.tails.remember(key, body, s)
        return s

    async def _write(self, key: EngineKey, writes: GrantWrites) -> Mapping[str, object] | None:
        """An engine not due: once the due engines' writes of the pass have landed (their `t`
        is earlier), its ledger."""
        await self._view().due_done.wait()
        assert writes.body is not None and writes.step is not None
        return await self._write_ledger(key, writes.body, writes.step, writes.now)

    async def _write_due(self, key: EngineKey, writes: GrantWrites) -> Mapping[str, object] | None:
        """A due engine: its ledger, written one after another in the order decided; stepped
        again at each further deadline that came by then (its release forced at that time)."""
        view = self._view()
        try:
            async with view.due_lock:
                assert writes.body is not None and writes.step is not None
                body, s, now = writes.body, writes.step, writes.now
                for _ in range(self.settings.conflict_retries + 4):
                    answer = await self._write_ledger(key, body, s, now)
                    due = self._due(answer) if answer is not None else None
                    if answer is None or due is None or due > self.clock():
                        return answer
                    body, now = answer, self.log.time(due)
                    # The room left now: engines decided since have assumed their grants.
                    left = view.quotas.left(key)
                    s = self._step(key, body, self._demands_of(key), now, left)
                    if not s.changed:
                        return answer
                    view.quotas.assume(key, s.entries)
                return body
        finally:
            view.due_left -= 1
            if view.due_left == 0:
                view.due_done.set()

    async def _write_ledger(
        self,
        key: EngineKey,
        body: Mapping[str, object],
        s: grant_ledger.LedgerStep,
        now: float,
    ) -> Mapping[str, object] | None:
        """The ledger's write; the Engine as written (None: this replica no longer leads)."""
        if not self.may_write():
            return None
        quotas = self._view().quotas
        answer = await self.ledger_writer.write(key, body, s, now, quotas)
        if answer is None:
            raise RuntimeError(f"the ledger of Engine {key[0]}/{key[1]} was not written")
        quotas.stepped(key, self.tails.entries_of(key, answer))
        return answer

    def _tell_gone(self, key: EngineKey, minds: Sequence[Mapping[str, object]]) -> None:
        """Minds of an Engine this operator does not have (deleted, never made, or another
        operator's): `MindWrites.missing_engine_jobs` tells which (from its GrantLedger, else
        the API server) before it tells them or releases a deleted one."""
        for priority, mkey, job in self.mind_writes.missing_engine_jobs(key, minds):
            self.writer.submit(priority, mkey, job)

    def _failed(self, key: str) -> None:
        """A Mind's (or a TokenQuota's) write raised: her engine is taken again after its
        backoff; a quota's status is written again at a pass after a while."""
        engine = engine_of_write(key, self.minds)
        if engine is not None:
            self.queue.failed(engine, self.clock(), self.kernel)
            self.queue.wake()  # the kernel waits for its retry from now on
        elif self._running:
            loop = asyncio.get_running_loop()
            loop.call_later(self.kernel.retry_seconds, self.queue.wake)

    def _wake_for_deadlines(self) -> None:
        """A pass at the next review time or grace deadline (under `kernel.run`)."""
        if not self._running:
            return
        self.facts = LedgerFacts.of_each(self.facts, self.engines.engines)
        times = [
            *self.review_at.values(),
            *(f.due for f in self.facts.values() if f.due is not None),
        ]
        if self._wake is not None:
            self._wake.cancel()
            self._wake = None
        if times:
            delay = max(0.0, min(times) - self.clock())
            self._wake = asyncio.get_running_loop().call_later(delay, self.queue.wake)

    def _due(self, body: Mapping[str, object]) -> float | None:
        return grace_deadline(grant_ledger.read_entries(object_at(body, "status").get("grants")))

    def _demands_of(self, key: EngineKey) -> dict[str, MindDemand]:
        """The minds that want a grant of this Engine, from the caches as they are now (only
        hers: `MindCache` keeps them grouped by engine)."""
        classes, default = routing.classes_of(list(self.minds.classes.values()))
        minds = self.minds.minds_of([key]).get(key, [])
        return _wanted(key, self.engines.engines.get(key), minds, classes, default)[2]


def _wanted(
    key: EngineKey,
    body: Mapping[str, object] | None,
    minds: Sequence[Mapping[str, object]],
    classes: Mapping[str, routing.ClassFacts],
    default: str,
) -> tuple[list[Mapping[str, object]], Mapping[str, routing.Refused], dict[str, MindDemand]]:
    """The minds naming this Engine that go to it, those refused and why, and what each that
    goes wants of its ledger."""
    by_engine, refused = routing.route_minds(
        minds, {key: body} if body is not None else {}, classes, default
    )
    routed = by_engine.get(key, [])
    return routed, refused, routing.demands_of(routed, classes, default, refused)
