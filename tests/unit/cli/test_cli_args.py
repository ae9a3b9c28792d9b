"""cli_args: flags declared against a settings dataclass, read back into it; counts of 1 or more."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from enum import StrEnum

import pytest

from continuum_operator.cli.args import SettingFlag, add_flags, at_least_one, settings_from_flags


class Colour(StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    colour: Colour = Colour.RED
    paths: tuple[str, ...] = ()
    untouched: int = 7


@dataclass(frozen=True)
class Outer:
    seconds: float = 1.5
    inner: Inner = field(default_factory=Inner)


FLAGS = (
    SettingFlag("--seconds", "seconds", "how long", type=float),
    SettingFlag("--colour", "inner.colour", "which", choices=Colour),
    SettingFlag(("--path", "--old-path"), "inner.paths", "where", action="append"),
    SettingFlag("--other", None, "read by the command itself", default="x"),
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_flags(p, FLAGS, Outer())
    return p


def test_no_flags_give_the_settings_defaults() -> None:
    args = parser().parse_args([])
    assert (args.seconds, args.colour, args.path, args.other) == (1.5, "red", [], "x")
    assert settings_from_flags(Outer(), FLAGS, args) == Outer()


def test_flags_set_their_fields_nested_and_others_keep_their_defaults() -> None:
    args = parser().parse_args(
        ["--seconds", "3", "--colour", "blue", "--path", "/a", "--old-path", "/b"]
    )
    assert settings_from_flags(Outer(), FLAGS, args) == Outer(
        seconds=3.0, inner=Inner(colour=Colour.BLUE, paths=("/a", "/b"), untouched=7)
    )


def test_a_choice_outside_the_enum_is_refused_by_argparse(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--colour", "green"])
    assert "invalid choice: 'green' (choose from 'red', 'blue')" in capsys.readouterr().err


def test_at_least_one_words_its_refusals() -> None:
    count = at_least_one("a positive count")
    assert count("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="0 is not a positive count"):
        count("0")
    with pytest.raises(argparse.ArgumentTypeError, match="'x' is not a whole number"):
        count("x")
