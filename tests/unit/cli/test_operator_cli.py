"""`continuum operator`'s command line (`cli.operator`): a bad flag value is refused by name,
with exit 2 and what the flag takes, before the operator starts."""

from __future__ import annotations

import sys

import pytest

from continuum_operator.cli import build_parser, main
from continuum_operator.cli.operator import settings_from
from continuum_operator.kube.base.settings import OperatorSettings


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


# --------------------------------------------------------------------------------------------
# The grants', the leader's and the children's webhook's flags (`cli.operator_sections`)


def _settings(*argv: str) -> OperatorSettings:
    return settings_from(build_parser().parse_args(["operator", *argv]))


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        # Each stopped the operator with exit 1 once it ran (`SystemExit("error: ...")`).
        (
            ["--engine-address", "ns/coder"],
            "argument --engine-address: 'ns/coder' is not NAMESPACE/NAME=URL (write ns/coder=",
        ),
        (["--webhook-timeout", "31"], "argument --webhook-timeout: 31 is not 1 to 30"),
        (
            ["--write-workers", "0"],
            "argument --write-workers: 0 is not a count of writes in flight (1 or more)",
        ),
        (
            ["--webhook", "--webhook-service", "ctm-webhook"],
            "argument --webhook-service: 'ctm-webhook': expected NAMESPACE/NAME",
        ),
        (
            ["--webhook-service", "a/b", "--webhook-service-port", "0"],
            "argument --webhook-service-port: 0 is not a port (1 to 65535)",
        ),
        (
            ["--webhook", "--webhook-certfile", "tls.crt"],
            "--webhook-certfile and --webhook-keyfile go together: give both",
        ),
        (
            ["--leader-lease-duration", "15", "--leader-renew", "13"],
            "--leader-renew 13 must be shorter than --leader-lease-duration 15",
        ),
    ],
)
def test_a_bad_grant_leader_or_webhook_flag_exits_2_with_what_to_write(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Refused before the operator starts: `main` returns (or argparse exits) without serving.
    with pytest.raises(SystemExit) as exit_:
        sys.exit(main(["operator", *argv]))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert said in err, err


def test_the_grant_and_webhook_flags_reach_the_settings() -> None:
    s = _settings(
        "--webhook", "--webhook-host", "op.ns.svc", "--webhook-port", "8443",
        "--webhook-timeout", "3", "--children-priority-class", "kids",
        "--webhook-service", "continuum-system/ctm-webhook", "--webhook-service-port", "443",
        "--engine-address", "ns/coder=http://127.0.0.1:9/", "--write-workers", "4",
    )  # fmt: skip
    assert (s.children.webhook, s.children.host, s.children.port) == (True, "op.ns.svc", 8443)
    assert s.children.timeout_seconds == 3
    assert s.children.service == ("continuum-system", "ctm-webhook")
    assert s.children.service_port == 443
    assert s.pods.children_priority_class == "kids"
    assert s.grants.engine_addresses == {"ns/coder": "http://127.0.0.1:9"}
    assert s.grants.write_workers == 4
    plain = _settings()
    assert (plain.children.webhook, plain.children.service) == (False, None)
    assert plain.grants.engine_addresses == {}
