"""Reading a JSON object as the API server sends it, where no model of ours describes it (a Node,
a Deployment, a Job, a Pod) or where a part is read before, or without, validating the whole.

Each reader narrows what it finds: a field that is absent, null or of another type reads as
absent (None, an empty object), never as a crash, so a foreign or half-written object is
skipped, not guessed. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "at",
    "integer",
    "items_at",
    "labels_at",
    "name_of",
    "namespaced_name",
    "object_at",
    "text",
]

_EMPTY: Mapping[str, object] = {}


def at(value: object, *path: str) -> object:
    """The value at `path` (keys of nested objects); None where a step is missing or is not an
    object."""
    for key in path:
        # A dict (what the API server's JSON reads as) is checked first: the Mapping check is
        # an ABC's, several times the cost, and these readers run for every field read.
        if not isinstance(value, (dict, Mapping)):  # not `dict | Mapping`: slower
            return None
        value = value.get(key)
    return value


def object_at(value: object, *path: str) -> Mapping[str, object]:
    """The object at `path`; an empty one where there is none."""
    for key in path:  # `at`'s walk, inlined: the readers' most frequent call
        if not isinstance(value, (dict, Mapping)):
            return _EMPTY
        value = value.get(key)
    return value if isinstance(value, (dict, Mapping)) else _EMPTY


def items_at(value: object, *path: str) -> list[object]:
    """The list at `path`; an empty one where there is none."""
    found = at(value, *path)
    return list(found) if isinstance(found, list) else []


def text(value: object, *path: str) -> str | None:
    """The string at `path`, or None."""
    found = at(value, *path)
    return found if isinstance(found, str) else None


def integer(value: object, *path: str) -> int | None:
    """The whole number at `path` (a JSON integer, not a boolean), or None."""
    found = at(value, *path)
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def labels_at(value: object, *path: str) -> dict[str, str]:
    """The string-to-string map at `path` (labels, annotations): its string entries."""
    return {k: v for k, v in object_at(value, *path).items() if isinstance(v, str)}


def name_of(obj: object) -> str:
    """An object's `metadata.name` (every object the API server sends has one; '' if not)."""
    return text(obj, "metadata", "name") or ""


def namespaced_name(obj: object) -> tuple[str, str]:
    """A namespaced object's (namespace, name)."""
    return text(obj, "metadata", "namespace") or "", name_of(obj)
