"""The shell typed as the core is (issue 41, "A typed shell"): `Any` in `kube/` at most 10 per
1,000 lines, in each room and in the whole. What is counted is the name `Any` in code (Python's
tokens), not the word in a comment or a docstring: a body the API server sends is read as
`Mapping[str, object]` and narrowed (`model.json_body`), an object the operator owns as its
model, and a Kubernetes object it builds as `dict[str, object]`."""

from __future__ import annotations

import io
import tokenize
from pathlib import Path

import pytest

from tests.support.builders import ROOT

KUBE = ROOT / "operator" / "continuum_operator" / "kube"
ANY_PER_1000_LINES = 10


def any_and_lines(files: list[Path]) -> tuple[int, int]:
    """How many times the name `Any` stands in the code of `files`, and their lines."""
    found = lines = 0
    for path in files:
        text = path.read_text()
        lines += len(text.splitlines())
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        found += sum(1 for t in tokens if t.type == tokenize.NAME and t.string == "Any")
    return found, lines


def test_the_count_sees_any_in_code_and_not_in_prose(tmp_path: Path) -> None:
    code = "from typing import Any\n\n\ndef f(x: Any) -> None:\n    '''Any prose.'''  # Any\n"
    path = tmp_path / "sample.py"
    path.write_text(code)
    assert any_and_lines([path]) == (2, 5)


ROOMS = sorted(p.name for p in KUBE.iterdir() if (p / "__init__.py").exists())


@pytest.mark.parametrize("room", ROOMS)
def test_each_room_of_the_shell_has_at_most_10_any_per_1000_lines(room: str) -> None:
    found, lines = any_and_lines(sorted((KUBE / room).rglob("*.py")))
    assert lines > 0
    assert found * 1000 <= ANY_PER_1000_LINES * lines, f"{room}: {found} Any in {lines} lines"


def test_the_shell_has_at_most_10_any_per_1000_lines() -> None:
    found, lines = any_and_lines(sorted(KUBE.rglob("*.py")))
    assert lines > 10_000  # the whole shell, not an empty glob
    assert found * 1000 <= ANY_PER_1000_LINES * lines, f"kube/: {found} Any in {lines} lines"
