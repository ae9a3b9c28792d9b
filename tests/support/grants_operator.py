"""`continuum operator` as the grants tests run it: started as a process over the Engines of one
label, with a short grace, a transition log and a quick leader Lease (`start_operator`, or
`operator` for a block), told leading (`leading`), and its transition log judged by
`continuum check-log` (`check_log`)."""

from __future__ import annotations

import io
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

from continuum_operator import cli
from tests.support.cluster import Cluster
from tests.support.operator_process import stop

GRACE = 20


@contextmanager
def operator(
    cluster: Cluster,
    workdir: Path,
    label: tuple[str, str],
    *extra: str,
    env: dict[str, str] | None = None,
    name: str = "operator",
) -> Iterator[subprocess.Popen[bytes]]:
    proc = start_operator(cluster, workdir, label, *extra, env=env, name=name)
    try:
        yield proc
    finally:
        stop(proc)


def start_operator(
    cluster: Cluster,
    workdir: Path,
    label: tuple[str, str],
    *extra: str,
    env: dict[str, str] | None = None,
    name: str = "operator",
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable, "-m", "continuum_operator.cli", "operator",
        "--kubeconfig", str(cluster.kubeconfig),
        "--resync", "1",
        "--engine-image", "continuum-engine:e2e",
        "--engine-selector", "=".join(label),
        "--grace", str(GRACE),
        "--transition-log", str(workdir / "transitions.jsonl"),
        "--leader-lease-duration", "6",
        "--leader-renew", "1",
        *extra,
    ]  # fmt: skip
    with (workdir / f"{name}.log").open("ab") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**cluster.env, **(env or {})}
        )


def leading(proc: subprocess.Popen[bytes], log: Path) -> Callable[[], bool]:
    """True once `proc` leads, or has exited (a crash point at the Lease itself)."""
    return lambda: proc.poll() is not None or "leading as" in log.read_text()


def check_log(path: Path) -> subprocess.CompletedProcess[str]:
    """`continuum check-log FILE`, its exit code and output as the command gives them, run in
    this process (a Python start per call took 1-4 s of a loaded machine)."""
    argv = ["check-log", str(path)]
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main(argv)
    return subprocess.CompletedProcess(["continuum", *argv], code, out.getvalue(), err.getvalue())
