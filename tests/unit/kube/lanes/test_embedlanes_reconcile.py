"""EmbedLanes in the operator's passes: placed beside their engine, charged where they reside,
floors carried from pass to pass, and the engine's plan accounting for the lane's bytes."""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import yaml

from continuum_operator.core.receipts import BufferKind, Receipt, ReceiptBuffer
from continuum_operator.embed.runtime import lane_state_from
from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.merge_patch import merge_patch
from continuum_operator.kube.engines.engine_pass import Memory
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.lanes.lane_pass import LaneWrites, reconcile_lane
from continuum_operator.kube.lanes.loop import LaneLoop
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.state.occupancy import lane_leases_in
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ANNOTATION
from tests.support.builders import GiB, MiB
from tests.support.lanes import (
    SHA,
    SOURCE,
    host_engine,
    host_lane,
    lane_obj,
    placed_engine,
    with_objects,
)
from tests.support.reconcile import (
    NOW,
    SETTINGS,
    after,
    discrete,
    engine_obj,
    snapshot,
)


def lane_after(body: dict[str, Any], writes: LaneWrites) -> dict[str, Any]:
    """The lane as the API server holds it after the status patch (a merge patch)."""
    out: dict[str, Any] = merge_patch(body, writes.status_patch or {})
    return out


def placed(body: dict[str, Any]) -> tuple[str, str]:
    c = next(c for c in body["status"]["conditions"] if c["type"] == "Placed")
    return c["status"], c["reason"]


def test_a_lane_beside_an_engine_on_the_host_is_placed_on_its_node_and_charged_to_the_host() -> (
    None
):
    base = snapshot([discrete("gpu-a", 80)])
    eng = placed_engine(base, offload="none")
    lane = lane_obj()
    snap = with_objects(base, [eng], [lane])
    writes = reconcile_lane(lane, snap, NOW, SETTINGS)
    assert [(e.type, e.reason) for e in writes.events] == [("Normal", "AtMaxContext")]
    out = lane_after(lane, writes)
    assert reconcile_lane(out, with_objects(base, [eng], [out]), NOW, SETTINGS).events == ()
    p = out["status"]["placement"]
    assert p["node"] == "gpu-a" and p["residence"] == "host" and p["verdict"] == "Fits"
    assert [x["pool"] for x in p["pools"]] == ["host"]
    assert p["contextTokens"] == 8192 and p["pools"][0]["bytes"] > 0
    assert placed(out) == ("True", "AtMaxContext")


def test_a_lane_beside_a_gpu_engine_resides_on_the_device_once_the_backend_says_it_offloads() -> (
    None
):
    base = snapshot([discrete("gpu-a", 80)])
    eng = placed_engine(base)
    assert eng["status"]["plan"]["gpuServable"] is True
    lane = lane_obj()
    unreported = lane_after(lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW,
                                                 SETTINGS))  # fmt: skip
    assert unreported["status"]["placement"]["residence"] == "split"
    assert {x["pool"] for x in unreported["status"]["placement"]["pools"]} == {"host", "device/0"}

    eng["status"]["runtime"] = {"gpuOffload": True}
    on_gpu = lane_after(lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW,
                                             SETTINGS))  # fmt: skip
    assert on_gpu["status"]["placement"]["residence"] == "device"
    assert [x["pool"] for x in on_gpu["status"]["placement"]["pools"]] == ["device/0"]

    eng["status"]["runtime"] = {"gpuOffload": False}  # a host-only backend
    on_host = lane_after(lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW,
                                              SETTINGS))  # fmt: skip
    assert on_host["status"]["placement"]["residence"] == "host"
    assert [x["pool"] for x in on_host["status"]["placement"]["pools"]] == ["host"]


def test_a_lane_waits_for_its_engine_to_be_placed() -> None:
    base = snapshot([discrete("gpu-a", 80)])
    lane = lane_obj()
    writes = reconcile_lane(lane, with_objects(base, [], [lane]), NOW, SETTINGS)
    assert [(e.type, e.reason) for e in writes.events] == [("Warning", "EngineNotFound")]
    missing = lane_after(lane, writes)
    assert placed(missing) == ("False", "EngineNotFound")
    assert "placement" not in missing["status"]
    unplaced = engine_obj("coder")
    out = lane_after(lane, reconcile_lane(lane, with_objects(base, [unplaced], [lane]), NOW,
                                          SETTINGS))  # fmt: skip
    assert placed(out) == ("False", "EngineNotPlaced")


