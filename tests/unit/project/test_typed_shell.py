"""The shell is typed where the core is (issue 41, "A typed shell"): `Any` in a room of `kube/`
at most 10 per 1,000 lines, counted as `grep -ow Any` counts it (an import, an annotation, a
comment alike), and no name standing for `Any` to hide it from the count. An Engine's plan is
read as `model.plan_status.PlanStatus`, never as a dict (`plan.get(...)`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.builders import ROOT

KUBE = ROOT / "operator" / "continuum_operator" / "kube"
#: The rooms typed so far; every room of `kube/` once the others are (`typegrant`'s: grants,
#: ledger, children, process, base, client).
TYPED_ROOMS = ("engines", "workloads", "state", "lanes", "nodes")
ANY_PER_1000_LINES = 10
_ANY = re.compile(r"\bAny\b")


def any_count(room: Path) -> tuple[int, int]:
    """(`Any` words, lines) over a room's modules."""
    texts = [p.read_text() for p in sorted(room.glob("*.py"))]
    return sum(len(_ANY.findall(t)) for t in texts), sum(len(t.splitlines()) for t in texts)


@pytest.mark.parametrize("room", TYPED_ROOMS)
def test_a_typed_room_holds_at_most_10_any_per_1000_lines(room: str) -> None:
    found, lines = any_count(KUBE / room)
    assert lines > 100  # the room as it is, not an empty glob
    assert found * 1000 <= ANY_PER_1000_LINES * lines, f"{room}: {found} Any in {lines} lines"


def _any_aliases(path: Path) -> list[str]:
    """Names bound to `Any` itself (`X = Any`, `X: TypeAlias = Any`)."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            value = node.value
            if isinstance(value, ast.Name) and value.id == "Any":
                out.append(f"{path.name}:{node.lineno}")
    return out


def test_no_name_of_the_shell_stands_for_any() -> None:
    modules = sorted(KUBE.rglob("*.py"))
    assert len(modules) > 40
    assert [a for p in modules for a in _any_aliases(p)] == []


@pytest.mark.parametrize("room", TYPED_ROOMS)
def test_no_module_of_a_typed_room_reads_a_plan_as_a_dict(room: str) -> None:
    # The plan's fields, as a dict key: what `plan.get("node")` and `plan_doc["gpus"]` read.
    keys = re.compile(r"""\b(plan|plan_doc)\s*(\.get\(|\[)""")
    found = [
        f"{p.name}:{n}"
        for p in sorted((KUBE / room).glob("*.py"))
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if keys.search(line)
    ]
    assert found == []


def test_a_json_body_reads_a_field_absent_null_or_of_another_type_as_absent() -> None:
    from continuum_operator.model import json_body as jb

    pod = {
        "metadata": {"name": "p", "namespace": "ns", "labels": {"a": "1", "b": 2}},
        "spec": {"nodeName": None, "priority": True, "containers": "not a list"},
        "status": ["not", "an", "object"],
    }
    assert jb.namespaced_name(pod) == ("ns", "p") and jb.name_of({}) == ""
    assert jb.labels_at(pod, "metadata", "labels") == {"a": "1"}  # 2 is no label value
    assert jb.text(pod, "spec", "nodeName") is None
    assert jb.integer(pod, "spec", "priority") is None  # a boolean is no count
    assert jb.items_at(pod, "spec", "containers") == []
    assert jb.object_at(pod, "status") == {} and jb.at(pod, "status", "phase") is None
    assert jb.at(pod, "metadata", "labels", "a") == "1"
