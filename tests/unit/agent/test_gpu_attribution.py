"""The GPU charged is the GPU in use (issue 21, item 5): with `--gpu-claims device-plugin` the
device plugin picks an engine pod's GPU, the node agent reports which GPU its processes run on
(NVML per process, matched to the pod by cgroup), and the operator moves the lease there.

The agent's side runs on a recorded node (tests/fixtures/probes/a100x2-device-plugin-chose-gpu1:
two A100s, Engine ns/coder's llama-server in GPU 1's process list) through the fake pynvml
module; the operator's side is one reconcile pass at a time against snapshots built from the
boards the agent made, with a fake clock.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

import pytest

from continuum_operator.core import gpu_check
from continuum_operator.core.board_change import board_change
from continuum_operator.core.gpu_check import GpuVerdict
from continuum_operator.core.placements import engine_leases
from continuum_operator.core.plan import plan
from continuum_operator.core.pools import Board, BoardLeases
from continuum_operator.kube.base.settings import GpuClaims
from continuum_operator.kube.engines.engine_pass import Memory, Writes
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.state.cache import BoardEntry, Snapshot
from continuum_operator.kube.workloads.engine_objects import LAUNCH_ANNOTATION
from continuum_operator.model.board import MemoryMode, NodeBoard, NodeBoardStatus, PoolKind
from continuum_operator.model.engine import Engine
from tests.support.boards import board_of, fixture
from tests.support.builders import GiB, board_body, engine_body
from tests.support.builders import board as board_of_body
from tests.support.reconcile import NOW, SETTINGS, after, engine_obj, ready, snapshot

NODE = "gpu-a"
FIXTURE = "a100x2-device-plugin-chose-gpu1"


# --- the agent reports which GPU each engine's processes use ------------------------------------


def _no_engine_yet(doc: dict[str, Any]) -> dict[str, Any]:
    """The same node before the engine's pod started: GPU 1 as empty as GPU 0."""
    out = copy.deepcopy(doc)
    devices = out["nvml"]["devices"]
    devices[1] = copy.deepcopy(devices[0])
    out["attribution"]["processes"] = {}
    return out


def _without_hostpid(doc: dict[str, Any]) -> dict[str, Any]:
    """An agent that cannot see the GPU processes' cgroups (no hostPID): nothing attributed."""
    out = copy.deepcopy(doc)
    for entry in out["attribution"]["processes"].values():
        entry["cgroup"] = ""
    return out


def test_the_agent_reports_the_gpu_an_engine_pods_process_runs_on() -> None:
    status = board_of(fixture(FIXTURE))
    assert [(c.kind, c.namespace, c.name, c.gpus) for c in status.consumer_gpus] == [
        ("Engine", "ns", "coder", [1])
    ]
    on_device = [(c.device, c.used_bytes) for c in status.consumers if c.pool is PoolKind.DEVICE]
    assert on_device == [(1, 20 * GiB)]


def test_the_gpu_is_reported_where_nvml_cannot_tell_the_processs_bytes() -> None:
    doc = fixture(FIXTURE)
    [proc] = doc["nvml"]["devices"][1]["nvmlDeviceGetComputeRunningProcesses"]
    proc["usedGpuMemory"] = None  # NVML_VALUE_NOT_AVAILABLE, as some platforms answer
    status = board_of(doc)
    assert not [c for c in status.consumers if c.pool is PoolKind.DEVICE]
    assert [(c.name, c.gpus) for c in status.consumer_gpus] == [("coder", [1])]


def test_processes_of_no_placed_pod_and_unseen_cgroups_are_attributed_to_no_gpu() -> None:
    unplaced = fixture(FIXTURE)
    unplaced["attribution"]["pods"] = []
    assert board_of(unplaced).consumer_gpus == []
    assert board_of(_without_hostpid(fixture(FIXTURE))).consumer_gpus == []


def test_an_engine_moving_to_another_gpu_is_a_board_write() -> None:
    status = board_of(fixture(FIXTURE))
    moved = status.model_copy(
        update={"consumer_gpus": [status.consumer_gpus[0].model_copy(update={"gpus": [0]})]}
    )
    change = board_change(status, moved)
    assert change.write and "consumer_gpus" in change.reason
    assert not board_change(status, status).write


