"""examples/invalid: each file is refused by `continuum plan` at the field its header names (the
API server's side of the parity is tests/e2e/test_operator.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from continuum_operator.cli import main
from tests.support.builders import EXAMPLES

INVALID = sorted((EXAMPLES / "invalid").glob("*.yaml"))
BOARD = EXAMPLES / "boards" / "h200-discrete.yaml"


def rejected_at(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# rejected-at:"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"{path} has no '# rejected-at:' line")


def test_there_are_invalid_examples_to_check() -> None:
    assert len(INVALID) >= 18


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.stem)
def test_an_invalid_example_is_refused_by_plan_at_its_field(
    path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["plan", "--board", str(BOARD), "--engine", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{path}: {rejected_at(path)}:" in err
