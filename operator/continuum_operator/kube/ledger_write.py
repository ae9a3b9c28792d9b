"""The grants loop's write of one Engine's ledger: a replace of its status subresource
conditioned on its resourceVersion (never a blind merge), carrying the ledger, the pool it was
made for and the step's journal in one write. On 409 the Engine is read again and the step
decided again from the caches as they are now. Once a write lands: the cache, the transition
log, the metrics and the log lines, all on the event loop (the API calls awaited there). Crash
points (`kube.crash`) sit before and after it.
Neighbours: `kube.minds` (the loop that steps and calls this), `kube.ledger` (decides, and the
journal), `kube.ledger_tails` (what the object leaves out), `kube.transition_log`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from continuum_operator.core.grants import GrantPolicy, MindDemand
from continuum_operator.kube import crash, ledger, ledger_journal
from continuum_operator.kube.api import ApiError, crd_path
from continuum_operator.kube.async_api import AsyncKubeApi
from continuum_operator.kube.cache import Cache, EngineKey
from continuum_operator.kube.grant_settings import GrantSettings
from continuum_operator.kube.ledger_tails import LedgerTails
from continuum_operator.kube.metrics import OperatorMetrics
from continuum_operator.kube.transition_log import TransitionLog
from continuum_operator.model.base import API_VERSION
from continuum_operator.model.mind import HOLDING_STATES, GrantState

__all__ = ["LedgerWriter"]

log = logging.getLogger("continuum.grants")


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
        body: dict[str, Any],
        s: ledger.LedgerStep,
        now: float,
        quota_left: Mapping[str, int] | None = None,
    ) -> dict[str, Any] | None:
        """Replace the Engine's status with the new ledger, conditioned on resourceVersion."""
        ns, name = key
        engine = f"{ns}/{name}"
        path = crd_path("engines", ns, name, "status")
        for _attempt in range(self.settings.conflict_retries):
            # The journal this write replaces is logged first: a step a dead leader wrote and
            # did not log reaches a new leader here when its cache had not yet seen that write
            # (the pass's recovery found nothing missing; the write was refused, 409, and the
            # Engine read back carries it).
            replaced = (body.get("status") or {}).get(ledger.STEP_FIELD)
            self._log().recover(engine, ledger_journal.read_journal(replaced))
            doc, seq, lines = _ledger_doc(key, body, s, now)
            crash.reached(crash.CrashPoint.BEFORE_LEDGER_WRITE)
            try:
                answer = await self.api.request("PUT", path, doc)
            except ApiError as err:
                if err.status == 404:
                    return None
                if err.status != 409:
                    log.warning("writing the ledger of Engine %s failed: %s", engine, err)
                    return None
                # Someone wrote the Engine meanwhile (the plan loop, the runtime): decide again.
                self.metrics.record_ledger_conflict()
                try:
                    body = await self.api.request("GET", crd_path("engines", ns, name))
                except ApiError as err2:
                    log.warning("re-reading Engine %s failed: %s", engine, err2)
                    return None
                self.engines.observe_engine(body, deleted=False, nudge=False)
                wanted = self._demands_of(key)
                tail = self.tails.tail_of(key, body, wanted)
                s = ledger.step(body, wanted, now, self.policy, quota_left, tail)
                if not s.changed:
                    self.tails.remember(key, body, s)
                    return body
                continue
            self._written(key, body, answer, s, seq, lines)
            return answer
        log.warning("Engine %s: the ledger kept changing under %d tries", engine, _attempt + 1)
        return None

    def _written(
        self,
        key: EngineKey,
        body: Mapping[str, Any],
        answer: dict[str, Any],
        s: ledger.LedgerStep,
        seq: int,
        lines: list[dict[str, Any]],
    ) -> None:
        """After the ledger write landed: the cache, the log, the metrics and the log lines."""
        ns, name = key
        engine = f"{ns}/{name}"
        crash.reached(crash.CrashPoint.AFTER_LEDGER_WRITE)
        before = {**self.tails.tail_of(key, body, {}), **ledger.read_grants(
            (body.get("status") or {}).get("grants"))}  # fmt: skip
        self.tails.remember(key, answer, s)
        self.engines.observe_engine(answer, deleted=False, nudge=False)
        self._log().append(engine, seq, lines)
        crash.reached(crash.CrashPoint.AFTER_LOG)
        states = [str(e.get("state")) for e in s.entries]
        self.metrics.record_grant_step(
            ns,
            name,
            s.transitions(),
            # The ledger this step started from: when a wait began, when a reclaim did.
            before,
            sum(1 for x in states if x in HOLDING_STATES),
            states.count(GrantState.QUEUED.value),
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
    key: EngineKey, body: Mapping[str, Any], s: ledger.LedgerStep, now: float
) -> tuple[dict[str, Any], int, list[dict[str, Any]]]:
    """The Engine as its status replace sends it (the ledger, the pool it was made for and the
    step's journal, in one write), the step's seq and its log lines."""
    ns, name = key
    engine = f"{ns}/{name}"
    status = dict(body.get("status") or {})
    seq = int((status.get(ledger.STEP_FIELD) or {}).get("seq") or 0) + 1
    lines = ledger.log_lines(now, engine, status.get(ledger.CAPACITY_FIELD), s)
    status["grants"] = s.kept
    status[ledger.CAPACITY_FIELD] = s.pool.to_status()
    kept = {str(e.get("mind")) for e in s.kept}
    status[ledger.STEP_FIELD] = ledger_journal.journal(seq, now, lines, kept)
    if s.queue is not None:
        status[ledger.QUEUE_FIELD] = s.queue
    else:
        status.pop(ledger.QUEUE_FIELD, None)
    doc = {
        "apiVersion": API_VERSION,
        "kind": "Engine",
        "metadata": {
            "name": name,
            "namespace": ns,
            "resourceVersion": body["metadata"]["resourceVersion"],
        },
        "spec": body.get("spec") or {},
        "status": status,
    }
    return doc, seq, lines