def test_floors_are_carried_from_pass_to_pass_and_never_fall() -> None:
    base = snapshot([discrete("gpu-a", 80)])
    eng = placed_engine(base, offload="none")
    lane = lane_obj()
    placed = lane_after(lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW,
                                             SETTINGS))  # fmt: skip
    assert placed["status"]["placement"]["contextTokens"] >= 3000
    placed["status"]["runtime"] = {"largestContextTokens": 3000}  # embedded within its lease
    first = lane_after(placed, reconcile_lane(placed, with_objects(base, [eng], [placed]), NOW,
                                              SETTINGS))  # fmt: skip
    floor = first["status"]["placement"]["pools"][0]["floorBytes"]
    assert floor > 0 and first["status"]["placement"]["floorTokens"] == 3000
    first["status"]["runtime"] = {"largestContextTokens": 100}  # a restarted runtime
    second = lane_after(first, reconcile_lane(first, with_objects(base, [eng], [first]), NOW,
                                              SETTINGS))  # fmt: skip
    assert second["status"]["placement"]["pools"][0]["floorBytes"] == floor
    # And nothing changed, so nothing is written.
    again = reconcile_lane(second, with_objects(base, [eng], [second]), NOW, SETTINGS)
    assert again.status_patch is None and again.events == ()


def test_a_lane_runtime_cannot_raise_its_floor_past_what_it_was_leased() -> None:
    # Its pod writes status.runtime: a claim of a million tokens, with maxContextTokens raised
    # for a pass, was a floor of some 2,600 GiB on a 64 GiB host, kept for good (floors never
    # fall), and an engine of another namespace beside it was refused its plan.
    base = snapshot([discrete("gpu-a", 80, host_gib=64)])
    eng = placed_engine(base, offload="none")
    lane = lane_obj(maxContextTokens=4096)
    honest = lane_after(lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW,
                                             SETTINGS))  # fmt: skip
    leased = honest["status"]["placement"]["contextTokens"]
    forged = copy.deepcopy(honest)
    forged["spec"]["maxContextTokens"] = 1_000_000
    forged["status"]["runtime"] = {"largestContextTokens": 1_000_000, "ready": True}
    out = lane_after(forged, reconcile_lane(forged, with_objects(base, [eng], [forged]), NOW,
                                            SETTINGS))  # fmt: skip
    assert out["status"]["placement"]["floorTokens"] <= leased
    floors = [x["floorBytes"] for x in out["status"]["placement"]["pools"]]
    assert max(floors, default=0) <= 64 * GiB


def test_a_lane_following_its_engine_to_a_smaller_node_brings_no_floor_there() -> None:
    # It embedded 200,000 tokens on a big node; on the new one its pod starts afresh. The old
    # floor was charged there before any fit was tried: 228 GiB on a node of 32.
    small = snapshot([discrete("small", 80, host_gib=32)])
    eng = placed_engine(small, offload="none")
    lane = lane_obj(maxContextTokens=262_144)
    lane["status"] = {
        "runtime": {"largestContextTokens": 200_000, "ready": True},
        "placement": {"node": "big", "verdict": "Fits", "residence": "host",
                      "contextTokens": 262_144, "floorTokens": 200_000,
                      "pools": [{"pool": "host", "bytes": 60 * GiB, "floorBytes": 50 * GiB}]},
    }  # fmt: skip
    out = lane_after(lane, reconcile_lane(lane, with_objects(small, [eng], [lane]), NOW,
                                          SETTINGS))  # fmt: skip
    p = out["status"]["placement"]
    assert p["node"] == "small" and p["floorTokens"] == 0
    engine_host = sum(
        x["bytes"] for x in eng["status"]["placement"]["pools"] if x["pool"] == "host"
    )
    lane_host = sum(max(x["bytes"], x["floorBytes"]) for x in p["pools"] if x["pool"] == "host")
    assert engine_host + lane_host <= 32 * GiB
    # Its new pod calibrates within that lease, not at its predecessor's 200,000 tokens.
    state = lane_state_from(out)
    assert state.largest_embedded_tokens <= state.leased_context_tokens


