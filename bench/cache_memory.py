"""Memory the operator's caches hold for many Minds and Engines, kept (`kube.kept`) or whole.

    python bench/cache_memory.py [--minds 10000] [--engines 2000]

Objects as the API server sends them after `kubectl apply` and a few operator writes: each with
the last-applied annotation (the applied manifest again) and managed fields of three managers
(kubectl's client-side apply, the operator's finalizer, the status writer), shaped as a 1.36 API
server writes them. The watches' caches (`MindCache` for Minds, `Cache` for Engines) are filled
once keeping every field (a deep copy, as before) and once as they keep them now, measured with
tracemalloc side by side in this run. Prints MiB held and the ratio; a figure, not a gate.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from continuum_operator.kube import cache as engine_cache  # noqa: E402
from continuum_operator.kube import mind_cache  # noqa: E402
from continuum_operator.kube.kept import LAST_APPLIED  # noqa: E402

MiB = 2**20
TIME = "2026-12-04T10:00:00Z"


def fields(*paths: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in paths:
        node = out
        for part in path.split("."):
            node = node.setdefault(f"f:{part}", {})
    return out


def managed(spec_paths: list[str], status_paths: list[str]) -> list[dict[str, Any]]:
    def entry(manager: str, op: str, fv: dict[str, Any], sub: str | None = None) -> dict[str, Any]:
        e = {"apiVersion": "continuum.dev/v1alpha1", "fieldsType": "FieldsV1", "fieldsV1": fv,
             "manager": manager, "operation": op, "time": TIME}  # fmt: skip
        if sub:
            e["subresource"] = sub
        return e

    return [
        entry("kubectl-client-side-apply", "Update",
              fields("metadata.annotations..", f"metadata.annotations.{LAST_APPLIED}",
                     *(f"spec.{p}" for p in spec_paths))),
        entry("continuum-operator", "Update", fields("metadata.finalizers..")),
        entry("continuum-operator", "Update", fields(*(f"status.{p}" for p in status_paths)),
              "status"),
    ]  # fmt: skip


def obj(
    kind: str, ns: str, name: str, spec: dict[str, Any], status: dict[str, Any]
) -> dict[str, Any]:
    manifest = {"apiVersion": "continuum.dev/v1alpha1", "kind": kind,
                "metadata": {"name": name, "namespace": ns}, "spec": spec}  # fmt: skip
    return {
        **manifest,
        "metadata": {
            "name": name, "namespace": ns, "uid": f"{name}-0000-4000-8000-000000000000",
            "resourceVersion": "123456", "generation": 1, "creationTimestamp": TIME,
            "finalizers": ["continuum.dev/grant"],
            "annotations": {LAST_APPLIED: json.dumps(manifest, separators=(",", ":")) + "\n"},
            "managedFields": managed(list(spec), list(status)),
        },
        "status": status,
    }  # fmt: skip


def mind(i: int, engines: int) -> dict[str, Any]:
    spec = {"engine": f"engine-{i % engines:04d}", "className": "standard", "contextTokens": 8192}
    status = {
        "grant": {"state": "Granted", "reason": "SlotFree", "slot": i % 8, "tokens": 8192,
                  "since": TIME, "endpoint": f"http://engine-{i % engines:04d}.team:8080"},
        "conditions": [{"type": "Granted", "status": "True", "reason": "SlotFree",
                        "message": "slot 3 of 8", "lastTransitionTime": TIME}],
        "observedGeneration": 1,
    }  # fmt: skip
    return obj("Mind", f"team-{i % 50:02d}", f"mind-{i:05d}", spec, status)


def engine(i: int) -> dict[str, Any]:
    source = {"kind": "pvc", "claimName": "models", "path": "/llama-8b-q4.gguf"}
    spec = {"model": {"name": "llama-8b", "source": source}, "contextTokensPerMind": 8192,
            "mindsPerEngine": 8, "allowedNamespaces": ["team-00"]}  # fmt: skip
    status = {"grants": [{"mind": f"team-00/mind-{i * 5 + k:05d}", "state": "Granted",
                          "reason": "SlotFree", "slot": k, "tokens": 8192, "since": TIME}
                         for k in range(5)],
              "conditions": [{"type": "Ready", "status": "True", "reason": "PodReady",
                              "lastTransitionTime": TIME}]}  # fmt: skip
    return obj("Engine", "team-00", f"engine-{i:04d}", spec, status)


def held(fill: Callable[[], Any]) -> tuple[int, Any]:
    gc.collect()
    tracemalloc.start()
    kept_alive = fill()
    gc.collect()
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return size, kept_alive


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minds", type=int, default=10_000)
    ap.add_argument("--engines", type=int, default=2_000)
    args = ap.parse_args()
    minds = [mind(i, args.engines) for i in range(args.minds)]
    engines = [engine(i) for i in range(args.engines)]
    whole_mind, whole_engine = len(json.dumps(minds[0])), len(json.dumps(engines[0]))
    print(f"{args.minds:,} Minds ({whole_mind:,} bytes of JSON each), "
          f"{args.engines:,} Engines ({whole_engine:,} bytes each)")  # fmt: skip

    def fill() -> tuple[Any, Any]:
        m, e = mind_cache.MindCache(), engine_cache.Cache()
        for body in minds:
            m.observe_mind(body, deleted=False, nudge=False)
        for body in engines:
            e.observe_engine(body, deleted=False, nudge=False)
        return m, e

    def whole(o: Any) -> dict[str, Any]:
        return copy.deepcopy(dict(o))

    with (
        mock.patch.object(mind_cache, "kept", whole),
        mock.patch.object(engine_cache, "kept", whole),
    ):
        before, _ = held(fill)
    after, _ = held(fill)
    print(f"caches holding every field:       {before / MiB:8.1f} MiB")
    print(f"caches as kept (kube.kept):       {after / MiB:8.1f} MiB")
    print(f"ratio: {before / after:.2f}x less; per Mind and Engine "
          f"{before / (args.minds + args.engines):,.0f} -> "
          f"{after / (args.minds + args.engines):,.0f} bytes")  # fmt: skip


if __name__ == "__main__":
    main()
