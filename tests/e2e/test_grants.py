"""Grants on the real control plane: `continuum operator` as a subprocess writes each Engine's
ledger (its GrantLedger's status, a replace conditioned on resourceVersion), projects it into the
Minds, and reclaims through the engine gateway: a real `continuum engine` runtime (llama-server
behind the gateway) run as a local process, reached through `--engine-address`, or, where the test
plays the gateway, releases written into `status.runtime.slotReleases` as the gateway would. Every
run's transition log is judged by `continuum check-log`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.builders import ROOT
from tests.support.cluster import Cluster
from tests.support.crash_scenario import CRASH_POINTS, scenario, settled
from tests.support.crds import crds
from tests.support.grant_ledger import assert_no_grant_doubled, grant_of, ledger, serving, states
from tests.support.grants_operator import check_log, leading, operator, start_operator
from tests.support.kwok_nodes import fresh_gpu_node
from tests.support.local_http import free_port
from tests.support.mind_specs import SLOT_TOKENS, classes, engine, mind
from tests.support.operator_process import stop
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

__all__ = ["classes", "crds"]  # fixtures, used by name

GiB = 2**30


# --------------------------------------------------------------------------------------------
# the engine runtime as a local process, and a mind's turn


@contextmanager
def engine_runtime(
    cluster: Cluster, ns: str, name: str, model: Path, llama: Path, workdir: Path, port: int
) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "continuum_operator.cli", "engine",
        "--engine", f"{ns}/{name}", "--model", str(model), "--no-receipt",
        "--listen", f"127.0.0.1:{port}", "--llama-server", str(llama),
        # This test is of the ledger through a real gateway, the mind named by the header;
        # who may speak for a mind (her token, reviewed) is test_openai's and test_gateway_kube's.
        "--unsafe-trust-mind-header",
        "--", "-c", str(2 * SLOT_TOKENS), "--parallel", "2", "-t", "1",
    ]  # fmt: skip
    log = workdir / "engine.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=out, env=cluster.env)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def open_turn(url: str, mind: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/v1/turns",
        data=b"{}",
        method="POST",
        headers={"X-Continuum-Mind": mind, "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        with err:
            return err.code, json.loads(err.read())


# --------------------------------------------------------------------------------------------
# tests


def test_minds_are_granted_preempted_shrunk_and_freed_through_the_ledger_and_a_real_gateway(
    cluster: Cluster,
    crds: None,
    namespace: str,
    classes: dict[str, str],
    tmp_path: Path,
    llama_server_bin: Path,
    tiny_model: Any,
) -> None:
    tag = f"g{uuid.uuid4().hex[:8]}"
    label = ("continuum.dev/e2e-grants", tag)
    fresh_gpu_node(cluster, tag)
    cluster.apply(engine("coder", tag, label, minds=2), "-n", namespace)
    port = free_port()
    ns = namespace
    log = tmp_path / "operator.log"
    address = f"--engine-address={ns}/coder=http://127.0.0.1:{port}"
    metrics_port = free_port()
    with (
        engine_runtime(
            cluster, ns, "coder", tiny_model.path, llama_server_bin, tmp_path, port
        ) as url,
        operator(cluster, tmp_path, label, address, f"--metrics-port={metrics_port}"),
    ):
        wait_for("the engine serving 2 slots", serving(cluster, ns, 2), log=log)

        # In priority order up to the slots: the mid mind, then the first low one.
        cluster.apply(
            [mind("a", classes["low"]), mind("b", classes["mid"]), mind("c", classes["low"])],
            "-n",
            ns,
        )
        wait_for(
            "a and b granted, c queued",
            lambda: states(cluster, ns) == {"a": "Granted", "b": "Granted", "c": "Queued"},
            log=log,
        )
        assert ledger(cluster, ns)["c"]["reason"] == "PoolFull"
        wait_for("c's projection", lambda: grant_of(cluster, ns, "c").get("state") == "Queued")
        mind_c = cluster.get_json("mind", "c", "-n", ns)
        assert mind_c["status"]["endpoint"] == url  # where she takes turns
        # A mind holding a slot keeps a finalizer (her deletion releases it first); a queued
        # one holds nothing and needs none.
        assert "continuum.dev/grant" not in (mind_c["metadata"].get("finalizers") or [])
        wait_for(
            "a's finalizer",
            lambda: (
                "continuum.dev/grant"
                in (cluster.get_json("mind", "a", "-n", ns)["metadata"].get("finalizers") or [])
            ),
        )
        wait_for("the gateway serving a", lambda: open_turn(url, f"{ns}/a")[0] == 201)
        assert open_turn(url, f"{ns}/c")[0] == 429

        # A higher class preempts the lowest grant: Reclaiming, the gateway cuts and erases,
        # reports the release, and the ledger records Released and requeues her.
        cluster.apply(mind("vip", classes["high"]), "-n", ns)
        wait_for(
            "vip granted after a's release",
            lambda: (
                states(cluster, ns)
                == {"a": "Queued", "b": "Granted", "c": "Queued", "vip": "Granted"}
            ),
            log=log,
        )
        assert open_turn(url, f"{ns}/vip")[0] == 201
        assert open_turn(url, f"{ns}/a")[0] == 429
        assert grant_of(cluster, ns, "a")["state"] == "Queued"

        # A mind asking more than a slot holds is refused, never queued.
        cluster.apply(mind("big", classes["high"], tokens=4 * SLOT_TOKENS), "-n", ns)
        wait_for(
            "big refused", lambda: grant_of(cluster, ns, "big").get("reason") == "ContextTooLarge"
        )
        body = cluster.get_json("mind", "big", "-n", ns)
        too_large = [c for c in body["status"]["conditions"] if c["type"] == "ContextTooLarge"]
        assert too_large[0]["status"] == "True" and str(SLOT_TOKENS) in too_large[0]["message"]
        wait_for("the gateway refusing big", lambda: open_turn(url, f"{ns}/big")[0] == 413)

        # Deleting a granted mind frees her slot (released through the gateway, then her
        # finalizer goes): a, first in line, takes it.
        cluster.kubectl("delete", "mind", "b", "-n", ns, "--wait=false")
        wait_for(
            "b gone",
            lambda: cluster.kubectl("get", "mind", "b", "-n", ns, check=False).returncode != 0,
            log=log,
        )
        wait_for("a regranted", lambda: states(cluster, ns).get("a") == "Granted", log=log)

        # The engine shrinks to one slot: a drain and a relaunch; the lowest is EngineShrunk.
        cluster.kubectl(
            "patch", "engine", "coder", "-n", ns, "--type=merge",
            "-p", json.dumps({"spec": {"minds": {"min": 1, "max": 1}}}),
        )  # fmt: skip
        wait_for("the engine serving 1 slot", serving(cluster, ns, 1), timeout=90, log=log)
        wait_for(
            "vip alone granted",
            lambda: (
                states(cluster, ns)
                == {"a": "Queued", "c": "Queued", "vip": "Granted", "big": "Released"}
            ),
            log=log,
        )
        assert_no_grant_doubled(cluster, ns)
        scraped = metrics(metrics_port)
        assert scraped[("continuum_operator_leader", ())] == 1
        assert scraped[("continuum_grant_reclaims_total", (("reason", "Preempted"),))] >= 1
        assert scraped[("continuum_grant_reclaims_total", (("reason", "EngineShrunk"),))] >= 1
        assert scraped[("continuum_grant_reclaims_total", (("reason", "MindDeleted"),))] >= 1
        held = ("continuum_grants_held", (("engine", "coder"), ("namespace", ns)))
        assert scraped[held] == 1
        # Turn waits, by the reason each mind last waited for: vip waited for a's reclaim, a
        # for b's; with a and b granted at first, at least four waits ended in a grant.
        waits = {
            dict(labels)["reason"]: value
            for (name, labels), value in scraped.items()
            if name == "continuum_grant_wait_seconds_count"
            and dict(labels)["namespace"] == ns
            and dict(labels)["engine"] == "coder"
        }
        assert waits.get("WaitingForReclaim", 0) >= 2, waits
        assert sum(waits.values()) >= 4, waits

    lines = [json.loads(x) for x in (tmp_path / "transitions.jsonl").read_text().splitlines()]
    moves = [
        (x["mind"].split("/")[1], x["from"], x["to"], x["reason"])
        for x in lines
        if x["event"] == "transition"
    ]
    a_moves = [m[1:] for m in moves if m[0] == "a"]
    i = a_moves.index(("Granted", "Reclaiming", "Preempted"))
    assert a_moves[i + 1 : i + 3] == [
        ("Reclaiming", "Released", "SlotReleased"),  # reported by the real gateway
        ("Released", "Queued", "Requeued"),
    ]
    assert ("b", "Granted", "Reclaiming", "MindDeleted") in moves
    assert ("b", "Reclaiming", "Released", "SlotReleased") in moves
    assert ("a", "Granted", "Reclaiming", "EngineShrunk") in moves
    assert ("big", None, "Released", "ContextTooLarge") in moves
    assert [x["phase"] for x in lines if x["event"] == "capacity"][-3:] == [
        "Draining",
        "Relaunching",
        "Serving",
    ] or "Draining" in [x["phase"] for x in lines if x["event"] == "capacity"]
    checked = check_log(tmp_path / "transitions.jsonl")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The operator's /metrics: (sample name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


# --------------------------------------------------------------------------------------------
# crashes and leaders: no gateway here, so reclaims end at the grace deadline (GraceExpired)

SHORT_GRACE = ("--grace", "3")


def crash_points_documented() -> set[str]:
    text = (ROOT / "docs" / "crash-points.md").read_text()
    return {p for p in CRASH_POINTS if f"`{p}`" in text}


def test_every_crash_point_is_documented() -> None:
    from continuum_operator.kube.base.crash import CrashPoint

    assert {p.value for p in CrashPoint} == set(CRASH_POINTS)
    assert crash_points_documented() == set(CRASH_POINTS)


# Each point at its first passage, and two at a later one (`@3`: the third ledger write of the
# crashing operator, within the preemption and the grace expiry rather than the arrivals).
@pytest.mark.parametrize("point", [*CRASH_POINTS, "after-ledger-write@3", "after-log@3"])
def test_the_operator_killed_at_a_crash_point_and_restarted_loses_or_doubles_no_grant(
    cluster: Cluster,
    crds: None,
    namespace: str,
    classes: dict[str, str],
    tmp_path: Path,
    point: str,
) -> None:
    tag = f"k{uuid.uuid4().hex[:8]}"
    label = ("continuum.dev/e2e-grants", tag)
    crash_at = {"CONTINUUM_CRASH_AT": point}
    zero_log, first_log = tmp_path / "zero.log", tmp_path / "first.log"
    with ExitStack() as crashing:
        # The engine placed and serving first, so the crash falls on a step of the minds'
        # ledger. The crashing operator starts as zero's standby: it leads once zero hands the
        # Lease over (a clean stop), its start (seconds of imports on a busy machine) overlapping
        # zero's work.
        with operator(cluster, tmp_path, label, *SHORT_GRACE, name="zero") as zero:
            fresh_gpu_node(cluster, tag)
            cluster.apply(engine("coder", tag, label, minds=2), "-n", namespace)
            wait_for("zero leading", leading(zero, zero_log), log=zero_log)
            first = crashing.enter_context(
                operator(cluster, tmp_path, label, *SHORT_GRACE, env=crash_at, name="first")
            )
            wait_for("the engine serving", serving(cluster, namespace, 2), log=zero_log)
        scenario(cluster, namespace, classes, lambda: first.poll() is not None)
        code = wait_for("the crash", first.poll, timeout=60, log=first_log)
        assert code == 137
        name = point.partition("@")[0]
        assert f"crash point {name} reached" in first_log.read_text()
    # Restarted: it waits out the dead leader's Lease, then finishes what was left.
    with operator(cluster, tmp_path, label, *SHORT_GRACE, name="second"):
        wait_for(
            "the ledger settled",
            settled(cluster, namespace),
            timeout=90,
            log=tmp_path / "second.log",
        )
        assert_no_grant_doubled(cluster, namespace)
    checked = check_log(tmp_path / "transitions.jsonl")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = [json.loads(x) for x in (tmp_path / "transitions.jsonl").read_text().splitlines()]
    last = {}
    for x in lines:
        if x["event"] == "transition":
            last[x["mind"].split("/")[1]] = x["to"]
    # The log ends where the live ledger is: nothing granted that the log does not show.
    assert {m: s for m, s in last.items() if m != "a"} == {
        "b": "Granted", "c": "Queued", "vip": "Granted"
    }  # fmt: skip
    # a: released once deleted, or never seen (deleted before any leader got to her).
    assert last.get("a") in (None, "Released")
    # Every ledger write is in the log once: its steps' seq run without a gap or a repeat, up
    # to the one the Engine's journal holds now.
    seqs = [x["seq"] for x in lines]
    blocks = [q for i, q in enumerate(seqs) if i == 0 or seqs[i - 1] != q]
    journal = cluster.ledger_status(namespace, "coder")["grantStep"]
    assert blocks == list(range(blocks[0], journal["seq"] + 1)), blocks


def test_a_restarted_operator_takes_no_mind_it_has_not_listed_yet_for_deleted(
    cluster: Cluster, crds: None, namespace: str, classes: dict[str, str], tmp_path: Path
) -> None:
    """A clean stop hands the Lease over at once, so the next operator leads within moments of
    starting, before its watches may have every Mind: it lists them first. Stopped by SIGTERM,
    which kopf answers itself, the first stops its loops between passes: none is cancelled
    (kopf cancels what it still waits for 5 s into its shutdown)."""
    tag = f"r{uuid.uuid4().hex[:8]}"
    label = ("continuum.dev/e2e-grants", tag)
    fresh_gpu_node(cluster, tag)
    cluster.apply(engine("coder", tag, label, minds=2), "-n", namespace)
    low = classes["low"]
    with operator(cluster, tmp_path, label, name="one"):
        wait_for("the engine serving", serving(cluster, namespace, 2), log=tmp_path / "one.log")
        cluster.apply([mind(f"m{i}", low) for i in range(6)], "-n", namespace)
        wait_for("two granted, four queued", lambda: sorted(states(cluster, namespace).values())
                 == ["Granted"] * 2 + ["Queued"] * 4)  # fmt: skip
    assert "cancelled, not stopped" not in (tmp_path / "one.log").read_text()
    before = states(cluster, namespace)
    with operator(cluster, tmp_path, label, name="two"):
        wait_for("two leading", lambda: "leading as" in (tmp_path / "two.log").read_text())
        time.sleep(4)
        assert states(cluster, namespace) == before
    text = (tmp_path / "transitions.jsonl").read_text()
    assert "MindDeleted" not in text
    checked = check_log(tmp_path / "transitions.jsonl")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_standby_replica_takes_over_when_the_leader_dies(
    cluster: Cluster, crds: None, namespace: str, classes: dict[str, str], tmp_path: Path
) -> None:
    tag = f"l{uuid.uuid4().hex[:8]}"
    label = ("continuum.dev/e2e-grants", tag)
    fresh_gpu_node(cluster, tag)
    cluster.apply(engine("coder", tag, label, minds=2), "-n", namespace)
    one = start_operator(cluster, tmp_path, label, *SHORT_GRACE, name="one")
    time.sleep(2)  # one leads; two stands by
    two = start_operator(cluster, tmp_path, label, *SHORT_GRACE, name="two")
    try:
        wait_for("the engine serving", serving(cluster, namespace, 2), log=tmp_path / "one.log")
        low = classes["low"]
        cluster.apply([mind("a", low), mind("b", low)], "-n", namespace)
        wait_for(
            "a and b granted",
            lambda: states(cluster, namespace) == {"a": "Granted", "b": "Granted"},
        )
        lease_name = (
            "continuum-operator-"
            + __import__("hashlib").sha256("=".join(label).encode()).hexdigest()[:10]
        )
        holder = cluster.get_json("lease", lease_name, "-n", "default")["spec"]["holderIdentity"]
        assert f"-{one.pid}-" in holder
        assert "continuum.grants" not in (tmp_path / "two.log").read_text()  # it only watched
        one.send_signal(signal.SIGKILL)
        one.wait()
        # The standby takes the Lease once it lapses, and serves what arrives after.
        cluster.apply([mind("c", low), mind("vip", classes["high"])], "-n", namespace)
        wait_for(
            "vip granted by the standby",
            lambda: (
                states(cluster, namespace)
                == {"a": "Granted", "b": "Queued", "c": "Queued", "vip": "Granted"}
            ),
            timeout=60,
            log=tmp_path / "two.log",
        )
        holder = cluster.get_json("lease", lease_name, "-n", "default")["spec"]["holderIdentity"]
        assert f"-{two.pid}-" in holder
        assert_no_grant_doubled(cluster, namespace)
    finally:
        stop(one)
        stop(two)
    checked = check_log(tmp_path / "transitions.jsonl")
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_two_operators_keep_to_their_engines_and_a_relabelled_engine_changes_hands(
    cluster: Cluster, crds: None, namespace: str, classes: dict[str, str], tmp_path: Path
) -> None:
    """Two operators of their own `--engine-selector`: a Mind being deleted on the other's
    Engine keeps her finalizer until her own operator has reclaimed her slot; an Engine
    relabelled from one selection to the other is served by the other from then on, and the
    first forgets it (its selected watch is told by the API server that the Engine left)."""
    tag = f"s{uuid.uuid4().hex[:7]}"
    key = "continuum.dev/e2e-grants"
    a, b = (key, f"{tag}a"), (key, f"{tag}b")
    fresh_gpu_node(cluster, tag)
    cluster.apply(engine("coder", tag, b, minds=2), "-n", namespace)
    low = classes["low"]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    log_a, log_b = tmp_path / "a/transitions.jsonl", tmp_path / "b/transitions.jsonl"
    with (
        operator(cluster, tmp_path / "a", a, name="a"),
        operator(cluster, tmp_path / "b", b, name="b"),
    ):
        wait_for("coder serving", serving(cluster, namespace, 2), log=tmp_path / "b/b.log")
        cluster.apply([mind("m0", low), mind("m1", low)], "-n", namespace)
        both = {"m0": "Granted", "m1": "Granted"}
        wait_for("m0 and m1 granted", lambda: states(cluster, namespace) == both)
        cluster.kubectl("delete", "mind", "m0", "-n", namespace, "--wait=false")
        wait_for("m0 reclaimed by b", lambda: states(cluster, namespace)["m0"] == "Reclaiming")
        time.sleep(4)  # a few of a's passes: each saw her deleted, on an Engine it lacks
        held = cluster.get_json("mind", "m0", "-n", namespace)["metadata"]
        assert held.get("deletionTimestamp") and "continuum.dev/grant" in held["finalizers"]
        assert "m0" not in (log_a.read_text() if log_a.exists() else "")

        cluster.kubectl("label", "engine", "coder", "-n", namespace, "=".join(a), "--overwrite")
        cluster.apply([mind("m2", low)], "-n", namespace)
        # a takes the ledger where b left it: m0's reclaim runs out its grace, then m2 is granted.
        wait_for("m0 released and gone, m2 granted by a",
                 lambda: states(cluster, namespace) == {"m1": "Granted", "m2": "Granted"},
                 timeout=90, log=tmp_path / "a/a.log")  # fmt: skip
        gone = cluster.kubectl("get", "mind", "m0", "-n", namespace, "--ignore-not-found")
        assert not gone.stdout.strip()
        assert f"{namespace}/m2" in log_a.read_text()
        assert f"{namespace}/m2" not in log_b.read_text()  # b no longer decides coder
    checked = check_log(log_b)
    assert checked.returncode == 0, checked.stdout + checked.stderr
