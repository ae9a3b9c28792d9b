"""Memory the operator's caches hold for many Minds and Engines, kept (`kube.client.kept`) or whole.

    python bench/cache_memory.py [--minds 10000] [--engines 2000] [--annotation-bytes 0]

Objects as the API server sends them after `kubectl apply` and a few operator writes: each with
the last-applied annotation (the applied manifest again) and managed fields of three managers
(kubectl's client-side apply, the operator's finalizer, the status writer), shaped as a 1.36 API
server writes them. The watches' caches (`MindCache` for Minds, `Cache` for Engines) are filled
once keeping every field (a deep copy, as before) and once as they keep them now, measured with
tracemalloc side by side in this run. Prints MiB held and the ratio; a figure, not a gate.

With `--annotation-bytes N` each Mind also carries an annotation of N bytes (a writer's own, up
to the API server's 256 KiB): the bound is that the kept caches hold no more than 1% above the
same objects without it (exit 2 where they do). It also prints what one list of the Minds holds
once parsed: kopf lists a kind whole before it hands the objects over (at start and at each
relist), so that, not the caches, is what their annotations cost the operator at its peak.
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

from continuum_operator.kube.client.kept import LAST_APPLIED  # noqa: E402
from continuum_operator.kube.state import cache as engine_cache  # noqa: E402
from continuum_operator.kube.state import mind_cache  # noqa: E402

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


def mind(i: int, engines: int, annotation_bytes: int = 0) -> dict[str, Any]:
    spec = {"engine": f"engine-{i % engines:04d}", "className": "standard", "contextTokens": 8192}
    status = {
        "grant": {"state": "Granted", "reason": "SlotFree", "slot": i % 8, "tokens": 8192,
                  "since": TIME, "endpoint": f"http://engine-{i % engines:04d}.team:8080"},
        "conditions": [{"type": "Granted", "status": "True", "reason": "SlotFree",
                        "message": "slot 3 of 8", "lastTransitionTime": TIME}],
        "observedGeneration": 1,
    }  # fmt: skip
    body = obj("Mind", f"team-{i % 50:02d}", f"mind-{i:05d}", spec, status)
    if annotation_bytes:
        # Each its own string (a list's objects share none), as parsed from the API's answer.
        body["metadata"]["annotations"]["notes"] = f"{i:08d}" + "x" * (annotation_bytes - 8)
    return body


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


def fill_caches(minds: list[str], engines: list[str]) -> Any:
    """The caches fed each object as a watch hands it over: parsed from the API server's JSON,
    observed, then dropped by the watch (what the cache shares of it, a string it did not copy,
    stays alive with the cache)."""
    m, e = mind_cache.MindCache(), engine_cache.Cache()
    for text in minds:
        m.observe_mind(json.loads(text), deleted=False, nudge=False)
    for text in engines:
        e.observe_engine(json.loads(text), deleted=False, nudge=False)
    return m, e


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minds", type=int, default=10_000)
    ap.add_argument("--engines", type=int, default=2_000)
    ap.add_argument("--annotation-bytes", type=int, default=0)
    args = ap.parse_args()
    minds = [json.dumps(mind(i, args.engines, args.annotation_bytes)) for i in range(args.minds)]
    engines = [json.dumps(engine(i)) for i in range(args.engines)]
    whole_mind, whole_engine = len(minds[0]), len(engines[0])
    print(f"{args.minds:,} Minds ({whole_mind:,} bytes of JSON each), "
          f"{args.engines:,} Engines ({whole_engine:,} bytes each)")  # fmt: skip

    def whole(o: Any) -> dict[str, Any]:
        return copy.deepcopy(dict(o))

    with (
        mock.patch.object(mind_cache, "kept", whole),
        mock.patch.object(engine_cache, "kept", whole),
    ):
        before, _ = held(lambda: fill_caches(minds, engines))
    after, _ = held(lambda: fill_caches(minds, engines))
    print(f"caches holding every field:       {before / MiB:8.1f} MiB")
    print(f"caches as kept (kube.client.kept):       {after / MiB:8.1f} MiB")
    print(f"ratio: {before / after:.2f}x less; per Mind and Engine "
          f"{before / (args.minds + args.engines):,.0f} -> "
          f"{after / (args.minds + args.engines):,.0f} bytes")  # fmt: skip
    if not args.annotation_bytes:
        return 0
    parsed, _ = held(lambda: json.loads("[" + ",".join(minds) + "]"))
    bare = [json.dumps(mind(i, args.engines)) for i in range(args.minds)]
    without, _ = held(lambda: fill_caches(bare, engines))
    per_mind = (after - without) / args.minds
    bound = 1.01 * without
    print(
        f"one list of the Minds, parsed:    {parsed / MiB:8.1f} MiB "
        f"({parsed / args.minds:,.0f} bytes a Mind; kopf holds it whole at start and relists)"
    )
    print(f"caches, the Minds without it:     {without / MiB:8.1f} MiB; their annotations cost "
          f"the caches {per_mind:,.0f} bytes a Mind")  # fmt: skip
    within = after <= bound
    print(f"bound (kept caches within 1% of the same objects without annotations, "
          f"{bound / MiB:.1f} MiB): {'held' if within else 'MISSED'}")  # fmt: skip
    return 0 if within else 2


if __name__ == "__main__":
    sys.exit(main())