def test_the_lanes_bytes_are_in_the_node_ledger_and_the_engine_plan_accounts_for_them() -> None:
    base = snapshot([discrete("gpu-a", 80, host_gib=64)])
    eng = placed_engine(base, offload="none")
    lane = lane_obj(maxContextTokens=4096)
    out = lane_after(lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW, SETTINGS))
    lane_bytes = out["status"]["placement"]["pools"][0]["bytes"]
    leases = lane_leases_in({("ns", "lane"): out})
    assert [(x.pool, x.bytes) for x in leases] == [("host", lane_bytes)]
    # A second engine placed on that node is planned beside the lane's bytes.
    other = engine_obj("second", offload="none")
    alone = after(other, reconcile(other, with_objects(base, [eng], []), Memory(), NOW, SETTINGS))
    beside = after(other, reconcile(other, with_objects(base, [eng], [out]), Memory(), NOW,
                                    SETTINGS))  # fmt: skip
    host_alone = alone["status"]["plan"]["budget"]["host"]
    host_beside = beside["status"]["plan"]["budget"]["host"]
    assert host_alone - host_beside == lane_bytes


def test_a_lane_that_the_pool_cannot_hold_is_not_placed_and_over_commits_nothing() -> None:
    base = snapshot([discrete("gpu-a", 80, host_gib=16)])
    eng = placed_engine(base, offload="none", reserveBytes=0)
    held = sum(x["bytes"] for x in eng["status"]["placement"]["pools"] if x["pool"] == "host")
    assert held > 8 * GiB  # the engine leased most of the host
    lane = lane_obj(maxContextTokens=1_000_000)
    out = lane_after(lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW, SETTINGS))
    p = out["status"]["placement"]
    assert p["verdict"] == "Fits" and p["contextTokens"] < 1_000_000
    assert placed(out) == ("True", "LimitedByPool")
    assert held + sum(x["bytes"] for x in p["pools"]) <= 16 * GiB


def test_a_lane_with_its_own_model_goes_to_the_fresh_board_that_holds_the_most_context() -> None:
    facts = engine_obj()["spec"]["model"]["facts"]
    base = snapshot(
        [discrete("small", 80, host_gib=8), discrete("big", 80, host_gib=64),
         discrete("stale", 80, host_gib=512)],
        stale={"stale"},
    )  # fmt: skip
    lane = lane_obj(engine=None, model={"facts": facts}, maxContextTokens=16384)
    out = lane_after(lane, reconcile_lane(lane, with_objects(base, [], [lane]), NOW, SETTINGS))
    p = out["status"]["placement"]
    assert p["node"] == "big" and p["residence"] == "host" and p["contextTokens"] == 16384
    weights = 32 * 200 * MiB + 300 * MiB + 300 * MiB  # tests.support.builders' facts
    assert p["pools"][0]["bytes"] > weights  # its own model's weights are the lane's too
    assert placed(out) == ("True", "AtMaxContext")


def test_a_malformed_lane_is_refused_with_the_field_named() -> None:
    base = snapshot([discrete("gpu-a", 80)])
    lane = lane_obj(engine=None)  # neither engine nor model
    out = lane_after(lane, reconcile_lane(lane, with_objects(base, [], [lane]), NOW, SETTINGS))
    status, reason = placed(out)
    assert (status, reason) == ("False", "InvalidSpec")
    message = next(c for c in out["status"]["conditions"] if c["type"] == "Placed")["message"]
    assert "EmbedLane ns/lane is malformed" in message and "engine" in message


