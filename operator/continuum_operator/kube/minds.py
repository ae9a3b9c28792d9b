"""Minds reconciled through their engine's grant ledger: the leader's one writer of grants.

Watches feed `MindCache` (Minds, MindClasses and TokenQuotas; Engines come from the plan
loop's `kube.cache`). The
`GrantsLoop` runs only on the leader (`kube.leader`). On every change, on a timer for the next
grace deadline or protection window (`Allocation.review_at`), and every resync, it takes each
served Engine something changed for (below), in turn:

1. one allocation step (`kube.ledger.step`: pure) from the Engine's `status.grants`, the minds
   that want a grant, the gateway's slot releases (`status.runtime.slotReleases`) and the time;
2. if the ledger changed, a replace of the Engine's status subresource conditioned on its
   resourceVersion (never a blind merge): the ledger, the pool it was made for and the step's
   journal in one write; on 409 the Engine is read again and the step decided again
   (`kube.ledger_write`). The object keeps the holders and the head of a long queue
   (`ledger.bounded`); the rest is kept by `kube.ledger_tails` (for a new leader, read from the
   log or the Minds' status);
3. the step's lines appended to the transition log (`kube.transition_log`);
4. each Mind's `status.grant` and conditions, a projection of her entry, written if changed;
5. finalizers: a Mind of a served Engine carries `continuum.dev/grant` until her entry has left
   the ledger (a deleted mind's grant is reclaimed and released first, through the gateway);
6. each TokenQuota's status (tokens its namespace holds, minds it holds back), if changed.

Tenancy (docs/tenancy.md): a Mind goes to the Engine she names in her namespace or in
`spec.engineNamespace`; one whose class does not exist, or whose Engine does not serve her
namespace, wants no grant and is told why. A namespace's TokenQuota is what its minds may hold
over all engines: the tokens held are summed from every ledger at the start of a pass, and the
engines with queued minds of a quota'd namespace are stepped one after another, each with what
the others hold by then, so two engines granting at once cannot overshoot a quota.

A pass takes only the engines something changed for ("dirty"): the engine a Mind created,
changed or deleted names, and the one she named before (`MindCache` keeps Minds grouped by
engine); an Engine whose body is not the one last stepped (another writer, or it is gone: its
minds are told); one whose review time or grace deadline has come; one whose write failed.
Every engine at a leader's first pass (it also recovers every journal), when the MindClasses or
TokenQuotas change, and every `full_pass_seconds` (60 s), a safety net. What a pass reads of
every ledger (grace deadlines, tokens held under a quota) is kept per Engine body
(`kube.ledger_facts`). The transition log is synced once a pass (group commit).

Crash points (`kube.crash`) sit between these writes. Neighbours: `kube.ledger` (decides),
`kube.ledger_write` (the ledger's write), `kube.mind_writes` (the Minds' writes), `kube.api`
(the adapter), `kube.leader` (who may write).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

from continuum_operator.core.grants import MindDemand, PriorityPolicy
from continuum_operator.kube import ledger, ledger_journal, routing
from continuum_operator.kube.api import ApiError, KubeApi, crd_path
from continuum_operator.kube.cache import Cache, EngineKey
from continuum_operator.kube.grant_settings import GrantSettings
from continuum_operator.kube.ledger_facts import LedgerFacts, grace_deadline
from continuum_operator.kube.ledger_tails import LedgerTails
from continuum_operator.kube.ledger_write import LedgerWriter
from continuum_operator.kube.metrics import OperatorMetrics
from continuum_operator.kube.mind_cache import MindCache, resource_version
from continuum_operator.kube.mind_writer import FINALIZER_WRITE, PROJECTION_WRITE, MindWriter
from continuum_operator.kube.mind_writes import Job, MindWrites
from continuum_operator.kube.quota_use import ClassNotes, QuotaUse, quota_status
from continuum_operator.kube.transition_log import TransitionLog
from continuum_operator.model.base import GROUP, VERSION

__all__ = ["GrantsLoop"]

log = logging.getLogger("continuum.grants")


class GrantsLoop:
    def __init__(
        self,
        api: KubeApi,
        settings: GrantSettings,
        engines: Cache,
        minds: MindCache,
        *,
        may_write: Callable[[], bool] = lambda: True,
        metrics: OperatorMetrics | None = None,
        clock: Callable[[], float] = time.time,
        resync_seconds: float = 5.0,
        full_pass_seconds: float = 60.0,
        pod_port: int = 8080,
    ) -> None:
        self.api = api
        self.settings = settings
        self.engines = engines
        self.minds = minds
        self.may_write = may_write
        self.metrics = metrics or OperatorMetrics()
        self.clock = clock
        self.resync_seconds = resync_seconds
        self.full_pass_seconds = full_pass_seconds
        self.pod_port = pod_port
        self.policy = PriorityPolicy(grace_seconds=settings.grace_seconds)
        self.log = TransitionLog(settings.transition_log)
        self.review_at: dict[EngineKey, float] = {}
        self.retry_soon = False
        self.writer = MindWriter(settings.write_workers, lambda: self.may_write(), self._failed)
        # The loop reads the clock it has now (tests set it after construction).
        self.mind_writes = MindWrites(api, minds, settings, lambda: self.clock(), pod_port)
        # What the last pass stepped with: each engine's body (stepped again once its body is
        # another), the classes and quota limits (every engine stepped again when they change),
        # and when the next pass over every engine is due (0: the next pass).
        self.engine_seen: dict[EngineKey, Mapping[str, Any]] = {}
        self.rules_seen: tuple[Any, ...] | None = None
        self.full_at = 0.0
        self.facts: dict[EngineKey, LedgerFacts] = {}
        # Each engine's whole ledger as this leader last decided it (`ledger.bounded` leaves
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
        # (its first pass takes every engine: `full_at`).
        self.log = TransitionLog(self.settings.transition_log)
        self.full_at = 0.0
        self.engine_seen.clear()
        # Every Mind and MindClass listed before the first step: a leader that started a moment
        # ago may not have all of them from its watches yet, and a Mind missing from the cache
        # would be taken for a deleted one (her grant reclaimed).
        while not stop.is_set():
            try:
                await asyncio.to_thread(self.seed)
                break
            except ApiError as err:
                log.warning("listing Minds failed, retrying: %s", err)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 1.0)
        first = True
        while not stop.is_set():
            if not first:
                soon = self.retry_soon or self.mind_writes.retry_soon
                timeout = 0.5 if soon else self.resync_seconds
                self.retry_soon = self.mind_writes.retry_soon = False
                if self.review_at:
                    timeout = max(0.0, min(timeout, min(self.review_at.values()) - self.clock()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed(), timeout)
                await asyncio.sleep(0.05)  # events within this window are one pass
            first = False
            self.minds.changed.clear()
            self.engines.changed.clear()  # the Engines' loop wakes on its own queue
            try:
                await asyncio.to_thread(self.pass_once)
            except Exception:  # one bad pass must not stop the leader; the next retries
                log.exception("grants pass failed")
        # Stepping down: the lines written so far on disk before another leader appends.
        await asyncio.to_thread(self.log.sync)

    def seed(self) -> None:
        """List Minds and MindClasses into the cache (blocking); watch events go on after."""
        base = f"/apis/{GROUP}/{VERSION}"
        classes = self.api.request("GET", f"{base}/mindclasses")
        minds = self.api.request("GET", f"{base}/minds")
        for obj in classes.get("items") or []:  # (no nudge: this runs in a thread)
            self.minds.classes[str(obj["metadata"]["name"])] = copy.deepcopy(obj)
        try:
            quotas = self.api.request("GET", f"{base}/tokenquotas")
        except ApiError as err:
            if err.status != 404:  # 404: the TokenQuota CRD is not installed; no quotas
                raise
            quotas = {}
        for obj in quotas.get("items") or []:
            self.minds.observe_quota(obj, deleted=False, nudge=False)
        listed = set()
        for obj in minds.get("items") or []:
            self.minds.observe_mind(obj, deleted=False, nudge=False)
            listed.add(routing.mind_key(obj))
        # A Mind the cache has but the list has not was deleted before the list was taken.
        for key in set(self.minds.minds) - listed:
            known = self.minds.minds.get(key)
            if known is not None and resource_version(known) <= int(
                minds["metadata"]["resourceVersion"]
            ):
                self.minds.forget(key)

    async def _changed(self) -> None:
        waits = [
            asyncio.create_task(self.minds.changed.wait()),
            asyncio.create_task(self.engines.changed.wait()),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    # one pass (in a thread: API calls only, the caches are replaced, not mutated in place)

    def pass_once(self) -> None:
        try:
            self._pass()
        finally:
            # One fsync for all of the pass's lines (group commit, `kube.transition_log`).
            self.log.sync()

    def dirty_engines(
        self,
        engines: Mapping[EngineKey, dict[str, Any]],
        facts: Mapping[EngineKey, LedgerFacts],
        rules: tuple[Any, ...],
        wall: float,
    ) -> set[EngineKey]:
        """The engines this pass steps: those whose Minds
        changed (`MindCache.take_dirty`), whose body is not the one last stepped, whose review
        time or grace deadline has come, that are gone (their minds are told); every engine at
        the first pass of a leader, when the classes or quotas changed, and every
        `full_pass_seconds` (should anything have been missed, it is not missed for long)."""
        marked = self.minds.take_dirty()
        if wall >= self.full_at or rules != self.rules_seen:
            self.full_at = wall + self.full_pass_seconds
            self.rules_seen = rules
            return marked | set(engines) | self.minds.engine_keys() | set(self.engine_seen)
        dirty = marked
        dirty.update(k for k, b in engines.items() if self._body_changed(k, b))
        dirty.update(k for k in self.engine_seen if k not in engines)
        dirty.update(k for k, t in list(self.review_at.items()) if t <= wall)
        dirty.update(k for k, f in facts.items() if f.due is not None and f.due <= wall)
        return dirty

    def _body_changed(self, key: EngineKey, body: Mapping[str, Any]) -> bool:
        seen = self.engine_seen.get(key)
        if seen is body:
            return False
        # Another object: a watch event or the cache's copy of our own write; the same version
        # with the same content (the echo of our write) changes nothing the ledger reads.
        if seen is None or resource_version(seen) != resource_version(body) or seen != body:
            return True
        self.engine_seen[key] = body
        return False

    def _pass(self) -> None:
        classes, default = routing.classes_of(list(self.minds.classes.values()))
        limits = routing.quota_limits(list(self.minds.quotas.values()))
        engines = dict(self.engines.engines)
        facts = self.facts = LedgerFacts.of_each(self.facts, engines)
        wall = self.clock()
        dirty = self.dirty_engines(engines, facts, (classes, default, limits), wall)
        done: set[EngineKey] = set()
        try:
            self._step(dirty, done, engines, facts, classes, default, limits, wall)
        finally:
            # What this pass did not finish (a failed write, leadership lost), the next redoes.
            self.minds.mark(dirty - done)

    def _step(
        self,
        dirty: set[EngineKey],
        done: set[EngineKey],
        engines: Mapping[EngineKey, dict[str, Any]],
        facts: Mapping[EngineKey, LedgerFacts],
        classes: Mapping[str, routing.ClassFacts],
        default: str,
        limits: Mapping[str, routing.QuotaLimit],
        wall: float,
    ) -> None:
        groups = self.minds.minds_of(dirty)
        by_engine, refused = routing.route_minds(
            [m for key in sorted(groups) for m in groups[key]], engines, classes, default
        )
        mine = sorted(k for k in dirty if k in engines)
        self._recover_journals(mine, engines)

        wanted = {
            key: routing.demands_of(by_engine.get(key, []), classes, default, refused)
            for key in mine
        }

        def demands(key: EngineKey) -> dict[str, MindDemand]:
            return wanted[key]

        # Held over every engine's ledger, not only those stepped (from `facts`: read once per
        # body).
        quotas = QuotaUse(
            limits, {k: self.tails.entries_of(k, f.body, f.entries) for k, f in facts.items()}
        )

        def step(key: EngineKey, at: float | None = None) -> dict[str, Any] | None:
            written = self.step_engine(key, engines[key], demands(key), at, quotas.left(key))
            if written is not None:
                quotas.stepped(key, self.tails.entries_of(key, written))
            return written

        stepped: list[tuple[EngineKey, dict[str, Any]]] = []

        def record(key: EngineKey, written: dict[str, Any] | None) -> None:
            if written is not None:
                stepped.append((key, written))
                self.engine_seen[key] = written
                done.add(key)

        # Ledgers first. Engines with a grace deadline due, one after another, each stepped at
        # its deadline (the release is forced then); then those with minds of a namespace under
        # a TokenQuota, one after another, each with the tokens the others hold by then; the
        # rest side by side, all at one time, so the log's `t` stays in order whatever order
        # their writes end in.
        due = sorted((d, k) for k in mine if (d := facts[k].due) is not None and d <= wall)
        for _, key in due:
            if not self.may_write():
                return
            record(key, step(key))
        rest = sorted(set(mine) - {k for _, k in due})
        at = self.log.time(self.clock())
        bound = [k for k in rest if quotas.binds(demands(k))]
        for key in bound:
            if not self.may_write():
                return
            record(key, step(key, at))
        free = [k for k in rest if k not in set(bound)]
        with ThreadPoolExecutor(self.settings.write_workers) as pool:
            results = list(pool.map(lambda k: (k, step(k, at)), free))
        for key, written in results:
            record(key, written)
        if not self.may_write():
            return
        # ... then what follows from them, Minds' projections and finalizers, written side by
        # side: each is one Mind's own, and a projection is rewritten until it agrees.
        # Projections are queued before finalizers: a grant is seen as soon as the API allows.
        # Every Mind of a stepped engine, its ledger changed or not: one whose status is stale
        # (just created, queued behind others) is written too.
        jobs = self._mind_jobs(stepped, dirty, engines, done, by_engine, refused,
                               ClassNotes(classes, default, quotas), quotas)  # fmt: skip
        # Not waited for: the next pass's ledgers need not queue behind these writes.
        for priority, mkey, job in jobs:
            self.writer.submit(priority, mkey, job)

    def _recover_journals(
        self, keys: Iterable[EngineKey], engines: Mapping[EngineKey, dict[str, Any]]
    ) -> None:
        """Append the steps a dead leader wrote but did not log (each engine's journal)."""
        for key in keys:
            self.log.recover(
                f"{key[0]}/{key[1]}",
                ledger_journal.read_journal(
                    (engines[key].get("status") or {}).get(ledger.STEP_FIELD)
                ),
            )

    def _mind_jobs(
        self,
        stepped: list[tuple[EngineKey, dict[str, Any]]],
        dirty: set[EngineKey],
        engines: Mapping[EngineKey, dict[str, Any]],
        done: set[EngineKey],
        by_engine: Mapping[EngineKey, list[dict[str, Any]]],
        refused: Mapping[str, routing.Refused],
        notes: ClassNotes,
        quotas: QuotaUse,
    ) -> list[Job]:
        """What follows from a pass's ledgers: the Minds' projections and finalizers, and the
        TokenQuotas' status, as writes for the writer."""
        jobs: list[Job] = []
        for key, engine in stepped:
            jobs.extend(
                self.mind_writes.projection_jobs(
                    key,
                    engine,
                    self.tails.entries_of(key, engine),
                    by_engine.get(key, []),
                    refused,
                    notes,
                )
            )
        # Minds of Engines nobody serves (deleted, or never made): nothing holds their grant.
        # One that names an Engine that does not exist is told so; an Engine this operator
        # does not see may still exist (another operator's selector), so the API is asked.
        for key in sorted(dirty - set(engines)):
            minds = by_engine.get(key, [])
            jobs.extend(
                (FINALIZER_WRITE, routing.mind_key(m), partial(self.mind_writes.drop_finalizer, m))
                for m in minds
                if m["metadata"].get("deletionTimestamp")
            )
            jobs.extend(self.mind_writes.missing_engine_jobs(key, minds))
            self.engine_seen.pop(key, None)
            self.review_at.pop(key, None)
            self.tails.forget(key)
            done.add(key)
        for qkey, quota in sorted(self.minds.quotas.items()):
            new = quota_status(quota, quotas, self.clock())
            if new is not None:
                jobs.append(
                    (PROJECTION_WRITE, f"tokenquota:{qkey}", partial(self.write_quota, quota, new))
                )
        return jobs

    def _failed(self, key: str) -> None:
        """A Mind's write raised (in a writer thread): her engine is stepped again next pass."""
        if key.startswith("engine:"):
            ns, _, name = key.removeprefix("engine:").partition("/")
            self.minds.mark([(ns, name)])
        elif not key.startswith("tokenquota:"):  # a quota's status is written every pass
            self.minds.mark_mind(key)
        self.retry_soon = True

    def write_quota(self, quota: Mapping[str, Any], status: dict[str, Any]) -> None:
        meta = quota["metadata"]
        path = crd_path("tokenquotas", meta["namespace"], meta["name"], "status")
        try:
            answer = self.api.merge_patch(path, {"status": status})
        except ApiError as err:
            if err.status != 404:
                log.warning(
                    "writing TokenQuota %s's status failed: %s", routing.mind_key(quota), err
                )
            return
        self.minds.observe_quota(answer, deleted=False, nudge=False)

    def _due(self, body: Mapping[str, Any]) -> float | None:
        return grace_deadline((body.get("status") or {}).get("grants") or [])

    def step_engine(
        self,
        key: EngineKey,
        body: dict[str, Any],
        demands: Mapping[str, MindDemand],
        at: float | None = None,
        quota_left: Mapping[str, int] | None = None,
    ) -> dict[str, Any] | None:
        """Step one engine's ledger until nothing is due (or once, at `at`); the Engine as
        last written or read. `quota_left`: what each quota'd namespace may hold here."""
        for _ in range(self.settings.conflict_retries + 4):
            wall = self.clock()
            due = self._due(body)
            if at is not None:
                now = at
            else:
                now = self.log.time(due if due is not None and due <= wall else wall)
            tail = self.tails.tail_of(key, body, demands)
            s = ledger.step(body, demands, now, self.policy, quota_left, tail)
            if s.review_at is not None:
                self.review_at[key] = s.review_at
            else:
                self.review_at.pop(key, None)
            if not s.changed:
                self.tails.remember(key, body, s)
                return body
            if not self.may_write():
                return None
            answer = self.ledger_writer.write(key, body, s, now, quota_left)
            if answer is None:
                return None
            body = answer
            due = self._due(body)
            if at is not None or due is None or due > self.clock():
                return body
        return body

    def _demands_of(self, key: EngineKey) -> dict[str, MindDemand]:
        """The minds that want a grant of this Engine, from the caches as they are now (only
        hers: `MindCache` keeps them grouped by engine)."""
        classes, default = routing.classes_of(list(self.minds.classes.values()))
        by_engine, refused = routing.route_minds(
            self.minds.minds_of([key]).get(key, []),
            {key: e} if (e := self.engines.engines.get(key)) is not None else {},
            classes,
            default,
        )
        return routing.demands_of(by_engine.get(key, []), classes, default, refused)
