"""The caches keep every field but managed fields and annotations (`kube.client.kept`): what a
namespace's objects cost the operator follows what decisions read, not what their writers put
in annotations (docs/tenancy.md, "What a namespace's objects cost the operator")."""

from __future__ import annotations

import json
from typing import Any

from continuum_operator.core.replan import ACCEPT_ANNOTATION
from continuum_operator.kube.client.kept import LAST_APPLIED, kept
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.state.mind_cache import MindCache
from tests.support.builders import tree


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


def test_kept_drops_managed_fields_and_annotations_only() -> None:
    obj = applied("Mind", {"engine": "coder", "contextTokens": 512}, finalizers=["x"])
    body = tree(kept(obj))
    assert "managedFields" not in body["metadata"]
    assert "annotations" not in body["metadata"]  # no decision reads one (KEPT_ANNOTATIONS)
    obj["metadata"].pop("managedFields")
    obj["metadata"].pop("annotations")
    assert body == obj  # the rest whole: spec, status, labels, finalizers, versions
    body["spec"]["engine"] = "other"  # a copy: the watch's object is not shared
    assert obj["spec"]["engine"] == "coder"


def test_the_caches_hold_minds_and_engines_kept() -> None:
    minds = MindCache()
    minds.observe_mind(applied("Mind", {"engine": "coder"}), deleted=False, nudge=False)
    engines = Cache()
    engines.observe_engine(applied("Engine", {"contextTokensPerMind": 512}), deleted=False)
    for body in (minds.minds["team-a/ann"], engines.engines[("team-a", "ann")]):
        assert "managedFields" not in body["metadata"]
        assert "annotations" not in body["metadata"]
        assert body["metadata"]["resourceVersion"] == "7" and body["status"]


def test_a_mind_of_240_kb_annotations_costs_the_cache_what_a_bare_one_does() -> None:
    """2,000 such Minds took the operator from 154 to 223 MiB before (the issue's finding)."""
    heavy = applied("Mind", {"engine": "coder"})
    heavy["metadata"]["annotations"]["notes"] = "x" * 240_000
    bare = applied("Mind", {"engine": "coder"})
    bare["metadata"].pop("annotations")
    minds = MindCache()
    minds.observe_mind(heavy, deleted=False, nudge=False)
    held = minds.minds["team-a/ann"]
    assert len(json.dumps(held)) == len(json.dumps(kept(bare)))
    assert held == kept(bare)


def test_an_engines_acceptance_of_a_held_plan_is_kept_and_nothing_else() -> None:
    """The upgrade hold reads `continuum.dev/accept-plan` from the cached Engine
    (`kube.engines.placed`): dropped with the rest, a person's acceptance was never seen."""
    obj = applied("Engine", {"contextTokensPerMind": 512})
    obj["metadata"]["annotations"][ACCEPT_ANNOTATION] = "p-1234"
    engines = Cache()
    engines.observe_engine(obj, deleted=False)
    body = engines.engines[("team-a", "ann")]
    assert body["metadata"]["annotations"] == {ACCEPT_ANNOTATION: "p-1234"}
