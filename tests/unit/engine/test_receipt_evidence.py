"""Receipts are evidence, not commands (docs/receipts.md, "Bounded by the estimate"): a receipt
beyond the bound of the estimate of its own placement is not planned from and the plan says so
(`core.receipt_bounds`); the engine pod's receipts (`status.runtime.receipts`, which that pod,
and whoever can exec into it, may write) count only for what its own launch measured, and the
Engine's `ReceiptRefused` condition says why any were not planned from."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import yaml

from continuum_operator.core.plan import ReasonCode, plan
from continuum_operator.core.pools import BoardLeases
from continuum_operator.core.receipt_bounds import SLACK_BYTES, out_of_bounds
from continuum_operator.core.receipts import BufferKind, Receipt, ReceiptBuffer, ReceiptPlacement
from continuum_operator.kube.engines import runtime_report
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.model.plan_status import PlanStatus
from tests.support.builders import ROOT, board, engine
from tests.support.reconcile import NOW, SETTINGS, after, conditions
from tests.support.runtime_truth import SHA_NAMED, _launch, _receipt_for, _serving


def _plan(body: dict[str, Any]) -> PlanStatus:
    """The plan in force of an Engine's body."""
    return PlanStatus.model_validate(body["status"]["plan"])


H200 = ROOT / "tests" / "fixtures" / "h200"


def forged(p: dict[str, Any], minds: int | None = None, nbytes: int = 1) -> Receipt:
    """A receipt of the plan `p`'s placement (at `minds` minds, its own if None) whose every
    buffer is `nbytes`: what a pod writing its own status.runtime may claim."""
    m = minds if minds is not None else p["mindsGrantable"]
    kinds = (BufferKind.MODEL, BufferKind.KV, BufferKind.COMPUTE)
    return Receipt(
        model_sha256=SHA_NAMED,
        context_tokens=m * p["contextTokensPerMind"],
        kv_cache_type=p["kvCacheType"],
        placement=ReceiptPlacement(layers_on_device=p["layersOnDevice"], gpus=len(p["gpus"])),
        llama_build="7000 (abcdef0)",
        parallel=m,
        buffers=[ReceiptBuffer(device="CUDA0", kind=k, bytes=nbytes) for k in kinds],
        source="forged",
    )


def dump(*receipts: Receipt) -> list[dict[str, Any]]:
    return [r.model_dump(mode="json", by_alias=True) for r in receipts]


# --- the core: a receipt beyond the bound of the estimate ------------------------------------


def test_forged_receipts_of_one_byte_buffers_are_not_planned_from() -> None:
    # 24 GiB with 14 used by another: the estimate fits 2 minds of the 4 asked. Receipts of
    # 1-byte buffers for every number of minds would plan 4 and charge the device nothing.
    body, _, snap = _serving(24, used_gib=14)
    planned = body["status"]["plan"]
    assert planned["mindsGrantable"] == 2
    spec = engine(body).spec
    assert spec.model.facts is not None
    b = snap.boards["a"].board
    estimate = plan(b, spec, spec.model.facts, BoardLeases(b))
    lies = [forged(planned, m) for m in range(1, spec.minds.max + 1)]
    got = plan(b, spec, spec.model.facts, BoardLeases(b), receipts=lies)
    assert (got.minds_grantable, got.device, got.host) == (
        estimate.minds_grantable,
        estimate.device,
        estimate.host,
    )
    assert got.receipt is None and got.to_dict()["source"] == "estimate"
    refused = [r.message for r in got.reasons if r.code is ReasonCode.RECEIPT_REFUSED]
    assert len(refused) == len(lies)
    assert "its device weights is 0.0 MiB where the estimate is" in refused[0]
    assert "beyond the bound (0.9x to 1.1x the estimate, 64 MiB either way)" in refused[0]
    assert "the estimate stands" in refused[0]


def test_a_receipt_moving_the_weights_from_the_device_to_the_host_is_not_planned_from() -> None:
    body, _, snap = _serving()
    planned = body["status"]["plan"]
    honest = _receipt_for(planned, SHA_NAMED, scale=1.0)
    moved = honest.model_copy(
        update={
            "buffers": [
                b.model_copy(update={"device": "CPU"}) if b.kind is BufferKind.MODEL else b
                for b in honest.buffers
            ]
        }
    )
    spec = engine(body).spec
    assert spec.model.facts is not None
    b = snap.boards["a"].board
    assert plan(b, spec, spec.model.facts, receipts=[honest]).receipt == honest
    p = plan(b, spec, spec.model.facts, receipts=[moved])
    assert p.receipt is None
    assert any("its device weights" in r.message for r in p.reasons)


