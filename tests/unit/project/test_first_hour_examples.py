"""What a newcomer tries first: every example Engine either says it plans offline only or has a
source that runs (the tiny model `continuum model tiny` writes, by its sha256), the Minds of
examples/minds/ do what their comment says they do, and `continuum model tiny` writes and names
the file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator.cli.model import TINY_SHAPE, sha256_of
from continuum_operator.core.grants import PriorityPolicy
from continuum_operator.gguf import read_facts
from continuum_operator.kube.grants import mind_status
from continuum_operator.kube.ledger import grant_ledger, routing
from continuum_operator.manifests import load_all, load_one, parse
from continuum_operator.model import Engine, Mind, MindClass
from continuum_operator.model.grant import GrantEntry
from continuum_operator.testing.tiny_gguf import write_tiny_gguf
from tests.support.builders import ROOT

EXAMPLES = ROOT / "examples"
MINDS = EXAMPLES / "minds"
TINY = EXAMPLES / "engines" / "with-source" / "tiny-chat.yaml"


def example_engines() -> list[tuple[Path, Engine]]:
    """Every Engine under examples/ but the invalid ones, with the file it is in."""
    out = []
    for path in sorted(EXAMPLES.rglob("*.yaml")):
        if "invalid" in path.parts:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if (doc or {}).get("kind") == "Engine":
                out.append((path, parse(Engine, doc, path)))
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", TINY_SHAPE, seed=0)


def test_every_example_engine_plans_offline_only_and_says_so_or_has_a_source() -> None:
    engines = example_engines()
    assert len(engines) >= 7, engines
    for path, engine in engines:
        comment = path.read_text()
        if engine.spec.model.source is None:
            assert "# Plans offline only" in comment, path
        else:
            assert "Plans offline only" not in comment, path
            assert engine.spec.model.sha256 is not None, f"{path}: a source without its sha256"


def test_the_engines_with_a_source_name_the_tiny_model_by_its_digest_and_facts(tiny: Path) -> None:
    digest = sha256_of(tiny)
    facts = read_facts(tiny)
    with_source = [(p, e) for p, e in example_engines() if e.spec.model.source]
    assert {p.name for p, _ in with_source} == {"tiny-chat.yaml", "tiny-chat-pvc.yaml"}
    for path, engine in with_source:
        model = engine.spec.model
        # `continuum model tiny` writes the same bytes each time: the examples' digest is its.
        assert model.sha256 == digest, path
        assert model.facts == facts, path


def test_the_tiny_engine_plans_offline_on_an_example_board() -> None:
    from continuum_operator.cli import main

    board = EXAMPLES / "boards" / "l4x2-discrete.yaml"
    assert main(["plan", "--board", str(board), "--engine", str(TINY), "-o", "json"]) == 0


# --- examples/minds ---------------------------------------------------------------------------


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_the_minds_examples_are_valid_and_name_classes_and_an_engine_that_exist() -> None:
    classes = load_all(MindClass, MINDS / "classes.yaml")
    minds = load_all(Mind, MINDS / "minds.yaml")
    assert {c.metadata.name for c in classes} == {"interactive", "batch"}
    engine = load_one(Engine, TINY)
    for m in minds:
        assert m.spec.class_name in {"interactive", "batch"}
        assert (m.metadata.namespace, m.spec.engine) == (engine.metadata.namespace, "tiny-chat")


def seen_in_comment() -> dict[str, tuple[str, str, int, str]]:
    """The rows of minds.yaml's "What you will see": name -> (class, state, tokens, reason)."""
    rows = re.findall(
        r"^#\s+(\w+)\s+(interactive|batch)\s+(\w+)\s+(\d+)\s+(\w+)\s",
        (MINDS / "minds.yaml").read_text(),
        re.M,
    )
    return {name: (cls, state, int(tokens), reason) for name, cls, state, tokens, reason in rows}