@pytest.mark.parametrize(
    ("gpus", "problem"),
    [([2], "which the board's gpus do not list"), ([1, 0], "ascending"), ([1, 1], "once")],
)
def test_a_board_naming_a_gpu_it_lacks_or_out_of_order_is_refused(
    gpus: list[int], problem: str
) -> None:
    doc = board_of(fixture(FIXTURE)).model_dump(mode="json", by_alias=True)
    doc["consumerGpus"][0]["gpus"] = gpus
    with pytest.raises(ValueError, match=problem):
        NodeBoardStatus.model_validate(doc)


# --- the decision, pure -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("charged", "in_use", "mode", "verdict", "moves"),
    [
        ([0], [], "discrete", GpuVerdict.NOT_ATTRIBUTED, {}),
        ([0], [0], "discrete", GpuVerdict.AS_CHARGED, {}),
        ([0, 1], [1], "discrete", GpuVerdict.AS_CHARGED, {}),  # one of two seen so far
        ([0], [1], "discrete", GpuVerdict.ELSEWHERE, {0: 1}),
        ([0, 1], [1, 3], "discrete", GpuVerdict.ELSEWHERE, {0: 3}),
        ([0, 1], [2, 3], "discrete", GpuVerdict.ELSEWHERE, {0: 2, 1: 3}),
        ([0, 1], [2], "discrete", GpuVerdict.INCOMPLETE, {}),  # where is the other half?
        ([0], [1, 2], "discrete", GpuVerdict.INCOMPLETE, {}),
        ([], [1], "discrete", GpuVerdict.NO_DEVICE_CHARGE, {}),  # no layer on a GPU
        ([0], [1], "unified", GpuVerdict.NO_DEVICE_CHARGE, {}),  # one pool whatever the GPU
        ([0], [1], "unknown", GpuVerdict.NO_DEVICE_CHARGE, {}),  # the device is not charged
    ],
)
def test_a_lease_moves_only_on_a_whole_answer_naming_other_gpus(
    charged: list[int],
    in_use: list[int],
    mode: str,
    verdict: GpuVerdict,
    moves: dict[int, int],
) -> None:
    got = gpu_check.check(charged, in_use, mode)
    assert (got.verdict, got.moves) == (verdict, moves)


def test_moved_charges_keep_every_byte_and_the_order_a_plan_lists_them() -> None:
    got = gpu_check.check([0, 1], [1, 3], MemoryMode.DISCRETE)
    charges = (("host", 5), ("device/0", 7), ("device/1", 7))
    assert gpu_check.moved_charges(charges, got) == (("host", 5), ("device/1", 7), ("device/3", 7))
    same = gpu_check.check([0], [0], MemoryMode.DISCRETE)
    assert gpu_check.moved_charges(charges, same) == charges


def test_a_replan_keeps_the_gpu_an_engine_runs_on_rather_than_choosing_again() -> None:
    body = board_body(
        "discrete",
        [
            {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 4 * GiB},
            {"kind": "device", "device": 0, "capacityBytes": 80 * GiB, "usedBytes": 0},
            {"kind": "device", "device": 1, "capacityBytes": 80 * GiB, "usedBytes": 40 * GiB},
        ],
    )
    b = board_of_body(body)
    spec = Engine.model_validate(engine_body()).spec
    facts = spec.model.facts
    assert facts is not None
    assert plan(b, spec, facts).gpus == (0,)  # the emptier GPU, chosen
    kept = plan(b, spec, facts, on_gpus=(1,))
    assert kept.gpus == (1,) and [p for p, _ in kept.charges] == ["host", "device/1"]
    # A GPU the board lacks, or fewer than the spec asks, is chosen again.
    assert plan(b, spec, facts, on_gpus=(5,)).gpus == (0,)


# --- the operator re-charges ---------------------------------------------------------------------


