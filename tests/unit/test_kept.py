"""The caches keep every field but managed fields and kubectl's last-applied copy (`kube.kept`)."""

from __future__ import annotations

import json
from typing import Any

from continuum_operator.kube.cache import Cache
from continuum_operator.kube.kept import LAST_APPLIED, kept
from continuum_operator.kube.mind_cache import MindCache


def applied(kind: str, spec: dict[str, Any], **meta: Any) -> dict[str, Any]:
    """An object as the API server sends one applied with `kubectl apply`."""
    manifest = {"apiVersion": "continuum.dev/v1alpha1", "kind": kind,
                "metadata": {"name": "ann", "namespace": "team-a"}, "spec": spec}  # fmt: skip
    return {
        **manifest,
        "metadata": {
            "name": "ann", "namespace": "team-a", "resourceVersion": "7", "generation": 1,
            "uid": "u-1", "creationTimestamp": "2026-12-04T10:00:00Z",
            "annotations": {LAST_APPLIED: json.dumps(manifest), "team": "search"},
            "managedFields": [{"manager": "kubectl", "operation": "Apply",
                               "fieldsV1": {"f:spec": {"f:engine": {}}}}],
            **meta,
        },
        "status": {"grant": {"state": "Queued"}},
    }  # fmt: skip


def test_kept_drops_managed_fields_and_the_last_applied_copy_only() -> None:
    obj = applied("Mind", {"engine": "coder", "contextTokens": 512}, finalizers=["x"])
    body = kept(obj)
    assert "managedFields" not in body["metadata"]
    assert body["metadata"]["annotations"] == {"team": "search"}
    obj["metadata"].pop("managedFields")
    obj["metadata"]["annotations"].pop(LAST_APPLIED)
    assert body == obj  # the rest whole
    body["spec"]["engine"] = "other"  # a copy: the watch's object is not shared
    assert obj["spec"]["engine"] == "coder"


def test_the_caches_hold_minds_and_engines_kept() -> None:
    minds = MindCache()
    minds.observe_mind(applied("Mind", {"engine": "coder"}), deleted=False, nudge=False)
    engines = Cache()
    engines.observe_engine(applied("Engine", {"contextTokensPerMind": 512}), deleted=False)
    for body in (minds.minds["team-a/ann"], engines.engines[("team-a", "ann")]):
        assert "managedFields" not in body["metadata"]
        assert LAST_APPLIED not in body["metadata"]["annotations"]
        assert body["metadata"]["resourceVersion"] == "7" and body["status"]
