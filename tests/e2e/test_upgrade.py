"""An upgrade that cannot break serving, on the real control plane (docs/operator.md, "Upgrades").

The seed's failure: a new planner gave a 2 GB plan where 28 GB had been planned on the same
machine, and the engine was relaunched 13 times in 4 minutes. Here two engines run on KWOK nodes
whose boards the test keeps still, as the agent would while nothing changes; then the operator
is replaced by one whose planner shrinks every plan to `spec.minds.min` (the operator's own
planner, wrapped: `NEW_PLANNER`, test-only). Before it starts, `continuum plan --replay` with
that planner lists both engines as held; once it runs, Lease renewals come and go (what damping
counts as readings) and it holds both with `PlanHeld`, relaunching neither; the plan a person
accepts by the Engine's annotation relaunches, and only that one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster
from tests.support.crds import crds
from tests.support.engine_status import condition, get_engine
from tests.support.kwok_nodes import discrete_status, gpu_node, renew
from tests.support.local_http import free_port
from tests.support.operator_process import engine as operator_engine
from tests.support.operator_process import stop
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

__all__ = ["crds"]  # a fixture, used by name

ACCEPT = "continuum.dev/accept-plan"
READINGS = 3
LABEL = ("continuum.dev/e2e-upgrade", uuid.uuid4().hex[:10])

#: `continuum` with its planner changed to give every engine its fewest minds: wherever a module
#: of the operator holds the planner (`core.replan` re-plans running engines), it gets this one.
NEW_PLANNER = """
import sys
import continuum_operator.cli as cli
import continuum_operator.cli.command  # every subcommand's module, so each `plan` is patched
import continuum_operator.kube.process.run
from continuum_operator.core import plan as core_plan

original = core_plan.plan

def shrinking(board, spec, facts, *args, **kw):
    minds = spec.minds.model_copy(update={"max": spec.minds.min})
    return original(board, spec.model_copy(update={"minds": minds}), facts, *args, **kw)

for name, module in list(sys.modules.items()):
    if name.startswith("continuum_operator.") and name != "continuum_operator.core.plan":
        if getattr(module, "plan", None) is original:
            module.plan = shrinking
sys.exit(cli.main(sys.argv[1:]))
"""


def engine(name: str, tag: str) -> dict[str, Any]:
    """The placing operator's Engine (tests/support/operator_process.py: up to 8 minds of 16,384
    tokens), served by this module's operator."""
    body = operator_engine(name, tag)
    body["metadata"]["labels"] = dict([LABEL])
    return body


def start(cluster: Cluster, log: Path, *wrapper: str) -> subprocess.Popen[bytes]:
    """`continuum operator`, as it is or (`wrapper`: `-c NEW_PLANNER`) with the new planner."""
    cmd = [
        sys.executable, *(wrapper or ("-m", "continuum_operator.cli")), "operator",
        "--kubeconfig", str(cluster.kubeconfig),
        "--resync", "1",
        "--damping-readings", str(READINGS),
        "--relaunch-cooldown", "900",
        "--engine-image", "continuum-engine:e2e",
        "--metrics-port", str(free_port()),
        "--engine-selector", "=".join(LABEL),
        "--leader-lease-duration", "6",
        "--leader-renew", "1",
    ]  # fmt: skip
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env)
    time.sleep(3)  # a bad flag exits within the imports' time
    if proc.poll() is not None:
        pytest.fail(f"continuum operator exited at once:\n{log.read_text()}", pytrace=False)
    return proc


@pytest.fixture
def running(cluster: Cluster, crds: None, tmp_path: Path) -> Iterator[list[Any]]:
    """Whatever operators a test starts, stopped when it ends."""
    procs: list[Any] = []
    yield procs
    for proc in procs:
        stop(proc)


def launch_of(cluster: Cluster, ns: str, name: str) -> str:
    dep = cluster.get_json("deployment", name, "-n", ns)
    return str(dep["metadata"]["annotations"]["continuum.dev/launch"])