def _entry(status: NodeBoardStatus, rv: str) -> BoardEntry:
    body = {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "NodeBoard",
        "metadata": {"name": NODE},
        "status": status.model_dump(mode="json", by_alias=True, exclude_none=True),
    }
    return BoardEntry(Board.from_resource(NodeBoard.model_validate(body)), rv)


def _running(settings: Any = SETTINGS) -> tuple[dict[str, Any], Memory, Snapshot, Writes]:
    """Engine ns/coder placed on the two-GPU node before its pod started (charged device/0),
    then its pod ready: its body, memory, snapshot and the pass that confirmed it."""
    before = _entry(board_of(_no_engine_yet(fixture(FIXTURE))), "rv-before")
    snap = snapshot([before])
    w = reconcile(engine_obj(), snap, Memory(), NOW, settings)
    body = after(engine_obj(), w)
    assert body["status"]["plan"]["gpus"] == [0]
    assert [x["pool"] for x in body["status"]["placement"]["pools"]] == ["host", "device/0"]
    snap = replace(snap, deployments={("ns", "coder"): ready(w)})
    w = reconcile(body, snap, w.memory, NOW + 1, settings)
    return after(body, w), w.memory, snap, w


def _with_board(snap: Snapshot, status: NodeBoardStatus, rv: str) -> Snapshot:
    return replace(snap, boards={NODE: _entry(status, rv)})


def _pools(body: dict[str, Any]) -> dict[str, int]:
    return {x["pool"]: x["bytes"] for x in body["status"]["placement"]["pools"]}


def _unavailable(body: dict[str, Any], status: NodeBoardStatus) -> dict[str, int]:
    """Bytes each device pool cannot give another engine: the ledger read off the engine's
    placement against the board the agent measured."""
    entry = _entry(status, "x")
    assert entry.board is not None
    ledger = BoardLeases.of(entry.board, engine_leases([Engine.model_validate(body)]))
    out = {}
    for key in ("device/0", "device/1"):
        left = ledger.available_bytes(key)
        assert left is not None
        out[key] = entry.board.pools[key].capacity_bytes - left
    return out


def test_an_engine_found_on_gpu_1_while_charged_device_0_is_recharged_to_device_1() -> None:
    body, mem, snap, confirmed = _running()
    charged = _pools(body)
    seen = board_of(fixture(FIXTURE))
    snap = _with_board(snap, seen, "rv-seen")
    w = reconcile(body, snap, mem, NOW + 2, SETTINGS)
    moved = after(body, w)
    status = moved["status"]
    # The same bytes, charged where the process is; device/0 charged nothing.
    assert _pools(moved) == {"host": charged["host"], "device/1": charged["device/0"]}
    assert status["placement"]["gpus"] == [1] and status["placement"]["assumed"] is False
    assert status["plan"]["gpus"] == [1]
    assert status["plan"]["charges"] == [
        {"pool": "host", "bytes": charged["host"]},
        {"pool": "device/1", "bytes": charged["device/0"]},
    ]
    [event] = w.events
    assert (event.type, event.reason) == ("Warning", "GpuMismatch")
    assert "GPU 1" in event.message and "device/0 to device/1" in event.message
    # The same launch: the pod is not replaced.
    assert w.deployment is not None and confirmed.deployment is not None
    launch = w.deployment["metadata"]["annotations"][LAUNCH_ANNOTATION]
    assert launch == confirmed.deployment["metadata"]["annotations"][LAUNCH_ANNOTATION]
    # The next decisions keep device/1: a re-plan on the same board, and on a new reading.
    for i, rv in enumerate(("rv-seen", "rv-seen-2")):
        again = reconcile(moved, _with_board(snap, seen, rv), w.memory, NOW + 3 + i, SETTINGS)
        patch = (again.status_patch or {}).get("status", {})
        assert "placement" not in patch and "plan" not in patch
        assert [e.reason for e in again.events] == []


