"""One `-o` vocabulary (`table|json|yaml`) for every `continuum` command that prints, the old
`text` refused naming `table`, and `continuum --version`."""

from __future__ import annotations

import argparse
import json
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

from continuum_operator import cli
from continuum_operator.cli.output import OUTPUTS, leaf_table, output_format
from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from tests.support.builders import ROOT

M5 = ROOT / "examples" / "boards" / "m5-unified.yaml"
AGENT = ROOT / "examples" / "engines" / "agent-32b.yaml"
SCENARIO = ROOT / "examples" / "scenarios" / "seed-one-mind.yaml"
CAPTURE = ROOT / "tests" / "fixtures" / "probes" / "gb10-unified.json"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_with_an_output_option_takes_the_one_vocabulary() -> None:
    """A new command that registers its own `-o` choices fails here."""
    with_output = {}
    for name, parser in _subcommands().items():
        for action in parser._actions:
            if "-o" in action.option_strings:
                with_output[name] = action
    assert {"plan", "place", "facts", "simulate", "check-log", "agent"} <= set(with_output)
    for name, action in with_output.items():
        assert action.type is output_format, f"continuum {name}: -o is not output_format"
        assert action.choices is None, f"continuum {name}: -o has its own choices"
        assert action.default in OUTPUTS, name


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """Each printing command's arguments, on inputs from the repository (or made here)."""
    tmp = tmp_path_factory.mktemp("outputs")
    log = tmp / "log.jsonl"
    assert cli.main(["simulate", str(SCENARIO), "--log", str(log), "-o", "json"]) == 0
    model = write_tiny_gguf(tmp / "tiny.gguf", TinyModelShape())
    return {
        "plan": ["plan", "--board", str(M5), "--engine", str(AGENT)],
        "place": ["place", "--boards", str(M5.parent), "--engine", str(AGENT)],
        "facts": ["facts", str(model)],
        "simulate": ["simulate", str(SCENARIO)],
        "check-log": ["check-log", str(log)],
        "agent": ["agent", "--print", "--from-capture", str(CAPTURE), "--node-name", "n1"],
    }


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    capsys.readouterr()
    assert cli.main(argv) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["plan", "place", "facts", "simulate", "check-log", "agent"])
def test_json_and_yaml_print_the_same_document_and_table_prints_neither(
    command: str, runs: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = runs[command]
    as_json = json.loads(_run(capsys, [*argv, "-o", "json"]))
    assert isinstance(as_json, dict) and as_json
    assert yaml.safe_load(_run(capsys, [*argv, "-o", "yaml"])) == as_json
    table = _run(capsys, [*argv, "-o", "table"])
    assert table.strip()
    with pytest.raises(json.JSONDecodeError):
        json.loads(table)


@pytest.mark.parametrize("command", ["simulate", "check-log", "plan", "place", "facts", "agent"])
def test_the_old_text_word_is_refused_naming_table(
    command: str, runs: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main([*runs[command], "-o", "text"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "'text' is now 'table'" in err and "table, json or yaml" in err


def test_an_unknown_output_is_refused_naming_the_three(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["plan", "--board", str(M5), "--engine", str(AGENT), "-o", "wide"])
    assert exited.value.code == 2
    assert "invalid choice 'wide': choose table, json or yaml" in capsys.readouterr().err


def test_the_facts_table_has_a_row_per_fact(
    runs: dict[str, list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    facts = json.loads(_run(capsys, [*runs["facts"], "-o", "json"]))
    rows = _run(capsys, [*runs["facts"], "-o", "table"]).splitlines()
    assert [row.split(":")[0] for row in rows] == list(facts)
    assert any(row.split() == ["layers:", str(facts["layers"])] for row in rows)


def test_a_leaf_table_names_nested_paths_and_list_entries() -> None:
    doc = {"a": {"b": 1, "c": None}, "d": [1, 2], "e": [{"f": "x"}], "g": {}}
    assert leaf_table(doc).splitlines() == [
        "a.b:    1",
        "a.c:    -",
        "d:      1, 2",
        "e[0].f: x",
        "g:      {}",
    ]


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["--version"])
    assert exited.value.code == 0
    declared = tomllib.loads(Path(ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"continuum {version('continuum-operator')}"
    assert version("continuum-operator") == declared
