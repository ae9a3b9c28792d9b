"""`continuum release-finalizers`' command line (`cli.release`): a bad flag is refused with
the flag named and exit 2, before any call to the cluster."""

from __future__ import annotations

import pytest

from continuum_operator.cli import main
from continuum_operator.cli.errors import EXIT_INVALID


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stop-operator", "op"], "expected NAMESPACE/NAME"),
        (["--timeout", "0"], "--timeout 0.0: must be > 0"),
    ],
)
def test_bad_flags_are_refused_with_the_flag_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["release-finalizers", *argv]) == EXIT_INVALID
    assert message in capsys.readouterr().err