def test_after_the_recharge_the_old_pool_is_free_and_no_byte_is_counted_twice() -> None:
    body, mem, snap, _ = _running()
    seen = board_of(fixture(FIXTURE))
    engine_bytes = _pools(body)["device/0"]
    measured = {p.device: p.used_bytes or 0 for p in seen.pools if p.kind is PoolKind.DEVICE}
    # Charged device/0 while measured on GPU 1: the engine's bytes are unavailable twice.
    assert _unavailable(body, seen) == {"device/0": engine_bytes, "device/1": measured[1]}
    w = reconcile(body, _with_board(snap, seen, "rv-seen"), mem, NOW + 2, SETTINGS)
    moved = after(body, w)
    assert _unavailable(moved, seen) == {
        "device/0": measured[0],  # the driver's own, nothing leased
        "device/1": max(engine_bytes, measured[1]),  # the engine, once
    }
    # A second engine on this node is given the GPU the first one left.
    other = engine_obj("second")
    snap2 = replace(
        _with_board(snap, seen, "rv-seen"),
        engines={("ns", "coder"): moved},
    )
    w2 = reconcile(other, snap2, Memory(), NOW + 3, SETTINGS)
    placed = after(other, w2)
    assert placed["status"]["plan"]["gpus"] == [0]


def test_a_board_without_attribution_changes_nothing() -> None:
    body, mem, snap, _ = _running()
    for status in (
        board_of(_without_hostpid(fixture(FIXTURE))),  # the process seen, its pod not
        board_of(_no_engine_yet(fixture(FIXTURE))),  # no process at all
    ):
        assert status.consumer_gpus == []
        assert not [c for c in status.consumers if c.pool is PoolKind.DEVICE]
        w = reconcile(body, _with_board(snap, status, "rv-none"), mem, NOW + 2, SETTINGS)
        patch = (w.status_patch or {}).get("status", {})
        # (The plan in force records the node's new reading it is confirmed on: core.replan.)
        assert "placement" not in patch and set(patch.get("plan", {})) <= {"reading"}
        assert [e.reason for e in w.events] == []


def test_an_engine_seen_where_it_is_charged_changes_nothing() -> None:
    body, mem, snap, _ = _running()
    seen = board_of(fixture(FIXTURE))
    as_charged = seen.model_copy(
        update={
            "consumer_gpus": [seen.consumer_gpus[0].model_copy(update={"gpus": [0]})],
            "consumers": [c for c in seen.consumers if c.pool is not PoolKind.DEVICE],
        }
    )
    w = reconcile(body, _with_board(snap, as_charged, "rv-0"), mem, NOW + 2, SETTINGS)
    patch = (w.status_patch or {}).get("status", {})
    assert "placement" not in patch and set(patch.get("plan", {})) <= {"reading"}
    assert not w.events


def test_an_engine_not_yet_running_is_not_moved() -> None:
    """Until the pod of the current plan is ready the board may still show the last one's."""
    before = _entry(board_of(_no_engine_yet(fixture(FIXTURE))), "rv-before")
    w = reconcile(engine_obj(), snapshot([before]), Memory(), NOW, SETTINGS)
    body = after(engine_obj(), w)
    snap = _with_board(snapshot([before]), board_of(fixture(FIXTURE)), "rv-seen")
    w = reconcile(body, snap, w.memory, NOW + 1, SETTINGS)
    assert _pools(after(body, w)) == _pools(body)
    assert "GpuMismatch" not in [e.reason for e in w.events]


def test_with_dra_claims_the_scheduler_allocated_the_gpu_and_attribution_moves_nothing() -> None:
    dra = replace(SETTINGS, pods=replace(SETTINGS.pods, gpu_claims=GpuClaims.DRA))
    body, mem, snap, _ = _running(dra)
    w = reconcile(body, _with_board(snap, board_of(fixture(FIXTURE)), "rv-seen"), mem, NOW + 2, dra)
    assert _pools(after(body, w)) == _pools(body)
    assert "GpuMismatch" not in [e.reason for e in w.events]