def test_a_new_planner_on_unchanged_boards_holds_every_running_engine_and_relaunches_none(
    cluster: Cluster, namespace: str, tmp_path: Path, running: list[Any]
) -> None:
    tag = f"u{uuid.uuid4().hex[:6]}"
    names = ["alpha", "beta"]
    nodes = [gpu_node(cluster, f"{tag}-{n}", discrete_status(80, 0.5)) for n in names]
    log = tmp_path / "operator.log"
    running.append(start(cluster, log))
    cluster.apply([engine(n, f"{tag}-{n}") for n in names], "-n", namespace)

    def with_condition(name: str, kind: str) -> Callable[[], dict[str, Any] | None]:
        def probe() -> dict[str, Any] | None:
            body = get_engine(cluster, namespace, name)
            c = condition(body, kind)
            return body if c is not None and c["status"] == "True" else None

        return probe

    before = {n: wait_for(f"{n} ready", with_condition(n, "Ready"), log=log) for n in names}
    assert [before[n]["status"]["plan"]["node"] for n in names] == nodes
    assert {b["status"]["plan"]["mindsGrantable"] for b in before.values()} == {8}
    launches = {n: launch_of(cluster, namespace, n) for n in names}
    time.sleep(3)  # a few passes on the confirmed engines: nothing left to write

    # Before the upgrade: the new `continuum` replays every live Engine on its board.
    engines_file = tmp_path / "engines.yaml"
    engines_file.write_text(
        cluster.kubectl("get", "engines", "-A", "-l", "=".join(LABEL), "-o", "yaml").stdout
    )
    boards = tmp_path / "boards"
    boards.mkdir()
    (boards / "boards.yaml").write_text(
        cluster.kubectl("get", "nodeboards", *nodes, "-o", "yaml").stdout
    )
    replay = subprocess.run(
        [sys.executable, "-c", NEW_PLANNER, "plan", "--replay", "--engines", str(engines_file),
         "--boards", str(boards), "-o", "json"],
        capture_output=True, text=True, env=cluster.env, check=False, timeout=120,
    )  # fmt: skip
    assert replay.returncode == 3, replay.stderr
    rows = {r["engine"]: r for r in json.loads(replay.stdout)["engines"]}
    assert set(rows) == {f"{namespace}/{n}" for n in names}
    for row in rows.values():
        assert row["verdict"] == "Held", row
        assert (row["was"]["mindsGrantable"], row["now"]["mindsGrantable"]) == (8, 1)

    # The upgrade: the old operator goes, the new one comes.
    stop(running.pop())
    running.append(start(cluster, log, "-c", NEW_PLANNER))
    for _ in range(READINGS + 3):  # Lease renewals: each a new reading for damping
        for node in nodes:
            renew(cluster, node)
        time.sleep(2)

    for n in names:
        body = wait_for(f"{n} held", with_condition(n, "PlanHeld"), log=log)
        held = condition(body, "PlanHeld")
        assert held is not None and held["reason"] == "CodeChanged"
        assert "1 minds" in held["message"] and "8 minds" in held["message"]
        assert f"{ACCEPT}={rows[f'{namespace}/{n}']['planId']}" in held["message"]
        assert body["status"]["plan"]["mindsGrantable"] == 8
        assert "relaunches" not in body["status"]
        assert launch_of(cluster, namespace, n) == launches[n]
        assert condition(body, "Ready")["status"] == "True"  # type: ignore[index]

    # A person accepts alpha's new plan: alpha relaunches with it; beta stays as it was.
    cluster.kubectl(
        "annotate", "engine", "alpha", "-n", namespace, "--overwrite",
        f"{ACCEPT}={rows[f'{namespace}/alpha']['planId']}",
    )  # fmt: skip

    def alpha_shrunk() -> bool:
        return bool(
            get_engine(cluster, namespace, "alpha")["status"]["plan"]["mindsGrantable"] == 1
        )

    wait_for("alpha relaunched with the accepted plan", alpha_shrunk, log=log)
    assert launch_of(cluster, namespace, "alpha") != launches["alpha"]
    beta = get_engine(cluster, namespace, "beta")
    assert beta["status"]["plan"]["mindsGrantable"] == 8
    assert launch_of(cluster, namespace, "beta") == launches["beta"]