@pytest.mark.parametrize(
    "run", sorted(p.name[len("engine-") : -len(".yaml")] for p in H200.glob("engine-*.yaml"))
)
def test_every_receipt_measured_on_a_real_gpu_is_within_the_bound(run: str) -> None:
    # Eight loads on an H200 (docs/receipts.md): the bound refuses none of what llama.cpp did.
    e = engine(yaml.safe_load((H200 / f"engine-{run}.yaml").read_text()))
    receipt = Receipt.model_validate(yaml.safe_load((H200 / f"receipt-{run}.yaml").read_text()))
    b = board(yaml.safe_load((H200 / "board.yaml").read_text()))
    assert e.spec.model.facts is not None
    p = plan(b, e.spec, e.spec.model.facts, receipts=[receipt])
    assert p.receipt == receipt, [r.message for r in p.reasons]


def test_the_bound_holds_each_part_on_each_side() -> None:
    gib = 1 << 30
    estimate = {"device": {"weights": 10 * gib, "kv": 4 * gib, "compute": gib}, "host": {}}
    same = {"device": dict(estimate["device"]), "host": {}}
    assert out_of_bounds(same, estimate) is None
    for part, low in (("weights", 0.88), ("kv", 0.7), ("compute", 0.1)):
        under = {"device": {**estimate["device"], part: int(estimate["device"][part] * low)}}
        assert f"its device {part} is" in (out_of_bounds(under, estimate) or ""), part
    over = {"device": {**estimate["device"], "kv": 17 * gib}}
    assert "its device kv" in (out_of_bounds(over, estimate) or "")
    # A few MiB against none: within the slack (llama.cpp's graph where nothing is offloaded).
    assert out_of_bounds({"device": {"compute": SLACK_BYTES}}, {}) is None
    assert out_of_bounds({"device": {"compute": SLACK_BYTES + 1}}, {}) is not None


# --- the shell: the pod's receipts count for its own launch only -------------------------------


def with_runtime(body: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(body))
    out["status"]["runtime"] = runtime
    return out


def test_a_running_engine_is_not_re_planned_from_its_pods_forged_receipt() -> None:
    body, mem, snap = _serving(24, used_gib=14)
    planned = body["status"]["plan"]
    runtime = {"receipts": dump(forged(planned)), "launch": _launch(body, snap),
               "llamaBuild": "7000 (abcdef0)", "phase": "Serving"}  # fmt: skip
    for i in range(5):  # Lease renewals: the damper's readings
        s = replace(snap, leases={"a": replace(snap.leases["a"], resource_version=f"r{i}")})
        w = reconcile(with_runtime(body, runtime), s, mem, NOW + 10 + i, SETTINGS)
        body, mem = after(with_runtime(body, runtime), w), w.memory
        assert [e.reason for e in w.events if e.reason in ("Recharged", "Relaunching")] == []
    assert body["status"]["plan"] == planned
    assert body["status"]["placement"]["pools"] == [
        {"pool": c["pool"], "bytes": c["bytes"]} for c in planned["charges"]
    ]
    status, reason = conditions(body)["ReceiptRefused"]
    assert (status, reason) == ("True", "ReceiptNotPlannedFrom")
    message = next(c for c in body["status"]["conditions"] if c["type"] == "ReceiptRefused")
    assert "(forged) not planned from: its device weights is 0.0 MiB" in message["message"]


def test_a_receipt_of_other_arguments_than_the_launch_in_force_is_set_aside() -> None:
    # A receipt of 8 minds (and their context) where the launch in force runs 2: its pod never
    # loaded that, so it cannot have measured it, whatever its bytes say.
    body, mem, snap = _serving(24, used_gib=14)
    planned = body["status"]["plan"]
    eight = _receipt_for(planned, SHA_NAMED, scale=1.0).model_copy(
        update={"parallel": 8, "context_tokens": 8 * planned["contextTokensPerMind"]}
    )
    runtime = {"receipts": dump(eight), "launch": _launch(body, snap)}
    evidence = runtime_report.receipts_of(
        with_runtime(body, runtime)["status"], _plan(body), SHA_NAMED, _launch(body, snap)
    )
    assert evidence.receipts == ()
    assert "is not of the launch in force (2 minds" in evidence.set_aside[0]
    w = reconcile(with_runtime(body, runtime), snap, mem, NOW + 2, SETTINGS)
    out = after(with_runtime(body, runtime), w)
    assert out["status"]["plan"] == planned
    assert conditions(out)["ReceiptRefused"] == ("True", "ReceiptNotPlannedFrom")


def test_a_report_of_another_launch_gives_no_receipt_and_an_honest_one_is_used() -> None:
    body, _, snap = _serving()
    planned = body["status"]["plan"]
    honest = _receipt_for(planned, SHA_NAMED)
    status = with_runtime(body, {"receipts": dump(honest), "launch": "an-older-pod"})["status"]
    in_force = _plan(body)
    assert (
        runtime_report.receipts_of(status, in_force, SHA_NAMED, _launch(body, snap)).receipts == ()
    )
    status = with_runtime(body, {"receipts": dump(honest), "launch": _launch(body, snap)})["status"]
    evidence = runtime_report.receipts_of(status, in_force, SHA_NAMED, _launch(body, snap))
    assert (evidence.receipts, evidence.set_aside) == ((honest,), ())