def test_with_dra_the_claim_selects_the_uuid_the_nodes_board_reports_for_the_planned_gpu() -> None:
    # GPU 0 busy, GPU 1 free: the plan takes GPU 1, and its claim names GPU 1's UUID as the
    # agent read it from NVML (what NVIDIA's DRA driver publishes as `uuid`), not GPU 0's.
    doc = _no_engine_yet(fixture(FIXTURE))
    devices = doc["nvml"]["devices"]
    devices[1]["nvmlDeviceGetUUID"] = "GPU-a1000001-0000-4000-8000-000000000001"
    devices[0]["nvmlDeviceGetMemoryInfo_v2"]["used"] = (
        devices[0]["nvmlDeviceGetMemoryInfo_v2"]["total"] // 2
    )
    dra = replace(SETTINGS, pods=replace(SETTINGS.pods, gpu_claims=GpuClaims.DRA))
    w = reconcile(engine_obj(), snapshot([_entry(board_of(doc), "rv")]), Memory(), NOW, dra)
    assert after(engine_obj(), w)["status"]["plan"]["gpus"] == [1]
    [claim] = [o for o in w.identity if o["kind"] == "ResourceClaimTemplate"]
    [request] = claim["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["selectors"][0]["cel"]["expression"] == (
        'device.attributes["gpu.nvidia.com"].uuid in ["GPU-a1000001-0000-4000-8000-000000000001"]'
    )


def test_two_engines_the_device_plugin_swapped_each_end_charged_where_they_run() -> None:
    doc = _no_engine_yet(fixture(FIXTURE))
    before = _entry(board_of(doc), "rv-before")
    # coder is placed first (device/0, the lower index of two empty GPUs), second beside it.
    w1 = reconcile(engine_obj("coder"), snapshot([before]), Memory(), NOW, SETTINGS)
    coder = after(engine_obj("coder"), w1)
    snap = snapshot([before], engines={("ns", "coder"): coder})
    w2 = reconcile(engine_obj("second"), snap, Memory(), NOW, SETTINGS)
    second = after(engine_obj("second"), w2)
    assert (coder["status"]["plan"]["gpus"], second["status"]["plan"]["gpus"]) == ([0], [1])
    # The device plugin gave each the other's GPU: coder's process on GPU 1, second's on GPU 0.
    seen_doc = fixture(FIXTURE)
    devices = seen_doc["nvml"]["devices"]
    devices[0] = copy.deepcopy(devices[1])
    for proc in devices[0]["nvmlDeviceGetComputeRunningProcesses"]:
        proc["pid"] = 7200
    uid = "6e2d3c4b-5f6a-4b7c-9d8e-0f1a2b3c4d5e"
    seen_doc["attribution"]["processes"]["7200"] = {
        "consumer": None,
        "cgroup": f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-x.scope",
        "rss": 3 * GiB,
    }
    seen_doc["attribution"]["pods"].append(
        {"uid": uid, "kind": "Engine", "namespace": "ns", "name": "second", "working_set": 4 * GiB}
    )
    seen = board_of(seen_doc)
    assert [(c.name, c.gpus) for c in seen.consumer_gpus] == [("coder", [1]), ("second", [0])]
    deployments = {("ns", "coder"): ready(w1), ("ns", "second"): ready(w2)}
    engines = {("ns", "coder"): coder, ("ns", "second"): second}
    for name in ("coder", "second"):  # one loop pass: each decided against the other's status
        key = ("ns", name)
        others = {k: v for k, v in engines.items() if k != key}
        snap = replace(
            _with_board(snapshot([before]), seen, "rv-seen"),
            engines=others,
            deployments=deployments,
        )
        w = reconcile(engines[key], snap, Memory(), NOW + 2, SETTINGS)
        engines[key] = after(engines[key], w)
        assert "GpuMismatch" in [e.reason for e in w.events]
    assert engines[("ns", "coder")]["status"]["plan"]["gpus"] == [1]
    assert engines[("ns", "second")]["status"]["plan"]["gpus"] == [0]
    leases = engine_leases(Engine.model_validate(b) for b in engines.values())
    assert sorted((x.pool, x.consumer) for x in leases if x.pool.startswith("device/")) == [
        ("device/0", "Engine/ns/second"),
        ("device/1", "Engine/ns/coder"),
    ]
