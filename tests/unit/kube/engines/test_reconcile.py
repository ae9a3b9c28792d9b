"""One engine's reconcile passes against snapshots, with a fake clock: placement, the assumed
lease and its release, stale boards, damped relaunches and what status and events say."""

from __future__ import annotations

import copy
import re
from dataclasses import replace
from typing import Any

from continuum_operator.core.damping import Outcome
from continuum_operator.kube.base.settings import (
    GpuSharing,
)
from continuum_operator.kube.engines.engine_pass import Memory, Writes, size_text
from continuum_operator.kube.engines.placed import NODE_GONE_HOLD_SECONDS
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.state.cache import (
    BoardEntry,
    DeploymentEntry,
    JobEntry,
    NodeEntry,
    Snapshot,
)
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ANNOTATION
from continuum_operator.kube.workloads.facts_job import facts_job_name, source_key
from continuum_operator.model.engine import Engine
from tests.support.builders import GiB, board, example
from tests.support.reconcile import (
    NOW,
    SETTINGS,
    after,
    conditions,
    discrete,
    engine_obj,
    own_device_bytes,
    ready,
    snapshot,
    with_file_facts,
)


def test_an_engine_is_placed_on_the_tightest_fresh_board_with_an_assumed_lease() -> None:
    snap = snapshot([discrete("big", 141), discrete("small", 80), discrete("tiny", 8)])
    w = reconcile(engine_obj(), snap, Memory(), NOW, SETTINGS)
    body = after(engine_obj(), w)
    assert body["status"]["placement"]["node"] == "small"
    assert body["status"]["placement"]["assumed"] is True
    assert body["status"]["plan"]["node"] == "small"
    assert conditions(body)["Planned"] == ("True", "Planned")
    assert conditions(body)["Ready"] == ("False", "PodPending")
    assert conditions(body)["Unschedulable"][0] == "False"
    assert w.deployment is not None and w.service is not None
    (placed,) = [e for e in w.events if e.reason == "Placed"]
    # Bytes in the event's words: GiB from 1 GiB up (a small lease in MiB, never "0.00 GiB").
    charged = re.findall(r"(\d+\.\d+) (GiB|MiB)", placed.message)
    assert charged and all(float(n) > 0 for n, _ in charged), placed.message
    assert (size_text(9 * 2**20), size_text(3 * 2**29)) == ("9.0 MiB", "1.50 GiB")


def test_a_second_engine_sees_the_first_ones_assumed_bytes() -> None:
    snap = snapshot([discrete("a", 16), discrete("b", 16)])  # one engine per GPU
    first = after(engine_obj("one", minds={"min": 4, "max": 4}),
                  reconcile(engine_obj("one", minds={"min": 4, "max": 4}), snap, Memory(),
                            NOW, SETTINGS))  # fmt: skip
    snap2 = replace(snap, engines={("ns", "one"): first})
    w = reconcile(engine_obj("two", minds={"min": 4, "max": 4}), snap2, Memory(), NOW, SETTINGS)
    second = after(engine_obj("two"), w)
    assert first["status"]["placement"]["node"] != second["status"]["placement"]["node"]


def test_a_stale_board_takes_no_new_plans_and_the_engine_says_why() -> None:
    snap = snapshot([discrete("only", 80)], stale={"only"})
    w = reconcile(engine_obj(), snap, Memory(), NOW, SETTINGS)
    body = after(engine_obj(), w)
    assert "placement" not in body["status"]
    assert conditions(body)["Unschedulable"] == ("True", "NoFreshBoard")
    msg = next(c["message"] for c in body["status"]["conditions"] if c["type"] == "Unschedulable")
    assert "0/1 nodes fit: 1 with a stale board, its node Lease expired (only)" in msg
    assert w.deployment is None and w.delete_workload
    assert any(e.type == "Warning" and e.reason == "NoFreshBoard" for e in w.events)


