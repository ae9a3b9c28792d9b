"""Reading the objects the API server sends without trusting their shape: a body is JSON
(`Mapping[str, object]`), and each field the shell reads is narrowed here to what it must be,
with the empty value where it is missing or of another type (a field another writer got wrong
reads as absent, as `.get(...) or {}` read it before).

Neighbours: every room reads bodies through it; the objects the operator owns are described by
`model/`, and these helpers read only what a decision needs of them.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["Body", "Manifest", "at", "bodies", "integer", "mapping", "number", "object_in", "text"]

#: An object as the API server sends it (decoded JSON); read through the helpers below.
Body = Mapping[str, object]
#: An object the shell builds or mutates to send (`object_in` writes into it).
Manifest = dict[str, object]


def mapping(value: object) -> Body:
    """`value` if it is a JSON object, else an empty one."""
    return value if isinstance(value, Mapping) else {}


def at(body: Body | None, *path: str) -> Body:
    """The object at `path` under `body` (`at(engine, "status", "plan")`); empty where a step
    is missing or not an object."""
    out: Body = body or {}
    for key in path:
        out = mapping(out.get(key))
    return out


def bodies(value: object) -> list[Body]:
    """The objects of a JSON list (items of another type skipped); [] for anything else."""
    if not isinstance(value, list):
        return []
    return [x for x in value if isinstance(x, Mapping)]


def text(value: object) -> str | None:
    """`value` if it is a string (None: missing, or another type)."""
    return value if isinstance(value, str) else None


def integer(value: object, default: int = 0) -> int:
    """`value` as an int: an int, or a float or string that reads as one; `default` else (a
    bool is not a number)."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, float | str):
        try:
            return int(value)
        except (ValueError, OverflowError):
            return default
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


def number(value: object, default: float = 0.0) -> float:
    """`value` as a float: an int or a float (not a bool); `default` else."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return default
