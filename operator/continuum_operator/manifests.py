"""kubectl-style files read into validated resources, with errors a person can act on.

Every failure names the file, the field path as kubectl users write it (`spec.minds.min`) and
what is wrong, so `continuum plan` can exit 2 with one readable message.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

ResourceT = TypeVar("ResourceT", bound=BaseModel)


class ManifestError(Exception):
    """A file that cannot be used: unreadable, not YAML, or not a valid resource."""

    def __init__(self, path: Path | str, field: str, problem: str) -> None:
        self.path = str(path)
        self.field = field
        self.problem = problem
        where = f"{self.path}: {field}: " if field else f"{self.path}: "
        super().__init__(where + problem)


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("function-after", "function-before") or "[" in part:
            continue  # pydantic's names for validator and union branches, not fields
        else:
            out += ("." if out else "") + part
    return out


def documents(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects of a YAML file: its documents, with `kind: List` items unpacked."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ManifestError(path, "", f"cannot read the file: {err.strerror or err}") from err
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as err:
        raise ManifestError(path, "", f"not valid YAML: {err}") from err
    index = 0
    for doc in docs:
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ManifestError(path, "", f"expected a mapping (a Kubernetes object), got {type(doc).__name__}")
        items = doc.get("items") if doc.get("kind") == "List" else [doc]
        if not isinstance(items, list):
            raise ManifestError(path, "items", "a List's items must be a list of objects")
        for item in items:
            if not isinstance(item, dict):
                raise ManifestError(path, f"items[{index}]", "each item must be an object")
            yield index, item
            index += 1


def parse(model: type[ResourceT], obj: dict[str, Any], path: Path | str, prefix: str = "") -> ResourceT:
    """Validate one object as `model`; the first error becomes a ManifestError."""
    kind = getattr(model, "KIND", model.__name__)
    if obj.get("kind") != kind:
        raise ManifestError(path, prefix + "kind", f"expected kind {kind}, got {obj.get('kind')!r}")
    try:
        return model.model_validate(obj)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        message = str(first["msg"]).removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = "unknown field (check its spelling against `kubectl explain`)"
        elif first["type"] == "missing":
            message = "required field is missing"
        more = len(err.errors()) - 1
        if more:
            message += f" (and {more} more problem{'s' if more > 1 else ''})"
        raise ManifestError(path, prefix + _field_path(first["loc"]), message) from err


def load_one(model: type[ResourceT], path: Path) -> ResourceT:
    """Exactly one object of `model`'s kind from a file."""
    objs = list(documents(path))
    if len(objs) != 1:
        raise ManifestError(path, "", f"expected one object, found {len(objs)}")
    return parse(model, objs[0][1], path)


def load_all(model: type[ResourceT], path: Path) -> list[ResourceT]:
    objs = list(documents(path))
    prefix = "items[{}]." if len(objs) > 1 else ""
    return [parse(model, obj, path, prefix.format(i)) for i, obj in objs]
