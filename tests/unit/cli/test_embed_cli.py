"""`continuum embed`'s command line (`cli.embed`): each flag reaches the process's settings
(`embed.runtime.LaneProcessSettings`), and a bad one is refused with exit 2 and what to give
instead, before anything is started."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from continuum_operator.cli import build_parser, main
from continuum_operator.cli.embed import settings_from
from continuum_operator.embed.runtime import Callers, LaneProcessSettings

NS = "team-a"


def settings(*argv: str) -> LaneProcessSettings:
    return settings_from(build_parser().parse_args(["embed", "--model", "m.gguf", *argv]))


def test_a_lane_file_run_names_an_audience_and_a_namespace_or_the_unsafe_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    lane = tmp_path / "lane.yaml"
    lane.write_text(yaml.safe_dump({"contextTokens": 256, "verdict": "Fits"}))
    base = ["embed", "--model", str(model), "--lane-file", str(lane)]
    assert main(base) == 2
    err = capsys.readouterr().err
    for flag in ("--token-audience", "--callers-namespace", "--unsafe-no-review"):
        assert flag in err, err
    assert main([*base, "--token-audience", "a"]) == 2  # and a namespace
    capsys.readouterr()
    both = ["--review-tokens", "--unsafe-no-review"]
    assert main([*base, *both]) == 2
    assert "contradict" in capsys.readouterr().err
    given = settings("--lane-file", "l.yaml", "--token-audience", "aud", "--callers-namespace", NS)
    assert given.callers == Callers("aud", NS)


def test_a_bad_flag_value_exits_2_naming_the_flag_and_what_it_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert main(["embed", "--model", str(model), "--lane", "notes"]) == 2
    assert "error: --lane notes: expected NAMESPACE/NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["embed", "--model", str(model), "--lane", f"{NS}/notes", "--threads", "two"])
    assert exit_.value.code == 2
    assert "argument --threads: invalid int value: 'two'" in capsys.readouterr().err
    assert main(["embed", "--model", str(tmp_path / "none.gguf"), "--lane", f"{NS}/n"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_lane_of_the_cluster_serves_its_own_namespace_with_its_own_audience() -> None:
    lane = settings("--lane", f"{NS}/notes")
    assert lane.lane == (NS, "notes") and lane.lane_file is None
    assert lane.callers == Callers("continuum.dev/embedlane/team-a/notes", NS)
    given = settings("--lane", f"{NS}/notes", "--token-audience", "a", "--callers-namespace", "b")
    assert given.callers == Callers("a", "b")
    assert settings("--lane", f"{NS}/notes", "--unsafe-no-review").callers is None


def test_the_admin_address_comes_from_admin_listen_unless_a_port_is_given() -> None:
    plain = settings("--lane", f"{NS}/notes")
    assert (plain.listen, plain.admin_listen, plain.threads) == ("0.0.0.0:8080", "127.0.0.1:0", 2)
    assert settings("--lane", f"{NS}/n", "--admin-port", "9090").admin_listen == "0.0.0.0:9090"
