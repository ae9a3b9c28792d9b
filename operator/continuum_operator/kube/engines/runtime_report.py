"""What the operator reads of an Engine's `status.runtime` (the engine runtime's report).

The runtime (`continuum engine`) is that field's one writer; the operator only reads it:
- receipts, for the next plan (`core.plan` looks one up per placement it weighs): those of the
  runtime, and the one the plan in force already used (`status.plan.receipt`), so a plan learned
  from a receipt keeps it while llama-server restarts and reports none. Receipts are evidence,
  not commands: the runtime's count only when its report is of the launch in force, and only
  those filed under that launch's own arguments (what its load could have measured: context,
  minds, layers, GPUs, KV type of `status.plan`); `core.plan` then plans from none beyond the
  bound of its estimate (`core.receipt_bounds`);
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
from dataclasses import dataclass

from pydantic import ValidationError

from continuum_operator.core import conditions as cond
from continuum_operator.core.receipts import Receipt
from continuum_operator.model.json_body import at, items_at, object_at, text
from continuum_operator.model.plan_status import PlanStatus

__all__ = ["Evidence", "current_runtime", "receipts_of", "runtime_report"]

_REFUSING = {
    "ModelMismatch": cond.Reason.MODEL_DIGEST_MISMATCH,
    "Stopped": cond.Reason.ENGINE_STOPPED,
}


@dataclass(frozen=True, slots=True)
class Evidence:
    """The receipts a plan may use, and why any others found were set aside."""

    receipts: tuple[Receipt, ...] = ()
    set_aside: tuple[str, ...] = ()


def receipts_of(
    status: Mapping[str, object],
    plan: PlanStatus | None,
    model_sha256: str | None,
    launch: str | None,
) -> Evidence:
    """Receipts of the Engine's own model (none where its digest is not named) that the launch
    in force (`launch`, its hash, of `plan`, the plan in force) measured: the runtime's, when
    its report names that launch, then the plan's. A receipt that does not validate is skipped;
    one of another launch's arguments is set aside, saying so. Without a plan in force, none:
    nothing was launched."""
    if model_sha256 is None or plan is None:
        return Evidence()
    found: list[Receipt] = []
    for item in items_at(current_runtime(status, launch), "receipts")[:_MOST_RECEIPTS]:
        try:
            found.append(Receipt.model_validate(item))
        except ValidationError:
            continue
    if plan.receipt is not None:
        found.append(plan.receipt)
    out: list[Receipt] = []
    aside: list[str] = []
    for receipt in found:
        if receipt.model_sha256 != model_sha256 or receipt in out:
            continue
        why = _not_of_launch(receipt, plan)
        if why:
            aside.append(why)
        else:
            out.append(receipt)
    return Evidence(tuple(out), tuple(aside))


#: The most receipts read from one report: a launch measures one load (llama-server restarts
#: in the same pod load the same arguments again).
_MOST_RECEIPTS = 8


def _not_of_launch(r: Receipt, plan: PlanStatus) -> str:
    """Why receipt `r` is not of the launch of `plan` (the plan in force), or ''."""
    minds, per_mind, layers = (
        plan.minds_grantable,
        plan.context_tokens_per_mind,
        plan.layers_on_device,
    )
    gpus = len(plan.gpus) if layers > 0 else 0
    launched = (minds, minds * per_mind, layers, gpus, str(plan.kv_cache_type))
    filed = (
        r.parallel,
        r.context_tokens,
        r.placement.layers_on_device,
        r.placement.gpus,
        str(r.kv_cache_type),
    )
    if filed == launched:
        return ""
    return (
        f"a receipt of {r.parallel} minds, {r.context_tokens} tokens, "
        f"{r.placement.layers_on_device} layers on {r.placement.gpus} GPU(s), "
        f"{r.kv_cache_type} KV is not of the launch in force ({minds} minds, "
        f"{minds * per_mind} tokens, {layers} layers on {gpus} GPU(s), "
        f"{plan.kv_cache_type} KV): the engine's pod reports only what its own launch "
        "measured, so it is not planned from"
    )


def current_runtime(
    status: Mapping[str, object], launch: str | None
) -> Mapping[str, object] | None:
    """`status.runtime` when it is the report of `launch`; None otherwise."""
    runtime = object_at(status, "runtime")
    if launch is None or runtime.get("launch") != launch:
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
    runtime: Mapping[str, object] | None, now: float, window_seconds: float
) -> cond.RuntimeReport:
    """What the conditions say of the current launch's runtime."""
    if runtime is None:
        return cond.RuntimeReport()
    phase = text(runtime, "phase")
    message = text(runtime, "message") or ""
    if phase in _REFUSING:
        return cond.RuntimeReport(refused=cond.Problem(_REFUSING[phase], message or phase))
    last = at(runtime, "lastExit")
    if not isinstance(last, Mapping):
        return cond.RuntimeReport()
    exited = _epoch(last.get("at"))
    if exited is None or now - exited > window_seconds:
        return cond.RuntimeReport()
    restarts = runtime.get("restarts")
    line = str(last.get("line") or "")
    said = (
        f"llama-server restarted {restarts} time(s) in this pod; it last exited with code "
        f"{last.get('code')} at {last.get('at')}" + (f": {line}" if line else "")
    )
    return cond.RuntimeReport(restarted=said[:1000])