def test_a_host_resident_lane_gets_a_pod_on_its_node_that_may_write_only_its_runtime() -> None:
    lane, writes = host_lane()
    assert writes.no_pod is None and writes.deployment is not None
    dep = writes.deployment
    assert dep["metadata"]["name"] == "embedlane-lane"
    assert dep["metadata"]["ownerReferences"][0]["kind"] == "EmbedLane"
    pod = dep["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-a"]
    container = pod["containers"][0]
    assert container["command"][:4] == ["continuum", "embed", "--lane", "ns/lane"]
    assert container["command"][container["command"].index("--model") + 1] == ("/models/embed.gguf")
    command = container["command"]
    assert command[command.index("--sha256") + 1] == SHA
    # llama.cpp threads are the pod's whole CPUs (the default 2 here).
    assert container["resources"]["limits"]["cpu"] == SETTINGS.pods.cpu == "2"
    assert command[command.index("--threads") + 1] == "2"
    host = lane_after(lane, writes)["status"]["placement"]["pools"][0]["bytes"]
    memory = int(container["resources"]["limits"]["memory"])
    assert memory > host and container["resources"]["requests"] == container["resources"]["limits"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    # ... and a binding to review its callers' tokens (tests/unit/embed/test_embed_auth.py).
    sa, role, binding, _review = writes.identity
    assert pod["serviceAccountName"] == sa["metadata"]["name"] == "embedlane-lane"
    assert {tuple(r["resources"]) for r in role["rules"]} == {("embedlanes",),
                                                               ("embedlanes/status",)}  # fmt: skip
    assert all(r["resourceNames"] == ["lane"] for r in role["rules"])
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def with_receipt(lane: dict[str, Any], writes: LaneWrites, host_bytes: int) -> dict[str, Any]:
    """The lane after its pod calibrated: a receipt at its placed context of `host_bytes`."""
    out = lane_after(lane, writes)
    tokens = out["status"]["placement"]["contextTokens"]
    buffers = [ReceiptBuffer(device="CPU", kind=BufferKind.KV, bytes=host_bytes)]
    r = Receipt(model_sha256=SHA, context_tokens=tokens, llama_build="b1", buffers=buffers)
    out["status"]["runtime"] = {"receipts": [r.model_dump(mode="json", by_alias=True)]}
    return out


def pod_memory(writes: LaneWrites) -> tuple[int, str]:
    assert writes.deployment is not None
    template = writes.deployment["spec"]["template"]
    memory = template["spec"]["containers"][0]["resources"]["limits"]["memory"]
    return int(memory), template["metadata"]["annotations"][LAUNCH_ANNOTATION]


def test_a_calibration_below_the_estimate_shrinks_the_lease_but_does_not_relaunch_the_pod() -> None:
    # Seen on the real node: the first pod's receipt, 60 KB under the estimate, changed its
    # memory limit, so the lane's pod was replaced 2 s after it started (and a client that
    # had reached the first one lost it).
    lane, first = host_lane()
    placement = lane_after(lane, first)["status"]["placement"]
    assert placement["bytesSource"] == "estimate"
    estimated = placement["pools"][0]["bytes"]
    base, eng = host_engine()

    def again(body: dict[str, Any]) -> LaneWrites:
        return reconcile_lane(body, with_objects(base, [eng], [body]), NOW, SETTINGS)

    below = with_receipt(lane, first, estimated - 60_000)
    calibrated = again(below)
    leased = lane_after(below, calibrated)["status"]["placement"]
    assert leased["bytesSource"] == "receipt" and leased["pools"][0]["bytes"] < estimated
    assert pod_memory(calibrated) == pod_memory(first)
    # A receipt above the estimate grows the pod: its limit never falls under what it holds.
    above = with_receipt(lane, first, estimated + 8 * MiB)
    grown = again(above)
    assert lane_after(above, grown)["status"]["placement"]["pools"][0]["bytes"] > estimated
    assert pod_memory(grown)[0] >= pod_memory(first)[0] + 8 * MiB


def test_a_lanes_pod_of_less_than_a_cpu_gets_that_share_and_one_thread() -> None:
    # Seen on the real node: a lane's pod asked for 2 CPUs beside an engine of 1 on a node of 2
    # and stayed Pending; --lane-cpu sizes it, and its threads follow.
    _, writes = host_lane(replace(SETTINGS, pods=replace(SETTINGS.pods, cpu="500m")))
    assert writes.deployment is not None
    container = writes.deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"]
    assert container["resources"]["limits"]["cpu"] == "500m"
    assert container["command"][container["command"].index("--threads") + 1] == "1"


def test_a_lane_on_the_device_or_known_only_by_facts_gets_no_pod_and_says_why() -> None:
    base = snapshot([discrete("gpu-a", 80)])
    facts = engine_obj()["spec"]["model"]["facts"]
    eng = placed_engine(base, model={"source": SOURCE, "facts": facts})
    eng["status"]["runtime"] = {"gpuOffload": True}
    lane = lane_obj()
    on_device = reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW, SETTINGS)
    assert on_device.deployment is None and on_device.no_pod is not None
    assert "GPU" in on_device.no_pod
    inline = placed_engine(base, offload="none")
    only_facts = reconcile_lane(lane, with_objects(base, [inline], [lane]), NOW, SETTINGS)
    assert only_facts.deployment is None and "inline facts" in (only_facts.no_pod or "")


