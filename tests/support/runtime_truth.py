"""Engines as the runtime reports them (launches, receipts, a serving runtime), for the tests
of what the operator reads of `status.runtime`."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from continuum_operator.core.receipts import (
    BufferKind,
    Receipt,
    ReceiptBuffer,
    ReceiptPlacement,
)
from continuum_operator.kube.engines.engine_pass import Memory
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.state.cache import DeploymentEntry
from tests.support.reconcile import (
    NOW,
    SETTINGS,
    after,
    discrete,
    engine_obj,
    own_device_bytes,
    ready,
    snapshot,
)


def _receipt_for(
    p: dict[str, Any], model_sha: str, scale: float = 0.95, weights: float | None = None
) -> Receipt:
    """A receipt of the launch `p` plans, its buffers `scale` times the plan's bytes (its
    device weights `weights` times, if given)."""
    dev, host = p["bytes"]["device"], p["bytes"]["host"]
    w = scale if weights is None else weights
    buffers = [
        ReceiptBuffer(device="CUDA0", kind=BufferKind.MODEL, bytes=int(dev["weights"] * w)),
        ReceiptBuffer(device="CUDA0", kind=BufferKind.KV, bytes=int(dev["kv"] * scale)),
        ReceiptBuffer(device="CUDA0", kind=BufferKind.COMPUTE, bytes=int(dev["compute"] * scale)),
        ReceiptBuffer(device="CPU", kind=BufferKind.MODEL, bytes=int(host["weights"] * scale)),
        ReceiptBuffer(device="CPU", kind=BufferKind.COMPUTE, bytes=int(host["compute"] * scale)),
    ]
    return Receipt(
        model_sha256=model_sha,
        context_tokens=p["poolTokens"],
        kv_cache_type=p["kvCacheType"],
        placement=ReceiptPlacement(layers_on_device=p["layersOnDevice"], gpus=len(p["gpus"])),
        llama_build="7000 (abcdef0)",
        parallel=p["mindsGrantable"],
        buffers=buffers,
        source="test",
    )


SHA_NAMED = "ab" * 32


def _named_engine() -> dict[str, Any]:
    body = engine_obj()
    body["spec"]["model"]["sha256"] = SHA_NAMED
    return body


def _serving(device_gib: int = 80, used_gib: int = 0) -> tuple[dict[str, Any], Any, Any]:
    """The engine placed, its pod ready, its own bytes measured on the board: its body,
    memory and the snapshot it runs in."""
    snap = snapshot([discrete("a", device_gib, used_gib=used_gib)])
    w = reconcile(_named_engine(), snap, Memory(), NOW, SETTINGS)
    body = after(_named_engine(), w)
    own = own_device_bytes(body)
    snap = replace(
        snapshot([discrete("a", device_gib, used_gib=used_gib, own=own)]),
        deployments={("ns", "coder"): ready(w)},
    )
    w = reconcile(body, snap, w.memory, NOW + 1, SETTINGS)
    return after(body, w), w.memory, snap


def _launch(body: dict[str, Any], snap: Any) -> str:
    entry: DeploymentEntry = snap.deployments[("ns", "coder")]
    assert entry.launch is not None
    return entry.launch
