"""`continuum operator`'s command line (`cli.operator`): a bad flag value is refused by name,
with exit 2 and what the flag takes, before the operator starts."""

from __future__ import annotations

import pytest

from continuum_operator.cli import build_parser, main
from continuum_operator.cli.operator import settings_from


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--engine-cpu-min", "0", "0 is not 1 or more"),
        ("--engine-cpu-share", "1.5", "1.5 is not a fraction"),
        ("--engine-cpu-max", "two", "'two' is not a whole number"),
        ("--lane-cpu", "0", "'0' is not a CPU quantity above 0"),
        ("--lane-cpu", "two", "'two' is not a CPU quantity above 0 (write 2, 1.5 or 500m)"),
    ],
)
def test_engine_cpu_settings_that_cannot_make_a_guaranteed_pod_are_refused_by_name(
    flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["operator", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and said in err


@pytest.mark.parametrize("bad", ["NVIDIA", "nvidia_runtime", "-nvidia", "a" * 64])
def test_a_runtime_class_that_is_not_a_name_is_refused_by_the_operator(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["operator", f"--runtime-class={bad}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--runtime-class" in err and "not a RuntimeClass name" in err


@pytest.mark.parametrize("bad", ["app", "=coder", "app=coder,tier"])
def test_an_engine_selector_that_is_not_key_value_exits_2_with_how_to_write_one(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # It was read only once the operator ran, and stopped it with exit 1.
    with pytest.raises(SystemExit) as exit_:
        main(["operator", f"--engine-selector={bad}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --engine-selector" in err and "is not KEY=VALUE (write app=coder" in err


def test_an_engine_selector_names_the_leaders_lease_by_its_labels() -> None:
    def leader(*argv: str) -> str:
        return settings_from(build_parser().parse_args(["operator", *argv])).leader.name

    assert leader() == "continuum-operator"
    one = leader("--engine-selector", "app=coder")
    assert one.startswith("continuum-operator-") and one != leader("--engine-selector", "app=x")
    assert leader("--engine-selector", " app=coder , ") == one  # spaces and empty parts dropped