def test_the_example_lanes_are_valid_embed_lanes() -> None:
    from continuum_operator.model.embedlane import EmbedLane
    from tests.support.builders import EXAMPLES

    paths = sorted((EXAMPLES / "embedlanes").glob("*.yaml"))
    assert len(paths) == 2
    for path in paths:
        lane = EmbedLane.model_validate(yaml.safe_load(path.read_text()))
        assert lane.spec.max_context_tokens > 0


def test_a_restarted_operator_still_deletes_the_pod_of_a_lane_that_gets_none() -> None:
    # What was applied lived in memory only: after a restart a lane that turned device-resident
    # or lost its Engine kept its host pod (and its host memory).
    import asyncio

    from tests.support.fakes import FakeKubeApi

    _, writes = host_lane()
    assert writes.deployment is not None
    key = ("ns", "lane")
    path = "/apis/apps/v1/namespaces/ns/deployments/" + writes.deployment["metadata"]["name"]
    none = LaneWrites(status_patch=None, no_pod="a lane residing on the device gets no pod")
    api = FakeKubeApi()
    fake: Any = api.aio
    asyncio.run(
        LaneLoop(fake, OperatorSettings(), Cache(), lambda: NOW).apply_workload(key, writes)
    )
    restarted = LaneLoop(fake, OperatorSettings(), Cache(), lambda: NOW)
    assert asyncio.run(restarted.apply_workload(key, none))
    assert api.deleted == [path]
    assert asyncio.run(restarted.apply_workload(key, none))
    assert api.deleted == [path]  # once: it knows the lane has none now


def test_a_lane_whose_engine_is_deleted_is_not_placed_and_holds_only_its_floors() -> None:
    # It said Placed True (EngineNotFound) and kept its whole lease charged while its pod was
    # deleted (no model to run), and the pod's deletion was put down to inline facts.
    base, eng = host_engine()
    lane = lane_obj()
    placed_lane = lane_after(lane, reconcile_lane(lane, with_objects(base, [eng], [lane]), NOW,
                                                  SETTINGS))  # fmt: skip
    placed_lane["status"]["runtime"] = {"largestContextTokens": 1024}
    held = lane_after(placed_lane, reconcile_lane(placed_lane, with_objects(base, [eng],
                                                  [placed_lane]), NOW, SETTINGS))  # fmt: skip
    floors = {x["pool"]: x["floorBytes"] for x in held["status"]["placement"]["pools"]}
    assert floors and all(floors.values())
    gone = reconcile_lane(held, with_objects(base, [], [held]), NOW, SETTINGS)
    after_gone = lane_after(held, gone)
    assert placed(after_gone) == ("False", "EngineNotFound")
    p = after_gone["status"]["placement"]
    assert p["verdict"] == "Waits" and p["contextTokens"] == 0
    assert {x["pool"]: x["bytes"] for x in p["pools"]} == floors
    assert gone.deployment is None and gone.no_pod == "the lane is not placed"
    # Never embedded: nothing held at all.
    fresh = reconcile_lane(placed_lane, with_objects(base, [], [placed_lane]), NOW, SETTINGS)
    assert lane_after(placed_lane, fresh)["status"].get("placement") is None


def test_a_lane_with_its_own_model_leaves_a_node_deleted_with_its_board() -> None:
    # It stayed Placed on the vanished node for good, its Deployment pinned there, with a fresh
    # board beside it.
    facts = engine_obj()["spec"]["model"]["facts"]
    lane = lane_obj(engine=None, model={"facts": facts}, maxContextTokens=4096)
    old = snapshot([discrete("old", 80, host_gib=64)])
    on_old = lane_after(lane, reconcile_lane(lane, with_objects(old, [], [lane]), NOW, SETTINGS))
    assert on_old["status"]["placement"]["node"] == "old"
    new = snapshot([discrete("new", 80, host_gib=64)])  # "old" deleted, "new" fresh
    out = lane_after(on_old, reconcile_lane(on_old, with_objects(new, [], [on_old]), NOW,
                                            SETTINGS))  # fmt: skip
    assert out["status"]["placement"]["node"] == "new"
    assert placed(out)[0] == "True"
