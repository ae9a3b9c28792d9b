"""examples/tenancy: every object is valid for its model, and the examples agree with each other
as docs/tenancy.md tells them (the shared Engine serves the namespaces its Minds come from)."""

from __future__ import annotations

from typing import Any

import yaml

from continuum_operator.kube.ledger import routing
from continuum_operator.manifests import parse
from continuum_operator.model import Engine, Mind, MindClass, TokenQuota
from tests.support.builders import ROOT

EXAMPLES = ROOT / "examples" / "tenancy"
MODELS = {m.KIND: m for m in (Engine, Mind, MindClass, TokenQuota)}


def objects() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        out.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    return out


def test_every_tenancy_example_is_a_valid_resource() -> None:
    docs = objects()
    assert {d["kind"] for d in docs} == set(MODELS)
    for doc in docs:
        parse(MODELS[doc["kind"]], doc, EXAMPLES)


def test_the_shared_engine_serves_every_mind_that_names_it_and_their_classes_exist() -> None:
    docs = objects()
    engines = {
        (d["metadata"]["namespace"], d["metadata"]["name"]): d
        for d in docs
        if d["kind"] == "Engine"
    }
    classes, default = routing.classes_of([d for d in docs if d["kind"] == "MindClass"])
    minds = [d for d in docs if d["kind"] == "Mind"]
    by_engine, refused = routing.route_minds(minds, engines, classes, default)
    assert refused == {}
    assert sum(len(v) for k, v in by_engine.items() if k in engines) == len(minds) == 2
    assert default == "standard"