def test_an_engine_too_big_for_every_node_is_unschedulable_with_counts_and_the_closest_node() -> (
    None
):
    snap = snapshot([discrete("a", 8, host_gib=8), discrete("b", 8, host_gib=8)])
    huge = engine_obj(minds={"min": 64, "max": 64}, contextTokensPerMind=131072)
    body = after(huge, reconcile(huge, snap, Memory(), NOW, SETTINGS))
    assert conditions(body)["Unschedulable"] == ("True", "InsufficientMemory")
    assert conditions(body)["Planned"] == ("False", "NotPlaced")
    msg = next(c["message"] for c in body["status"]["conditions"] if c["type"] == "Unschedulable")
    assert "0/2 nodes fit: 2 with too little memory (closest: a, " in msg
    assert "MiB short). Closest a: 64 mind(s) of 131072 tokens" in msg  # its reason, in full
    assert "need" in msg and "Lower spec.minds.min" in msg


def test_a_node_selector_that_matches_nothing_is_reported_as_such() -> None:
    snap = snapshot([discrete("a", 80)])
    e = engine_obj(placement={"nodeSelector": {"gpu": "h200"}})
    body = after(e, reconcile(e, snap, Memory(), NOW, SETTINGS))
    assert conditions(body)["Unschedulable"] == ("True", "NoMatchingNode")


