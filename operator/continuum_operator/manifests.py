"""kubectl-style files read into validated resources, with errors a person can act on.

Every failure names the file, the field path as kubectl users write it (`spec.minds.min`) and
what is wrong, so `continuum plan` can exit 2 with one readable message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticUndefined

ResourceT = TypeVar("ResourceT", bound=BaseModel)


class ManifestError(Exception):
    """A file that cannot be used: unreadable, not YAML, or not a valid resource."""

    def __init__(self, path: Path | str, field: str, problem: str) -> None:
        self.path = str(path)
        self.field = field
        self.problem = problem
        where = f"{self.path}: {field}: " if field else f"{self.path}: "
        super().__init__(where + problem)


# Names pydantic gives union branches and wrapped validators in an error's location; they are
# not fields. Fields on the wire are camelCase and never look like these.
_BRANCH_NAMES = frozenset({"int", "str", "bool", "float", "bytes", "list", "dict", "none"})


def _is_branch(part: str) -> bool:
    return "[" in part or "-" in part or part[:1].isupper() or part in _BRANCH_NAMES


_UNSEEN: Any = object()  # the input is not at hand: every non-branch name is a field


def _field_path(loc: tuple[int | str, ...], obj: Any = _UNSEEN) -> str:
    """The field path of an error's location as kubectl users write it (`spec.minds.min`)."""
    return _locate(loc, obj)[0]


def _locate(loc: tuple[int | str, ...], obj: Any) -> tuple[str, int, bool]:
    """The field path of an error's location, walked against the input.

    Walking the input itself tells fields from names pydantic adds: a union branch's (`int`,
    `list[int]`, `constrained-int`) or a validator's never reads as a field. Returns the path and
    where the last skipped branch name sat (-1 if none), to tell union branches apart, and
    whether the field is in the input at all.
    """
    out = ""
    node = obj
    branch_at = -1
    present = True
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            if node is not _UNSEEN:
                ok = isinstance(node, list) and -len(node) <= part < len(node)
                node = node[part] if ok else None
        elif isinstance(node, dict) and part in node:
            out += ("." if out else "") + part
            node = node[part]
        elif node is _UNSEEN and not _is_branch(part):
            out += ("." if out else "") + part
        elif i == len(loc) - 1 and not _is_branch(part):
            out += ("." if out else "") + part  # an absent field: missing, or its default refused
            present = False
        else:
            branch_at = i
    return out, branch_at, present


def _shown(value: Any) -> str:
    """A scalar input as the user wrote it, for `(got ...)`; empty for objects and lists."""
    if isinstance(value, dict | list) or value is PydanticUndefined:
        return ""
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _message(err: ValidationError, obj: dict[str, Any]) -> tuple[str, str]:
    """The field path and problem of a validation error, as one readable line.

    The first problem is reported. Where it is one branch of a union (an int or a list, a word
    or a number), the branch that got furthest is reported, and branches that failed at the same
    depth are joined with "or".
    """
    errors = err.errors(include_url=False)
    located = [(*_locate(e["loc"], obj), e) for e in errors]
    path, branch_at, present, first = located[0]
    chosen = [first]
    if branch_at >= 0:
        stem = first["loc"][:branch_at]
        siblings = [(p, e) for p, b, _, e in located if b >= 0 and e["loc"][:branch_at] == stem]
        path = max((p for p, _ in siblings), key=len)
        chosen = [e for p, e in siblings if p == path]
    problems: list[str] = []
    for e in chosen:
        if e["type"] == "extra_forbidden":
            text = "unknown field (check its spelling against `kubectl explain`)"
        elif e["type"] == "missing":
            text = "required field is missing"
        else:
            text = str(e["msg"]).removeprefix("Value error, ")
        if text not in problems:
            problems.append(text)
    message = problems[0] + "".join(", or " + t[:1].lower() + t[1:] for t in problems[1:])
    if present and chosen[0]["type"] != "extra_forbidden":
        got = _shown(chosen[0].get("input", PydanticUndefined))
        if got and got not in message:
            message += f" (got {got})"
    others = {p for p, _, _, _ in located} - {path}
    if others:
        message += f" (and {len(others)} more problem{'s' if len(others) > 1 else ''})"
    return path, message


#: Deeper than any Kubernetes object nests; a file nested deeper is refused before Python's own
#: recursion limit turns it into a traceback.
MAX_YAML_DEPTH = 100


class _BoundedLoader(yaml.SafeLoader):
    """safe_load that refuses aliases and nesting past MAX_YAML_DEPTH.

    An alias shares one node in the loaded value, but every later walk (JSON, validation)
    expands it: nine nested aliases of nine ("billion laughs") are a few hundred bytes of YAML
    and 10^9 values. Kubernetes objects do not need them.
    """

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not read: write the value out",
                self.peek_event().start_mark,  # type: ignore[no-untyped-call]
            )  # fmt: skip
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_YAML_DEPTH} levels",
                    self.peek_event().start_mark,  # type: ignore[no-untyped-call]
                )  # fmt: skip
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def yaml_documents(path: Path | str) -> list[Any]:
    """Every document of a YAML (or JSON) file, or a ManifestError saying why it cannot be read:
    unreadable, not UTF-8, not YAML, aliases, nesting past MAX_YAML_DEPTH."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as err:
        raise ManifestError(p, "", f"cannot read the file: {err.strerror or err}") from err
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ManifestError(
            p, "", f"not UTF-8 text: byte {err.start} is {data[err.start : err.start + 1]!r}"
        ) from None
    try:
        return list(yaml.load_all(text, Loader=_BoundedLoader))  # a SafeLoader
    except yaml.YAMLError as err:
        raise ManifestError(p, "", f"not valid YAML: {err}") from err


def documents(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects of a YAML file: its documents, with `kind: List` items unpacked."""
    docs = yaml_documents(path)
    index = 0
    for doc in docs:
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ManifestError(
                path, "", f"expected a mapping (a Kubernetes object), got {type(doc).__name__}"
            )
        items = doc.get("items") if doc.get("kind") == "List" else [doc]
        if not isinstance(items, list):
            raise ManifestError(path, "items", "a List's items must be a list of objects")
        for item in items:
            if not isinstance(item, dict):
                raise ManifestError(path, f"items[{index}]", "each item must be an object")
            yield index, item
            index += 1


def parse(
    model: type[ResourceT], obj: dict[str, Any], path: Path | str, prefix: str = ""
) -> ResourceT:
    """Validate one object as `model`; the first error becomes a ManifestError."""
    kind = getattr(model, "KIND", model.__name__)
    if obj.get("kind") != kind:
        raise ManifestError(path, prefix + "kind", f"expected kind {kind}, got {obj.get('kind')!r}")
    try:
        # Validated as the API server sees it: JSON, typed strictly, so `"6144"` or `true` is not
        # an integer here either and a file that plans offline also applies.
        text = json.dumps(obj, default=str)
    except (TypeError, ValueError) as err:
        raise ManifestError(path, prefix, f"cannot be read as JSON: {err}") from err
    try:
        return model.model_validate_json(text, strict=True)
    except ValidationError as err:
        field, message = _message(err, obj)
        raise ManifestError(path, prefix + field, message) from err


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
