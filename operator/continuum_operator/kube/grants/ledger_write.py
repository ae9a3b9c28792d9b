"""The grants loop's write of one Engine's ledger: a replace of its GrantLedger's status
(`model.grant_ledger`) conditioned on the resourceVersion its step was decided from (never a
blind merge), carrying the ledger, the pool it was made for and the step's journal in one write.
The GrantLedger is created on an Engine's first step, owned by the Engine. On 409 the ledger
is read again and the step decided again from the caches as they are now. Once a write lands:
the cache, the transition log, the metrics and the log lines, all on the event loop (the API
calls awaited there). Crash points (`kube.base.crash`) sit before and after it.
Neighbours: `kube.grants.loop` (the loop that steps and calls this), `kube.ledger.grant_ledger`
(decides, and the journal), `kube.ledger.cached` (the ledger inside the cached Engine body),
`kube.grants.ledger_tails` (what the object leaves out), `kube.ledger.transition_log`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from continuum_operator.core.grants import GrantPolicy, MindDemand
from continuum_operator.kube.base import crash
from continuum_operator.kube.base.grant_settings import GrantSettings
from continuum_operator.kube.base.metrics import OperatorMetrics
from continuum_operator.kube.client.api import ApiError, crd_path
from continuum_operator.kube.client.async_api import AsyncKubeApi, relist
from continuum_operator.kube.grants.ledger_tails import LedgerTails
from continuum_operator.kube.grants.quota_use import QuotaUse
from continuum_operator.kube.ledger import cached, grant_ledger, journal
from continuum_operator.kube.ledger.transition_log import TransitionLog
from continuum_operator.kube.state.cache import Cache, EngineKey
from continuum_operator.model.base import API_VERSION
from continuum_operator.model.grant import wire_entries
from continuum_operator.model.json_body import integer, object_at, text
from continuum_operator.model.mind import HOLDING_STATES, GrantState

__all__ = ["LedgerWriter", "seed_ledgers"]

log = logging.getLogger("continuum.grants")
#: What a 404 on the GrantLedgers' collection means, and what to do.
MISSING_CRD = (
    "the API server has no GrantLedger kind (grantledgers.continuum.dev): apply this release's "
    "CRDs (`kubectl apply --server-side -f crds/`, or `helm upgrade` the chart) and the "
    "grants loop goes on"
)


class LedgerWriter:
    """Writes the ledgers the loop decides. `log`: the loop's transition log as it is now (a
    new leader opens it again); `demands_of`: the minds that want a grant of an Engine, from the
    caches as they are now (a step decided again after a 409 reads them)."""

    def __init__(
        self,
        api: AsyncKubeApi,
        engines: Cache,
        settings: GrantSettings,
        policy: GrantPolicy,
        tails: LedgerTails,
        metrics: OperatorMetrics,
        log: Callable[[], TransitionLog],
        demands_of: Callable[[EngineKey], dict[str, MindDemand]],
    ) -> None:
        self.api = api
        self.engines = engines
        self.settings = settings
        self.policy = policy
        self.tails = tails
        self.metrics = metrics
        self._log = log
        self._demands_of = demands_of

    async def write(
        self,
        key: EngineKey,
        body: Mapping[str, object],
        s: grant_ledger.LedgerStep,
        now: float,
        quotas: QuotaUse | None = None,
    ) -> Mapping[str, object] | None:
        """Replace the GrantLedger's status with the new ledger, conditioned on the version the
        step was decided from; the Engine's body with it (None: not written). Decided again
        after a conflict within the room `quotas` leaves now (engines decided since the first
        decision have assumed their grants), and that decision assumed in it."""
        ns, name = key
        engine = f"{ns}/{name}"
        path = crd_path(cached.PLURAL, ns, name, "status")
        for _attempt in range(self.settings.conflict_retries):
            # The journal this write replaces is logged first: a step a dead leader wrote and
            # did not log reaches a new leader here when its cache had not yet seen that write
            # (the pass's recovery found nothing missing; the write was refused, 409, and the
            # ledger read back carries it).
            replaced = object_at(body, "status").get(grant_ledger.STEP_FIELD)
            self._log().recover(engine, journal.read_journal(replaced))
            crash.reached(crash.CrashPoint.BEFORE_LEDGER_WRITE)
            version = cached.version_of(body)
            try:
                uid = cached.uid_of(body)
                if version is None:
                    version, uid = await self._create(body)
                doc, seq, lines = _ledger_doc(key, body, s, now, uid, version)
                answer = await self.api.request("PUT", path, doc)
            except ApiError as err:
                if err.status == 404 and version is None:
                    log.error("Engine %s: %s", engine, MISSING_CRD)
                    return None
                if err.status == 404:
                    return None  # the ledger is gone (deleted with its Engine): nothing to write
                if err.status != 409:
                    log.warning("writing the ledger of Engine %s failed: %s", engine, err)
                    return None
                # Another leader wrote the ledger meanwhile, or it exists and this cache has not
                # seen it yet (a create over it is refused too): decide again from it.
                self.metrics.record_ledger_conflict()
                fresh = await self._read_again(key)
                if fresh is None:
                    return None
                body = fresh
                wanted = self._demands_of(key)
                tail = self.tails.tail_of(key, body, wanted)
                left = quotas.left(key) if quotas is not None else None
                s = grant_ledger.step(body, wanted, now, self.policy, left, tail)
                if not s.changed:
                    self.tails.remember(key, body, s)
                    return body
                if quotas is not None:
                    quotas.assume(key, s.entries)
                continue
            self.engines.observe_ledger(answer, deleted=False, nudge=False)
            written = cached.merged(self.engines.engines.get(key) or body, answer)
            self._written(key, body, written, s, seq, lines)
            return written
        log.warning("Engine %s: the ledger kept changing under %d tries", engine, _attempt + 1)
        return None

    async def _create(self, body: Mapping[str, object]) -> tuple[str, str | None]:
        """The Engine's GrantLedger, made empty and owned by it: its resourceVersion and uid.
        409 if it exists (this cache has not seen it, or it is an earlier Engine's:
        `_read_again`)."""
        ns = str(object_at(body, "metadata")["namespace"])
        made = await self.api.request("POST", crd_path(cached.PLURAL, ns), cached.new_ledger(body))
        self.engines.observe_ledger(made, deleted=False, nudge=False)
        meta = object_at(made, "metadata")
        return str(meta["resourceVersion"]), text(meta.get("uid"))

    async def _read_again(self, key: EngineKey) -> Mapping[str, object] | None:
        """After a 409: the GrantLedger read into the cache, and the Engine's body with it. A
        ledger an earlier Engine of this name left (another owner) is deleted, on its uid, so
        the next try makes this one's. None: the Engine is gone, or the read failed."""
        ns, name = key
        try:
            fresh = await self.api.request("GET", crd_path(cached.PLURAL, ns, name))
        except ApiError as err:
            if err.status != 404:
                log.warning("re-reading the ledger of Engine %s/%s failed: %s", ns, name, err)
                return None
            fresh = None
        engine = self.engines.engines.get(key)
        if engine is None:
            return None
        if fresh is not None and not cached.owned_by(fresh, engine):
            uid = object_at(fresh, "metadata").get("uid")
            log.info("Engine %s/%s: replacing the GrantLedger of an earlier Engine", ns, name)
            try:
                await self.api.request(
                    "DELETE",
                    crd_path(cached.PLURAL, ns, name),
                    {"preconditions": {"uid": uid}},
                )
            except ApiError as err:
                if err.status not in (404, 409):
                    log.warning("deleting a stale ledger of %s/%s failed: %s", ns, name, err)
                    return None
            self.engines.observe_ledger(fresh, deleted=True, nudge=False)
        elif fresh is not None:
            self.engines.observe_ledger(fresh, deleted=False, nudge=False)
        return self.engines.engines.get(key)

    def _written(
        self,
        key: EngineKey,
        body: Mapping[str, object],
        answer: Mapping[str, object],
        s: grant_ledger.LedgerStep,
        seq: int,
        lines: list[dict[str, object]],
    ) -> None:
        """After the ledger write landed: the cache, the log, the metrics and the log lines."""
        ns, name = key
        engine = f"{ns}/{name}"
        crash.reached(crash.CrashPoint.AFTER_LEDGER_WRITE)
        stored = grant_ledger.read_entries(object_at(body, "status").get("grants"))
        before = {**self.tails.tail_of(key, body, {}, stored), **grant_ledger.read_grants(stored)}
        self.tails.remember(key, answer, s)
        self._log().append(engine, seq, lines)
        crash.reached(crash.CrashPoint.AFTER_LOG)
        states = [e.state for e in s.entries]
        self.metrics.record_grant_step(
            ns,
            name,
            s.transitions(),
            # The ledger this step started from: when a wait began, when a reclaim did.
            before,
            sum(1 for x in states if x in HOLDING_STATES),
            states.count(GrantState.QUEUED),
        )
        for tr in s.transitions():
            log.info(
                "Engine %s: %s %s -> %s (%s)%s",
                engine,
                tr.mind,
                tr.from_state.value if tr.from_state else "-",
                tr.to_state.value,
                tr.reason.value,
                f" slot {tr.slot}" if tr.slot is not None else "",
            )