def test_an_invalid_spec_that_passes_the_schema_becomes_a_condition_with_its_field_path() -> None:
    e = engine_obj()
    e["spec"]["model"]["facts"]["layerBytes"] = [1, 2, 3]  # 32 layers
    w = reconcile(e, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    body = after(e, w)
    assert conditions(body)["Planned"] == ("False", "InvalidSpec")
    msg = next(c["message"] for c in body["status"]["conditions"] if c["type"] == "Planned")
    assert msg.startswith("spec.model.facts.layerBytes:")
    assert w.deployment is None


def test_the_pod_ready_confirms_the_assumed_lease_and_nothing_else_changes() -> None:
    snap = snapshot([discrete("a", 80)])
    w1 = reconcile(engine_obj(), snap, Memory(), NOW, SETTINGS)
    body = after(engine_obj(), w1)
    snap2 = replace(snap, deployments={("ns", "coder"): ready(w1)})
    w2 = reconcile(body, snap2, w1.memory, NOW + 5, SETTINGS)
    body2 = after(body, w2)
    assert body2["status"]["placement"]["assumed"] is False
    assert conditions(body2)["Ready"] == ("True", "PodReady")
    w3 = reconcile(body2, snap2, w2.memory, NOW + 10, SETTINGS)
    assert w3.status_patch is None  # nothing changed: nothing written
    assert w3.events == ()


def test_an_assumed_lease_whose_pod_never_starts_is_released_and_the_node_backed_off() -> None:
    snap = snapshot([discrete("a", 80), discrete("b", 141)])
    w1 = reconcile(engine_obj(), snap, Memory(), NOW, SETTINGS)
    body = after(engine_obj(), w1)
    assert body["status"]["placement"]["node"] == "a"
    pending = DeploymentEntry(ready(w1).launch, 1, 1, 0, 1, 1)
    snap2 = replace(snap, deployments={("ns", "coder"): pending})
    w2 = reconcile(body, snap2, w1.memory, NOW + 30, SETTINGS)
    assert after(body, w2)["status"]["placement"]["node"] == "a"  # still within the timeout
    w3 = reconcile(body, snap2, w2.memory, NOW + 61, SETTINGS)
    body3 = after(body, w3)
    assert body3["status"]["placement"]["node"] == "b"  # released from a, placed on b
    assert any(e.reason == "PodNeverStarted" for e in w3.events)
    assert "a" in w3.memory.backoff_until


def _running(
    snap: Snapshot, body: dict[str, Any], memory: Memory, at: float
) -> tuple[dict[str, Any], Memory, Writes]:
    w = reconcile(body, snap, memory, at, SETTINGS)
    return after(body, w), w.memory, w


def test_a_board_change_relaunches_once_after_three_readings_then_cools_down() -> None:
    body, mem, w = _running(snapshot([discrete("a", 24, used_gib=15)]), engine_obj(), Memory(), NOW)
    # Running: the board measures the other tenant's 15 GiB and the engine's own bytes.
    own = own_device_bytes(body)
    snap = replace(snapshot([discrete("a", 24, used_gib=15, own=own)]),
                   deployments={("ns", "coder"): ready(w)})  # fmt: skip
    for i in range(5):  # Lease renewals of an unchanged board: the successor is the same plan
        s = replace(snap, leases={"a": replace(snap.leases["a"], resource_version=f"q{i}")})
        body, mem, w = _running(s, body, mem, NOW + 1 + i)
        assert mem.damper.candidate is None
        assert all(e.reason != "Relaunching" for e in w.events)
    minds_before = body["status"]["plan"]["mindsGrantable"]
    assert minds_before < 4
    # The other tenant leaves: room for every mind. Three readings (Lease renewals) later, one
    # relaunch; not before.
    roomy = replace(snapshot([discrete("a", 24, own=own)]), deployments=snap.deployments)
    outcomes = []
    for i in range(1, 6):
        s = replace(roomy, leases={"a": replace(roomy.leases["a"], resource_version=f"r{i}")})
        body, mem, w = _running(s, body, mem, NOW + 10 + i)
        outcomes.append(any(e.reason == "Relaunching" for e in w.events))
        if w.deployment is not None and i == 3:
            s = replace(s, deployments={("ns", "coder"): ready(w)})
            roomy = s
    assert outcomes == [False, False, True, False, False]
    assert body["status"]["relaunches"]["count"] == 1
    assert body["status"]["plan"]["mindsGrantable"] == 4


def test_the_same_reading_seen_again_is_not_more_evidence() -> None:
    body, mem, w = _running(snapshot([discrete("a", 24, used_gib=15)]), engine_obj(), Memory(), NOW)
    own = own_device_bytes(body)
    roomy = replace(snapshot([discrete("a", 24, own=own)]), deployments={("ns", "coder"): ready(w)})
    for i in range(10):
        body, mem, w = _running(roomy, body, mem, NOW + 10 + i)
        assert not any(e.reason == "Relaunching" for e in w.events)
    assert "relaunches" not in body["status"]
    assert conditions(body)["Degraded"] == ("True", "RelaunchDeferred")


def test_a_placed_engine_on_a_stale_board_keeps_its_plan_and_says_so() -> None:
    snap = snapshot([discrete("a", 80)])
    body, mem, w = _running(snap, engine_obj(), Memory(), NOW)
    stale = replace(snapshot([discrete("a", 80, used_gib=40)], stale={"a"}),
                    deployments={("ns", "coder"): ready(w)})  # fmt: skip
    plan_before = body["status"]["plan"]
    for i in range(5):
        body, mem, w = _running(stale, body, mem, NOW + 1 + i)
    assert body["status"]["plan"] == plan_before
    assert conditions(body)["BoardStale"] == ("True", "LeaseExpired")
    assert w.deployment is not None  # the engine keeps running


def test_a_spec_change_on_a_stale_board_relaunches_nothing_until_the_board_is_fresh() -> None:
    sourced = engine_obj()
    sourced["spec"]["model"]["source"] = {"kind": "hostPath", "path": "/models/coder.gguf"}
    sourced["spec"]["model"]["sha256"] = "ab" * 32
    snap = snapshot([discrete("a", 80)])
    body, mem, w = _running(snap, with_file_facts(sourced), Memory(), NOW)
    running = ready(w)
    stale = replace(snapshot([discrete("a", 80)], stale={"a"}),
                    deployments={("ns", "coder"): running})  # fmt: skip
    body, mem, w = _running(stale, body, mem, NOW + 1)
    plan_before = body["status"]["plan"]
    # A new model digest: the engine's command line changes with it, a relaunch.
    body = with_file_facts(changed_spec(body, model={**body["spec"]["model"], "sha256": "cd" * 32}))
    for i in range(3):
        body, mem, w = _running(stale, body, mem, NOW + 2 + i)
        assert w.deployment is None  # what runs stays as it is
        assert not any(e.reason == "Relaunching" for e in w.events)
    assert body["status"]["plan"] == plan_before
    assert "relaunches" not in body["status"]
    assert conditions(body)["Ready"] == ("True", "PodReady")
    assert conditions(body)["BoardStale"] == ("True", "LeaseExpired")
    # The board fresh again: the new spec is applied, by one relaunch.
    fresh = replace(snapshot([discrete("a", 80)]), deployments={("ns", "coder"): running})
    body, mem, w = _running(fresh, body, mem, NOW + 10)
    assert w.deployment is not None
    assert "cd" * 32 in w.deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert w.deployment["metadata"]["annotations"][LAUNCH_ANNOTATION] != running.launch


def test_an_engine_whose_node_was_deleted_is_placed_anew_once_the_node_stays_gone() -> None:
    snap = snapshot([discrete("a", 80), discrete("b", 141)])
    body, mem, w = _running(snap, engine_obj(), Memory(), NOW)
    assert body["status"]["placement"]["node"] == "a"
    snap = replace(snap, deployments={("ns", "coder"): ready(w)})
    body, mem, w = _running(snap, body, mem, NOW + 1)
    assert body["status"]["placement"]["assumed"] is False  # running: no start timeout applies
    # Node a deleted; its board and the agent's Lease linger (nobody deletes them).
    gone = replace(snap, nodes={"b": snap.nodes["b"]})
    for i in range(3):  # within the hold: a Node not yet seen after a restart looks the same
        body, mem, w = _running(gone, body, mem, NOW + 2 + i)
        assert body["status"]["placement"]["node"] == "a"
    body, mem, w = _running(gone, body, mem, NOW + 2 + NODE_GONE_HOLD_SECONDS)
    assert body["status"]["placement"]["node"] == "b"
    assert body["status"]["plan"]["node"] == "b"
    assert {"NodeGone", "Placed"} <= {e.reason for e in w.events}
    assert w.deployment is not None
    # Nowhere left: unschedulable, and the Deployment removed.
    nowhere = replace(snap, nodes={})
    for i in range(2):
        at = NOW + 30 + i * (NODE_GONE_HOLD_SECONDS + 1)
        body, mem, w = _running(nowhere, body, mem, at)
    assert "placement" not in body["status"]
    assert conditions(body)["Unschedulable"] == ("True", "NoMatchingNode")
    assert w.delete_workload


def test_an_engine_seen_before_its_node_keeps_its_placement() -> None:
    snap = snapshot([discrete("a", 80)])
    body, mem, w = _running(snap, engine_obj(), Memory(), NOW)
    snap = replace(snap, deployments={("ns", "coder"): ready(w)})
    body, mem, w = _running(snap, body, mem, NOW + 1)
    # A restarted operator (empty memory) whose Node watch has not delivered yet.
    body, mem, w = _running(replace(snap, nodes={}), body, Memory(), NOW + 2)
    assert body["status"]["placement"]["node"] == "a"
    body, mem, w = _running(snap, body, mem, NOW + 2 + NODE_GONE_HOLD_SECONDS)
    assert body["status"]["placement"]["node"] == "a"
    assert mem.node_gone_since is None


def test_an_unknown_mode_board_sets_memory_mode_unknown() -> None:
    unknown = BoardEntry(board(example("boards", "unknown")), "1")
    snap = snapshot([unknown])
    body = after(engine_obj(), reconcile(engine_obj(), snap, Memory(), NOW, SETTINGS))
    assert conditions(body)["MemoryModeUnknown"] == ("True", "NoMemoryModeReported")
    assert body["status"]["plan"]["governed"] is False


def test_memory_already_measured_is_not_handed_to_a_second_engine_before_the_first_loads() -> None:
    # 24 GiB of 40 measured in use by someone else: room for one engine, not two. The first
    # engine's lease is assumed (its pod has not started), so its bytes are in no measurement.
    snap = snapshot([discrete("a", 40, used_gib=24)])
    first = after(engine_obj("one"), reconcile(engine_obj("one"), snap, Memory(), NOW, SETTINGS))
    assert first["status"]["placement"]["assumed"] is True
    snap2 = replace(snap, engines={("ns", "one"): first})
    second = after(engine_obj("two"), reconcile(engine_obj("two"), snap2, Memory(), NOW, SETTINGS))
    own = sum(p["bytes"] for p in first["status"]["placement"]["pools"] if p["pool"] == "device/0")
    two = second["status"].get("plan") or {}
    device_two = (two.get("bytes") or {}).get("device", {}).get("total", 0)
    # Whatever the second engine got on the GPU fits beside the first and the measured 24 GiB.
    assert 24 * GiB + own + device_two <= 40 * GiB


def sourced(name: str = "coder") -> dict[str, Any]:
    body = engine_obj(name)
    facts = body["spec"]["model"].pop("facts")
    body["spec"]["model"]["source"] = {"kind": "pvc", "claimName": "models", "path": "m.gguf"}
    body["spec"]["model"]["sha256"] = "ab" * 32
    body["_facts"] = facts  # kept aside for the test, not part of the object
    return body


def test_an_engine_with_only_a_model_source_gets_its_facts_read_by_a_job_first() -> None:
    body = sourced()
    body.pop("_facts")
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    after_body = after(body, w)
    assert conditions(after_body)["Planned"] == ("False", "FactsPending")
    assert w.facts_job is not None and w.deployment is None
    assert w.facts_job["spec"]["template"]["spec"]["containers"][0]["command"][:2] == [
        "continuum",
        "facts",
    ]
    assert "placement" not in after_body["status"]


def test_facts_read_from_the_file_are_planned_like_inline_ones() -> None:
    body = sourced()
    facts = body.pop("_facts")

    key = source_key(Engine.model_validate(body))
    body["status"] = {"modelFacts": {"source": key, "facts": facts}}
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    assert conditions(after(body, w))["Planned"] == ("True", "Planned")
    assert w.facts_job is None and w.deployment is not None


def test_facts_of_another_file_are_read_again() -> None:
    body = sourced()
    facts = body.pop("_facts")
    body["status"] = {"modelFacts": {"source": "pvc:models/old.gguf@-", "facts": facts}}
    w = reconcile(body, snapshot([discrete("a", 80)]), Memory(), NOW, SETTINGS)
    assert conditions(after(body, w))["Planned"] == ("False", "FactsPending")
    assert w.facts_job is not None


def test_a_facts_job_that_failed_says_so_and_how_to_fix_it() -> None:

    body = sourced()
    body.pop("_facts")
    name = facts_job_name(Engine.model_validate(body))
    snap = replace(
        snapshot([discrete("a", 80)]),
        jobs={("ns", "coder"): JobEntry(name, "x", succeeded=False, failed=True)},
    )
    w = reconcile(body, snap, Memory(), NOW, SETTINGS)
    got = after(body, w)
    assert conditions(got)["Planned"] == ("False", "FactsMissing")
    msg = next(c["message"] for c in got["status"]["conditions"] if c["type"] == "Planned")
    assert name in msg and "spec.model.facts" in msg
    assert w.facts_job is None  # not started again


def test_an_engine_whose_node_no_longer_holds_it_keeps_running_and_says_why() -> None:
    body, mem, w = _running(snapshot([discrete("a", 24)]), engine_obj(), Memory(), NOW)
    snap = replace(snapshot([discrete("a", 24)]), deployments={("ns", "coder"): ready(w)})
    body, mem, w = _running(snap, body, mem, NOW + 1)
    # Something outside every lease now fills the GPU and most of the host.
    full = replace(
        snapshot([discrete("a", 24, used_gib=24, host_gib=4)]), deployments=snap.deployments
    )
    body, mem, w = _running(full, body, mem, NOW + 2)
    assert conditions(body)["Degraded"] == ("True", "PlanNoLongerFits")
    assert conditions(body)["Ready"] == ("True", "PodReady")
    assert w.deployment is not None
    assert any(e.type == "Warning" and e.reason == "PlanNoLongerFits" for e in w.events)


def test_auto_gpu_sharing_applies_what_the_node_offers() -> None:
    offered = replace(discrete("a", 80), cap_mechanisms=("mps",))
    settings = replace(SETTINGS, pods=replace(SETTINGS.pods, gpu_sharing=GpuSharing.AUTO))
    w = reconcile(engine_obj(), snapshot([offered]), Memory(), NOW, settings)
    enforcement = after(engine_obj(), w)["status"]["enforcement"]
    assert enforcement["gpuSharing"] == "mps" and "mpsPinnedDeviceMemLimit" in enforcement
    plain = reconcile(engine_obj(), snapshot([discrete("a", 80)]), Memory(), NOW, settings)
    assert after(engine_obj(), plain)["status"]["enforcement"]["gpuSharing"] == "none"


def test_a_cap_that_no_longer_applies_leaves_the_status() -> None:
    # The node stops offering MPS: the Engine's status, patched as the API server merges a
    # patch, no longer claims the MPS limit (a merge patch alone would have kept the key).
    offered = replace(discrete("a", 80), cap_mechanisms=("mps",))
    settings = replace(SETTINGS, pods=replace(SETTINGS.pods, gpu_sharing=GpuSharing.AUTO))
    capped = after(
        engine_obj(), reconcile(engine_obj(), snapshot([offered]), Memory(), NOW, settings)
    )
    assert "mpsPinnedDeviceMemLimit" in capped["status"]["enforcement"]
    w = reconcile(capped, snapshot([discrete("a", 80)]), Memory(), NOW + 1, settings)
    enforcement = after(capped, w)["status"]["enforcement"]
    assert enforcement["gpuSharing"] == "none"
    assert "mpsPinnedDeviceMemLimit" not in enforcement


def changed_spec(body: dict[str, Any], **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(body)
    out["spec"].update(spec)
    out["metadata"]["generation"] += 1
    return out


def test_a_spec_change_relaunches_at_once_without_waiting_for_evidence() -> None:
    snap = snapshot([discrete("a", 80)])
    body, mem, w = _running(snap, engine_obj(), Memory(), NOW)
    snap = replace(snap, deployments={("ns", "coder"): ready(w)})
    body, mem, w = _running(snap, body, mem, NOW + 1)
    assert body["status"]["plan"]["mindsGrantable"] == 4
    body = changed_spec(body, minds={"min": 1, "max": 2})
    body, mem, w = _running(snap, body, mem, NOW + 2)
    assert body["status"]["plan"]["mindsGrantable"] == 2
    assert body["status"]["plan"]["specGeneration"] == 2
    assert body["status"]["relaunches"]["count"] == 1
    assert [e.reason for e in w.events].count("Relaunching") == 1
    assert w.deployment is not None
    cmd = w.deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--parallel") + 1] == "2"


def test_a_spec_change_its_node_no_longer_serves_places_the_engine_anew() -> None:
    snap = snapshot([discrete("a", 80), discrete("b", 141)])
    snap = replace(
        snap,
        nodes={"a": NodeEntry({"zone": "x"}, 8), "b": NodeEntry({"zone": "y"}, 8)},
    )
    body, mem, w = _running(snap, engine_obj(), Memory(), NOW)
    assert body["status"]["placement"]["node"] == "a"
    snap = replace(snap, deployments={("ns", "coder"): ready(w)})
    body = changed_spec(body, placement={"nodeSelector": {"zone": "y"}})
    body, mem, w = _running(snap, body, mem, NOW + 1)
    assert body["status"]["placement"]["node"] == "b"
    assert {"Replacing", "Placed"} <= {e.reason for e in w.events}


def test_after_an_operator_restart_the_cooldown_still_holds() -> None:
    body, mem, w = _running(snapshot([discrete("a", 24, used_gib=15)]), engine_obj(), Memory(), NOW)
    own = own_device_bytes(body)
    roomy = replace(snapshot([discrete("a", 24, own=own)]), deployments={("ns", "coder"): ready(w)})
    # A relaunch a minute ago, recorded in status; the operator restarted since (empty memory).
    body["status"]["relaunches"] = {"count": 1, "lastTime": "2027-01-15T07:59:00Z"}
    mem = Memory()
    outcomes = []
    for i in range(5):
        s = replace(roomy, leases={"a": replace(roomy.leases["a"], resource_version=f"r{i}")})
        body, mem, w = _running(s, body, mem, NOW + i)
        outcomes.append(mem.damper.last_outcome)
    assert outcomes[-1] is Outcome.COOLING_DOWN
    assert body["status"]["relaunches"]["count"] == 1
    # Past the cooldown (120 s here) the held evidence relaunches, counted on from status.
    body, mem, w = _running(roomy, body, mem, NOW + 121)
    assert body["status"]["relaunches"]["count"] == 2
