"""The shell is typed where the core is (issue 41, "A typed shell"): no name standing for `Any`
to hide it from the count (tests/unit/project/test_shell_types.py counts it), and an Engine's
plan read as `model.plan_status.PlanStatus`, never as a dict (`plan.get(...)`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.support.builders import ROOT

KUBE = ROOT / "operator" / "continuum_operator" / "kube"
#: The rooms whose every plan is the typed `PlanStatus` (the ledger's `launch_of` and the plan
#: metrics still read a stored plan's fields by name).
TYPED_ROOMS = ("engines", "workloads", "state", "lanes", "nodes")


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
