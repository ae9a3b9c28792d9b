"""What the `continuum` subcommands' argument parsers share: their declaration, value parsers,
and flags declared against the settings they fill.

`Subcommand` is one subcommand as `continuum --help` lists it (cli.py holds the table of them).
`SettingFlag` is a flag that sets one field of a settings dataclass: the field's default is the
flag's default, and `settings_from_flags` reads the parsed flag back into that field, so that a
flag, its default and the field it fills are written once, in one row of a table, instead of
three times (`add_argument(default=d.x)`, then `x=args.flag` where the settings are built).
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

__all__ = [
    "FIELD_DEFAULT",
    "SettingFlag",
    "Subcommand",
    "add_flags",
    "at_least_one",
    "settings_from_flags",
]

Settings = TypeVar("Settings")


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One subcommand of `continuum`: its name, its line in `continuum --help`, the description
    that heads its own `--help`, what adds its arguments and what runs it (returning the exit
    code; None for a group whose own subcommands say what runs, as `model`'s do), and a usage
    line where argparse's would mislead. Calling it registers it on the command's subparsers."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int] | None
    usage: str | None = None

    def __call__(self, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        p = sub.add_parser(
            self.name, help=self.help, description=self.description, usage=self.usage
        )
        self.add_arguments(p)
        if self.run is not None:
            p.set_defaults(func=self.run)


def at_least_one(refusal: str) -> Callable[[str], int]:
    """argparse's `type` for a whole number of 1 or more; a smaller one is refused as
    "{value} is not {refusal}" (each flag words what the count is of)."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{value} is not {refusal}")
        return value

    return count


class _FieldDefault:
    def __repr__(self) -> str:
        return "FIELD_DEFAULT"


#: A SettingFlag's default when none is given: the default of the field it sets.
FIELD_DEFAULT: Any = _FieldDefault()


@dataclass(frozen=True, slots=True)
class SettingFlag:
    """One flag of a command, and the field of its settings it sets.

    `field` is a dotted path into the settings (`pods.cpu_min`), or None for a flag the command
    reads itself (its default is then `default`). A `choices` flag takes the StrEnum's values and
    sets the field to the member; an `append` flag sets the field to the tuple of its values.
    """

    names: str | tuple[str, ...]
    """The flag, or its names: the first is its name, the others aliases."""
    field: str | None
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = FIELD_DEFAULT
    # builtins.type: the field `type` (argparse's word) hides the builtin in this class
    choices: builtins.type[StrEnum] | None = None
    action: str | builtins.type[argparse.Action] | None = None
    metavar: str | None = None
    dest: str | None = None

    @property
    def attribute(self) -> str:
        """The attribute of the parsed arguments it is kept under: `dest`, else derived from
        its first name as argparse derives it."""
        return self.dest or self.spellings[0].lstrip("-").replace("-", "_")

    @property
    def spellings(self) -> tuple[str, ...]:
        return (self.names,) if isinstance(self.names, str) else self.names

    def argparse_default(self, defaults: object) -> Any:
        """Its default as argparse holds it: the field's (from `defaults`) unless it has one of
        its own, a StrEnum member as its value, a tuple as the list `append` adds to."""
        if self.default is not FIELD_DEFAULT:
            return self.default
        assert self.field is not None, f"{self.spellings[0]}: a flag with no field needs a default"
        value = _get(defaults, self.field)
        if self.choices is not None:
            return str(value)
        return list(value) if self.action == "append" else value

    def field_value(self, args: argparse.Namespace) -> Any:
        """What the parsed flag sets its field to."""
        value = getattr(args, self.attribute)
        if self.choices is not None:
            return self.choices(value)
        return tuple(value) if self.action == "append" else value


def add_flags(
    parser: argparse.ArgumentParser, flags: Iterable[SettingFlag], defaults: object
) -> None:
    """Add each flag to `parser`, in order; `defaults` is the settings whose fields' defaults
    the flags take."""
    for flag in flags:
        keywords: dict[str, Any] = {"default": flag.argparse_default(defaults), "help": flag.help}
        if flag.type is not None:
            keywords["type"] = flag.type
        if flag.choices is not None:
            keywords["choices"] = [str(c) for c in flag.choices]
        if flag.action is not None:
            keywords["action"] = flag.action
        if flag.metavar is not None:
            keywords["metavar"] = flag.metavar
        parser.add_argument(*flag.spellings, dest=flag.attribute, **keywords)


def settings_from_flags(
    defaults: Settings, flags: Iterable[SettingFlag], args: argparse.Namespace
) -> Settings:
    """`defaults` with each field a flag sets replaced by that flag's parsed value (fields no
    flag sets keep their defaults)."""
    settings = defaults
    for flag in flags:
        if flag.field is not None:
            settings = _replaced(settings, flag.field.split("."), flag.field_value(args))
    return settings


def _get(settings: object, path: str) -> Any:
    value = settings
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _replaced(settings: Settings, path: list[str], value: Any) -> Settings:
    head, *rest = path
    if rest:
        value = _replaced(getattr(settings, head), rest, value)
    return dataclasses.replace(settings, **{head: value})  # type: ignore[type-var]
