"""What the shell adds to `model.json_body` (which reads a JSON object's fields): the objects of a
JSON list, a number that may be an int or a float, and an object to write into while a body is
built or mutated.

Neighbours: `model.json_body` (the readers), the rooms that read and build bodies.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["bodies", "number", "object_in"]


def bodies(value: object) -> list[Mapping[str, object]]:
    """The objects of a JSON list (items of another type skipped); [] for anything else."""
    if not isinstance(value, list):
        return []
    return [x for x in value if isinstance(x, Mapping)]


def number(value: object, default: float = 0.0) -> float:
    """`value` as a float: an int or a float (not a bool); `default` else."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return default


def object_in(parent: dict[str, object], key: str) -> dict[str, object]:
    """`parent[key]` to write into: an object of a body being built or mutated, set to an empty
    one where it is missing or of another type."""
    value = parent.get(key)
    if isinstance(value, dict):
        return value
    made: dict[str, object] = {}
    parent[key] = made
    return made