def test_the_minds_examples_do_what_their_comment_says_then_queue_moves_on_a_deletion() -> None:
    engine = yaml.safe_load(TINY.read_text())
    engine["status"] = {
        "plan": {"node": "n", "engineArgs": ["-np", "2"], "mindsGrantable": 2,
                 "contextTokensPerMind": 1024},
        "conditions": [{"type": "Ready", "status": "True"}],
    }  # fmt: skip
    minds = documents(MINDS / "minds.yaml")
    for m in minds:
        m["metadata"]["creationTimestamp"] = "2026-12-03T06:00:00Z"  # one apply, one second
    classes, default = routing.classes_of(documents(MINDS / "classes.yaml"))
    policy = PriorityPolicy(grace_seconds=5.0)

    def step(now: float, present: list[dict[str, Any]]) -> dict[str, GrantEntry]:
        demands = routing.demands_of(present, classes, default)
        s = grant_ledger.step(engine, demands, now, policy)
        engine["status"]["grants"] = [e.wire() for e in s.entries]
        engine["status"][grant_ledger.CAPACITY_FIELD] = s.pool.to_status()
        return {e.mind.split("/")[1]: e for e in s.entries}

    entries = step(100.0, minds)
    shown = {}
    for name, e in entries.items():
        grant = mind_status.projection(e, "minds/tiny-chat", 1024, 0).grant
        assert grant is not None
        shown[name] = (grant.state, grant.tokens, grant.reason)
    expected = seen_in_comment()
    assert set(expected) == {"ada", "bo", "cy", "dee"}
    assert shown == {
        n: (state, tokens, reason) for n, (_, state, tokens, reason) in expected.items()
    }
    classes_named = {m["metadata"]["name"]: m["spec"]["className"] for m in minds}
    assert classes_named == {n: cls for n, (cls, *_) in expected.items()}

    # bo deleted: reclaimed, released at her grace deadline (no gateway reports it), cy granted.
    rest = [m for m in minds if m["metadata"]["name"] != "bo"]
    assert (step(101.0, rest)["bo"].state, step(101.0, rest)["cy"].state) == (
        "Reclaiming",
        "Queued",
    )
    after = step(106.0, rest)
    assert "bo" not in after
    assert (after["cy"].state, after["cy"].reason) == ("Granted", "SlotFree")


# --- continuum model tiny ---------------------------------------------------------------------


def test_model_tiny_writes_the_file_and_prints_its_path_size_and_sha256(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny: Path
) -> None:
    from continuum_operator.cli import main

    path = tmp_path / "sub" / "tiny.gguf"
    assert main(["model", "tiny", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"path:   {path.resolve()}" in out
    assert f"size:   {path.stat().st_size} bytes" in out
    assert f"sha256: {sha256_of(path)}" in out
    assert path.read_bytes() == tiny.read_bytes()  # the examples' digest
    assert read_facts(path).layers == TINY_SHAPE.n_layer


def test_every_example_model_tiny_names_exists_and_reads_the_file_where_it_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It named examples/engines/tiny-hostpath.yaml and tiny-pvc.yaml, which never existed."""
    from continuum_operator.cli import main

    assert main(["model", "tiny", str(tmp_path / "tiny.gguf")]) == 0
    out = capsys.readouterr().out
    named = re.findall(
        r"(examples/\S+\.yaml) (?:reads it at (\S+)|as (\S+) in the "
        r"PersistentVolumeClaim (\S+);)",
        out.replace("\n", " "),
    )
    assert len(named) == 2, out
    for path, host_path, file, claim in named:
        assert (ROOT / path).exists(), f"`continuum model tiny` names {path}, which does not exist"
        source = load_one(Engine, ROOT / path).spec.model.source
        assert source is not None, path
        said = (
            {"kind": "hostPath", "path": host_path}
            if host_path
            else {"kind": "pvc", "claimName": claim, "path": file}
        )
        assert source.model_dump(mode="json", by_alias=True, exclude_none=True) == said, path


def test_model_tiny_refuses_to_overwrite_or_to_write_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from continuum_operator.cli import main

    path = tmp_path / "tiny.gguf"
    path.write_text("mine")
    assert main(["model", "tiny", str(path)]) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert path.read_text() == "mine"
    assert main(["model", "tiny", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["model", "tiny", str(path), "--force", "--seed", "1"]) == 0
    assert path.stat().st_size > 1000


def test_the_minds_example_documents_parse_as_the_api_server_would() -> None:
    for doc in documents(MINDS / "minds.yaml"):
        parse(Mind, doc, MINDS / "minds.yaml")


def test_the_demos_tiny_chat_is_the_one_that_runs_less_its_file() -> None:
    """The Minds of examples/minds/ name tiny-chat: on the demo the plan-only Engine (KWOK nodes
    run no facts Job), on a cluster the one with a source; the two differ only by the file."""
    demo = load_one(Engine, EXAMPLES / "engines" / "tiny-chat.yaml")
    runs = load_one(Engine, TINY)
    assert demo.spec.model.source is None and demo.spec.model.sha256 is None
    assert demo.metadata == runs.metadata
    without_file = runs.spec.model.model_copy(update={"source": None, "sha256": None})
    assert demo.spec == runs.spec.model_copy(update={"model": without_file})