def _ledger_doc(
    key: EngineKey,
    body: Mapping[str, object],
    s: grant_ledger.LedgerStep,
    now: float,
    uid: str | None,
    version: str,
) -> tuple[dict[str, object], int, list[dict[str, object]]]:
    """The GrantLedger as its status replace sends it (the ledger, the pool it was made for and
    the step's journal, in one write, conditioned on `version`), the step's seq and its log
    lines. The lines name the GrantLedger (`uid`): an Engine made again under
    its name starts a ledger of its own, whose `seq` counts from 1 again."""
    ns, name = key
    engine = f"{ns}/{name}"
    status = {k: v for k, v in object_at(body, "status").items() if k in grant_ledger.LEDGER_FIELDS}
    seq = (integer(status, grant_ledger.STEP_FIELD, "seq") or 0) + 1
    recorded = status.get(grant_ledger.CAPACITY_FIELD)
    lines = grant_ledger.log_lines(
        now, engine, object_at(recorded) if recorded is not None else None, s
    )
    if uid is not None:
        lines = [{**line, "ledger": uid} for line in lines]
    status["grants"] = wire_entries(s.kept)
    status[grant_ledger.CAPACITY_FIELD] = s.pool.to_status()
    kept = {e.mind for e in s.kept}
    status[grant_ledger.STEP_FIELD] = journal.journal(seq, now, lines, kept)
    if s.queue is not None:
        status[grant_ledger.QUEUE_FIELD] = grant_ledger.queue_doc(s.queue)
    else:
        status.pop(grant_ledger.QUEUE_FIELD, None)
    doc: dict[str, object] = {
        "apiVersion": API_VERSION,
        "kind": cached.KIND,
        "metadata": {"name": name, "namespace": ns, "resourceVersion": version},
        "status": status,
    }
    return doc, seq, lines


async def seed_ledgers(api: AsyncKubeApi, engines: Cache) -> None:
    """List every GrantLedger into the cache (a new leader, before its first step; the watch
    goes on after), a page at a time. Without it an Engine whose ledger the watch had not
    delivered yet would be stepped from an empty ledger: its write would be refused (the
    create of an existing ledger is a 409) and decided again, but at a cost per Engine."""
    try:
        await relist(
            api,
            f"/apis/{API_VERSION}/{cached.PLURAL}",
            lambda obj: engines.observe_ledger(obj, deleted=False, nudge=False),
            lambda obj: (
                str(object_at(obj, "metadata")["namespace"]),
                str(object_at(obj, "metadata")["name"]),
            ),
            engines.ledgers,
            lambda key: engines.observe_ledger(engines.ledgers[key], deleted=True, nudge=False),
        )
    except ApiError as err:
        if err.status == 404:  # the collection itself: its CRD is not installed
            raise ApiError(404, "NotFound", MISSING_CRD) from err
        raise
