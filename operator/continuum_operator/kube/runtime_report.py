"""What the operator reads of an Engine's `status.runtime` (the engine runtime's report).

The runtime (`continuum engine`) is that field's one writer; the operator only reads it:
- receipts, for the next plan (`core.plan` looks one up per placement it weighs): those of the
  runtime, and the one the plan in force already used (`status.plan.receipt`), so a plan learned
  from a receipt keeps it while llama-server restarts and reports none;
- whether the current launch refuses to serve (a model digest mismatch, restarts exhausted) or
  restarted lately, for the Ready and Degraded conditions;
- its restart count, for the relaunch metric.

A report is of the current launch only when it names that launch (`launch`, from the pod's
annotation through the downward API): a previous pod's report says nothing of this one.
Plain values in, plain values out; no API calls.
"""

from __future__ import annotations

import calendar
import time
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from continuum_operator.core import conditions as cond
from continuum_operator.core.receipts import Receipt

__all__ = ["current_runtime", "receipts_of", "runtime_report"]

_REFUSING = {
    "ModelMismatch": cond.Reason.MODEL_DIGEST_MISMATCH,
    "Stopped": cond.Reason.ENGINE_STOPPED,
}


def receipts_of(status: Mapping[str, Any], model_sha256: str | None) -> tuple[Receipt, ...]:
    """Receipts of the Engine's own model (none where its digest is not named): the runtime's,
    then the plan's. A receipt that does not validate is skipped, never planned from."""
    if model_sha256 is None:
        return ()
    runtime = status.get("runtime") or {}
    plan = status.get("plan") or {}
    raw: list[Any] = []
    if isinstance(runtime, Mapping) and isinstance(runtime.get("receipts"), list):
        raw.extend(runtime["receipts"])
    if isinstance(plan, Mapping) and isinstance(plan.get("receipt"), Mapping):
        raw.append(plan["receipt"])
    out: list[Receipt] = []
    for item in raw:
        try:
            receipt = Receipt.model_validate(item)
        except ValidationError:
            continue
        if receipt.model_sha256 == model_sha256 and receipt not in out:
            out.append(receipt)
    return tuple(out)


def current_runtime(status: Mapping[str, Any], launch: str | None) -> Mapping[str, Any] | None:
    """`status.runtime` when it is the report of `launch`; None otherwise."""
    runtime = status.get("runtime")
    if not isinstance(runtime, Mapping) or launch is None or runtime.get("launch") != launch:
        return None
    return runtime


def _epoch(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return float(calendar.timegm(time.strptime(text, "%Y-%m-%dT%H:%M:%SZ")))
    except ValueError:
        return None


def runtime_report(
    runtime: Mapping[str, Any] | None, now: float, window_seconds: float
) -> cond.RuntimeReport:
    """What the conditions say of the current launch's runtime."""
    if runtime is None:
        return cond.RuntimeReport()
    phase = runtime.get("phase")
    message = str(runtime.get("message") or "")
    if phase in _REFUSING:
        return cond.RuntimeReport(refused=cond.Problem(_REFUSING[phase], message or str(phase)))
    last = runtime.get("lastExit")
    if not isinstance(last, Mapping):
        return cond.RuntimeReport()
    at = _epoch(last.get("at"))
    if at is None or now - at > window_seconds:
        return cond.RuntimeReport()
    restarts = runtime.get("restarts")
    line = str(last.get("line") or "")
    said = (
        f"llama-server restarted {restarts} time(s) in this pod; it last exited with code "
        f"{last.get('code')} at {last.get('at')}" + (f": {line}" if line else "")
    )
    return cond.RuntimeReport(restarted=said[:1000])
