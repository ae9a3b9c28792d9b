"""`continuum engine`'s command line (`cli.engine`): each flag reaches the process's settings
(`engine.runtime.EngineProcessSettings`), and a bad one is refused with exit 2 and what to give
instead, before anything is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from continuum_operator.cli import build_parser, main
from continuum_operator.cli.engine import settings_from
from continuum_operator.engine.runtime import EngineProcessSettings, launch_settings
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ENV


def settings(*argv: str) -> EngineProcessSettings:
    return settings_from(build_parser().parse_args(["engine", "--model", "m.gguf", *argv]))


def test_continuum_engine_refuses_a_bad_command_line_with_what_to_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    refused = {
        ("--model", str(model)): "give --grants FILE or --engine NAMESPACE/NAME",
        ("--model", str(model), "--engine", "no-namespace"): "expected NAMESPACE/NAME",
        ("--model", str(tmp_path / "none.gguf"), "--grants", "g.yaml"): "no such file",
    }
    for argv, said in refused.items():
        assert main(["engine", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err, err


def test_a_bad_flag_value_exits_2_naming_the_flag_and_what_it_takes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    base = ["engine", "--model", str(model), "--grants", "g.yaml", "--unsafe-trust-mind-header"]
    with pytest.raises(SystemExit) as exit_:
        main([*base, "--threads", "0"])
    assert exit_.value.code == 2
    assert "argument --threads: 0 is not a positive count" in capsys.readouterr().err
    assert main([*base, "--park-budget", "-1", "--park-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "--park-budget -1: a count of bytes, 0 or more" in err


def test_continuum_engine_takes_the_park_store_from_its_command_line(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    grants = ["--grants", "g.yaml", "--unsafe-trust-mind-header"]
    base = ["engine", "--model", str(model), *grants]
    assert main([*base, "--park-budget", "1000"]) == 2  # a budget needs its directory
    assert main([*base, "--park-dir", str(tmp_path), "--park-budget", "-1"]) == 2
    launch = launch_settings(settings("--park-dir", "/park", "--park-budget", "4096"), {}, {})
    assert (launch.park_dir, launch.park_budget_bytes) == (Path("/park"), 4096)
    argv = launch.argv(8081, Path("/park"))
    assert argv[argv.index("--slot-save-path") + 1] == "/park"  # llama-server saves there


def test_the_addresses_come_from_listen_unless_a_port_is_given() -> None:
    plain = settings()
    assert (plain.listen, plain.admin_listen) == ("0.0.0.0:8080", "127.0.0.1:0")
    ported = settings("--listen", "127.0.0.1:9", "--port", "8081", "--admin-port", "9090")
    assert (ported.listen, ported.admin_listen) == ("0.0.0.0:8081", "0.0.0.0:9090")


def test_the_audience_is_the_engines_own_unless_given_and_none_with_the_unsafe_flag() -> None:
    assert settings("--engine", "ml/coder").engine == ("ml", "coder")
    assert settings("--engine", "ml/coder").token_audience == "continuum.dev/engine/ml/coder"
    given = settings("--engine", "ml/coder", "--token-audience", "aud")
    assert given.token_audience == "aud"
    assert settings("--grants", "g", "--token-audience", "aud").token_audience == "aud"
    unsafe = settings("--engine", "ml/coder", "--unsafe-trust-mind-header")
    assert unsafe.token_audience is None


def test_the_model_is_hashed_unless_no_receipt_and_no_digest_are_asked() -> None:
    assert settings().verify_model
    assert not settings("--no-receipt").verify_model
    assert settings("--no-receipt", "--sha256", "ab" * 32).verify_model  # a digest is checked


def test_llama_servers_arguments_after_the_dashes_replace_the_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(LAUNCH_ENV, "launch-7")
    given = settings("--grants", "g", "--", "-c", "2048", "--parallel", "2")
    assert given.llama_args == ("-c", "2048", "--parallel", "2")
    assert given.launch == "launch-7"
    plan = {"engineArgs": ["-c", "1024"]}
    assert launch_settings(given, plan, {}).args == ("-c", "2048", "--parallel", "2")
    assert launch_settings(settings("--grants", "g"), plan, {}).args == ("-c", "1024")


def test_the_access_log_is_off_unless_asked_for() -> None:
    assert not settings().access_log
    assert settings("--access-log").access_log
