"""The board a node's readings make: memory mode by docs/design.md's definitions, never a guess.

Each fixture under tests/fixtures/probes holds the raw pynvml, psutil, cgroup, NUMA and sysctl
answers of one machine (labelled synthetic or captured); the board is derived from it exactly as
the agent derives it, through the fake pynvml module where NVML is concerned.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from continuum_operator.agent import probe
from continuum_operator.core.nodeboard import board_status
from continuum_operator.core.plan import plan
from continuum_operator.core.pools import Board, BoardLeases
from continuum_operator.core.readings import (
    Addressing,
    CgroupLimit,
    ConsumerRef,
    GpuMemoryStatus,
    GpuProcess,
    GpuReading,
    HostReading,
    MetalReading,
    NodeReadings,
    NumaNode,
    NvmlReading,
)
from continuum_operator.model import Engine
from continuum_operator.model.board import (
    CapMechanism,
    MemoryMode,
    NodeBoard,
    NodeBoardStatus,
    PoolKind,
)
from tests.support.boards import FIXTURES, board_of, fixture
from tests.support.builders import example

GiB = 2**30
MiB = 2**20


def pool(status: NodeBoardStatus, kind: PoolKind, device: int | None = None) -> Any:
    return next(p for p in status.pools if p.kind is kind and p.device == device)


class TestEveryFixture:
    @pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
    def test_is_labelled_synthetic_or_captured_with_where_and_when(self, path: Path) -> None:
        label = json.loads(path.read_text())["label"]
        assert label["source"] in ("synthetic", "captured")
        if label["source"] == "captured":
            assert label["where"] and label["when"]
        else:
            assert label["note"]

    @pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
    def test_makes_a_board_the_api_server_schema_accepts(self, path: Path) -> None:
        status = board_of(json.loads(path.read_text()))
        body = {
            "apiVersion": "continuum.dev/v1alpha1",
            "kind": "NodeBoard",
            "metadata": {"name": path.stem},
            "status": status.model_dump(mode="json", by_alias=True, exclude_none=True),
        }
        assert NodeBoard.model_validate(body).status == status


class TestDiscrete:
    def test_an_x86_gpu_with_hmm_reads_discrete_with_a_coherent_device_pool(self) -> None:
        status = board_of(fixture("x86-h100-hmm"))
        assert status.memory_mode is MemoryMode.DISCRETE
        assert [p.kind for p in status.pools] == [PoolKind.HOST, PoolKind.DEVICE]
        device = pool(status, PoolKind.DEVICE, 0)
        assert device.coherent is True
        assert "HMM" in status.memory_mode_reason

    def test_device_capacity_is_net_of_the_drivers_reserve(self) -> None:
        doc = fixture("x86-h100-hmm")
        v2 = doc["nvml"]["devices"][0]["nvmlDeviceGetMemoryInfo_v2"]
        device = pool(board_of(doc), PoolKind.DEVICE, 0)
        assert device.capacity_bytes == v2["total"] - v2["reserved"]
        assert device.capacity_bytes - device.used_bytes == v2["free"]

    def test_a_captured_h200_reads_discrete_net_of_the_drivers_reserve(self) -> None:
        """Read on a lent H200 by tools/device_probe.py (driver 580.159.04)."""
        doc = fixture("h200-captured")
        status = board_of(doc)
        assert status.memory_mode is MemoryMode.DISCRETE
        v2 = doc["nvml"]["devices"][0]["nvmlDeviceGetMemoryInfo_v2"]
        device = pool(status, PoolKind.DEVICE, 0)
        assert device.capacity_bytes == v2["total"] - v2["reserved"] == 150_109_880_320
        assert status.gpus[0].name == "NVIDIA H200"

    def test_memory_info_v1_serves_where_v2_is_missing(self) -> None:
        doc = fixture("x86-h100-hmm")
        dev = doc["nvml"]["devices"][0]
        v2 = dev["nvmlDeviceGetMemoryInfo_v2"]
        dev["nvmlDeviceGetMemoryInfo_v2"] = {"error": "NVML_ERROR_FUNCTION_NOT_FOUND", "code": 13}
        dev["nvmlDeviceGetMemoryInfo"] = {
            "total": v2["total"],
            "free": v2["free"],
            "used": v2["used"] + v2["reserved"],
        }
        device = pool(board_of(doc), PoolKind.DEVICE, 0)
        assert device.capacity_bytes - device.used_bytes == v2["free"]

    def test_an_eight_gpu_node_has_one_host_pool_and_eight_device_pools(self) -> None:
        status = board_of(fixture("a100x8"))
        assert status.memory_mode is MemoryMode.DISCRETE
        assert [p.device for p in status.pools if p.kind is PoolKind.DEVICE] == list(range(8))
        assert len(status.gpus) == 8

    def test_an_unreported_addressing_mode_leaves_coherence_unknown_not_false(self) -> None:
        status = board_of(fixture("a100x8"))
        assert all(p.coherent is None for p in status.pools if p.kind is PoolKind.DEVICE)

    def test_a_gh200_numa_node_is_counted_once(self) -> None:
        doc = fixture("gh200-numa")
        status = board_of(doc)
        assert status.memory_mode is MemoryMode.DISCRETE
        hbm_node = doc["host"]["numa"]["1"]
        host = pool(status, PoolKind.HOST)
        device = pool(status, PoolKind.DEVICE, 0)
        mem_total = doc["host"]["virtual_memory"]["total"]
        assert host.capacity_bytes == mem_total - hbm_node["MemTotal_kB"] * 1024
        # The HBM appears once: as the device pool, not also inside the host pool.
        assert host.capacity_bytes + hbm_node["MemTotal_kB"] * 1024 == mem_total
        assert device.coherent is True
        assert "NUMA node 1" in status.memory_mode_reason

    def test_a_gpu_numa_node_with_cpus_is_a_socket_and_stays_in_host_memory(self) -> None:
        doc = fixture("gh200-numa")
        doc["host"]["numa"]["1"]["cpulist"] = "72-143"
        host = pool(board_of(doc), PoolKind.HOST)
        assert host.capacity_bytes == doc["host"]["virtual_memory"]["total"]

    def test_a_gpu_whose_memory_fails_is_left_out_and_named(self) -> None:
        doc = fixture("a100x8")
        doc["nvml"]["devices"][5]["nvmlDeviceGetMemoryInfo_v2"] = {
            "error": "NVML_ERROR_GPU_IS_LOST",
            "code": 15,
        }
        doc["nvml"]["devices"][5]["nvmlDeviceGetMemoryInfo"] = {
            "error": "NVML_ERROR_GPU_IS_LOST",
            "code": 15,
        }
        status = board_of(doc)
        assert status.memory_mode is MemoryMode.DISCRETE
        assert 5 not in [p.device for p in status.pools]
        assert "GPU 5 unmeasured (NVML_ERROR_GPU_IS_LOST" in status.memory_mode_reason

    @pytest.mark.parametrize(
        ("field", "value"),
        [("reserved", 80 * 2**30 + 1), ("total", 2**63), ("used", -1)],
        ids=["reserve-over-total", "total-past-int64", "negative-use"],
    )
    def test_a_gpu_whose_memory_reads_out_of_range_is_left_out_not_the_whole_board(
        self, field: str, value: int
    ) -> None:
        # A driver's quirk or a hostile shim on one GPU: before, the board failed validation
        # at every cycle and the Lease was never renewed, so all eight GPUs and the host went
        # stale with it.
        doc = fixture("a100x8")
        v2 = doc["nvml"]["devices"][3]["nvmlDeviceGetMemoryInfo_v2"]
        v2[field] = value if field != "reserved" else int(v2["total"]) + 1
        status = board_of(doc)
        assert status.memory_mode is MemoryMode.DISCRETE
        assert [p.device for p in status.pools if p.kind is PoolKind.DEVICE] == [
            0, 1, 2, 4, 5, 6, 7
        ]  # fmt: skip
        assert "GPU 3 unmeasured (memory reading out of range" in status.memory_mode_reason


class TestUnified:
    def test_a_gb10_whose_memory_nvml_does_not_support_reads_unified(self) -> None:
        doc = fixture("gb10-unified")
        status = board_of(doc)
        assert status.memory_mode is MemoryMode.UNIFIED
        assert [p.kind for p in status.pools] == [PoolKind.UNIFIED]
        vm = doc["host"]["virtual_memory"]
        assert status.pools[0].capacity_bytes == vm["total"]
        assert status.pools[0].used_bytes == vm["total"] - vm["available"]
        assert "Not Supported" in status.memory_mode_reason

    def test_ats_addressing_alone_never_makes_a_board_unified(self) -> None:
        # GB10 and GH200 both report ATS; only the one without a framebuffer is unified.
        assert board_of(fixture("gh200-numa")).memory_mode is MemoryMode.DISCRETE

    def test_an_apple_board_is_one_pool_capped_by_the_working_set_hint(self) -> None:
        doc = fixture("apple-m5-unified")
        status = board_of(doc)
        assert status.memory_mode is MemoryMode.UNIFIED
        assert status.per_process_cap_bytes == 27246 * MiB
        assert status.gpus[0].name == "Apple M5 Max"

    def test_on_the_m5_both_views_of_the_pool_offer_the_same_free_memory(self) -> None:
        """docs/design.md's M5 failure: VRAM read 0 available while RAM read 3,165 MiB."""
        doc = fixture("apple-m5-unified")
        status = board_of(doc)
        board = Board.from_resource(NodeBoard(metadata={"name": "m5"}, status=status))
        ledger = BoardLeases.of(board, [])
        device, host = board.device_view(0), board.host_view()
        assert device is not None and host is not None and device is host
        free = ledger.available_bytes(device.key)
        assert free == doc["host"]["virtual_memory"]["available"]
        assert free == ledger.available_bytes(host.key)
        # and the per-process cap bounds one process, not the pool (rule 2)
        assert status.per_process_cap_bytes is not None
        assert free is not None and free > status.per_process_cap_bytes

    def test_the_m5_board_plans_the_32b_engine_under_metals_cap_with_every_layer_on_the_gpu(
        self,
    ) -> None:
        """The seed settled on a 2.0 GB budget, half the layers on the CPU and 2 minds."""
        status = board_of(fixture("apple-m5-unified"))
        board = Board.from_resource(NodeBoard(metadata={"name": "m5"}, status=status))
        engine = Engine.model_validate(example("engines", "agent-32b"))
        assert engine.spec.model.facts is not None
        result = plan(board, engine.spec, engine.spec.model.facts, BoardLeases.of(board, []))
        assert result.budget.device == status.per_process_cap_bytes
        assert result.layers_on_device == result.total_layers
        assert result.minds_grantable == engine.spec.minds.max

    def test_a_configured_cap_tighter_than_metals_wins(self) -> None:
        status = board_of(fixture("apple-m5-unified"), cap=8 * GiB)
        assert status.per_process_cap_bytes == 8 * GiB

    def test_a_metal_limit_left_at_default_carries_no_cap_and_says_so(self) -> None:
        doc = fixture("apple-m5-unified")
        doc["metal"]["sysctl"]["iogpu.wired_limit_mb"] = "0"
        status = board_of(doc)
        assert status.per_process_cap_bytes is None
        assert "default" in status.memory_mode_reason


class TestUnknown:
    def test_a_machine_without_nvml_is_unknown_with_the_reason(self) -> None:
        status = board_of(fixture("no-nvml"))
        assert status.memory_mode is MemoryMode.UNKNOWN
        assert [p.kind for p in status.pools] == [PoolKind.HOST]
        assert status.memory_mode_reason.startswith("no NVIDIA: ")
        assert "NVML_ERROR_LIBRARY_NOT_FOUND" in status.memory_mode_reason

    def test_a_missing_nvidia_ml_py_is_a_reading_not_a_crash(self) -> None:
        doc = fixture("no-nvml")
        doc["nvml"] = {"import": {"error": "ModuleNotFoundError: No module named 'pynvml'"}}
        status = board_status(probe.readings(doc))
        assert status.memory_mode is MemoryMode.UNKNOWN
        assert "pynvml" in status.memory_mode_reason

    def test_nvml_with_no_gpus_is_unknown(self) -> None:
        doc = fixture("x86-h100-hmm")
        doc["nvml"]["nvmlDeviceGetCount"] = 0
        doc["nvml"]["devices"] = []
        status = board_of(doc)
        assert status.memory_mode is MemoryMode.UNKNOWN
        assert status.memory_mode_reason == "NVML reported no GPUs"

    def test_gpus_that_disagree_on_having_memory_make_the_board_unknown(self) -> None:
        doc = fixture("a100x8")
        for key in ("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo"):
            doc["nvml"]["devices"][7][key] = {"error": "NVML_ERROR_NOT_SUPPORTED", "code": 3}
        status = board_of(doc)
        assert status.memory_mode is MemoryMode.UNKNOWN
        assert "disagree" in status.memory_mode_reason
        assert [p.kind for p in status.pools] == [PoolKind.HOST]


class TestHostPool:
    def test_a_cgroup_limit_below_the_machine_bounds_the_host_pool(self) -> None:
        status = board_of(fixture("no-nvml"))
        host = pool(status, PoolKind.HOST)
        assert host.capacity_bytes == 48 * GiB
        # working set: memory.current less inactive_file
        assert host.used_bytes == 20 * GiB - 4 * GiB
        assert "cgroup limit" in status.memory_mode_reason

    def test_the_machine_running_low_shows_inside_a_cgroup_too(self) -> None:
        doc = fixture("no-nvml")
        doc["host"]["virtual_memory"]["available"] = 10 * GiB
        host = pool(board_of(doc), PoolKind.HOST)
        assert host.capacity_bytes == 48 * GiB
        assert host.used_bytes == 38 * GiB

    def test_no_cgroup_limit_means_the_whole_machine(self) -> None:
        doc = fixture("no-nvml")
        doc["host"]["cgroup"] = []
        host = pool(board_of(doc), PoolKind.HOST)
        assert host.capacity_bytes == doc["host"]["virtual_memory"]["total"]


class TestAttribution:
    def test_a_placed_engines_gpu_memory_is_told_apart_from_external_use(self) -> None:
        status = board_of(fixture("x86-h100-hmm"))
        device = pool(status, PoolKind.DEVICE, 0)
        mine = [c for c in status.consumers if c.pool is PoolKind.DEVICE]
        assert [(c.namespace, c.name, c.used_bytes) for c in mine] == [
            ("team-a", "qwen3-32b", 22 * GiB)
        ]
        # the other process (pid 5151, not in a placed pod) stays external
        assert device.used_bytes - mine[0].used_bytes > 2 * GiB

    def test_a_placed_pods_host_memory_is_its_cgroup_working_set(self) -> None:
        status = board_of(fixture("x86-h100-hmm"))
        host = [c for c in status.consumers if c.pool is PoolKind.HOST]
        assert [c.used_bytes for c in host] == [3 * GiB + 512 * MiB]

    def test_one_engine_on_four_gpus_is_charged_on_each(self) -> None:
        status = board_of(fixture("a100x8"))
        devices = sorted(
            c.device for c in status.consumers if c.pool is PoolKind.DEVICE and c.device is not None
        )
        assert devices == [0, 1, 2, 3]

    def test_on_a_bare_machine_a_marked_process_is_matched_and_charged_to_the_one_pool(
        self,
    ) -> None:
        status = board_of(fixture("gb10-unified"))
        assert [(c.kind, c.name, c.pool, c.used_bytes) for c in status.consumers] == [
            ("Engine", "gpt-oss-120b", PoolKind.UNIFIED, 5 * GiB)
        ]

    def test_attributed_memory_never_exceeds_what_the_pool_measured(self) -> None:
        host = HostReading(total_bytes=10 * GiB, available_bytes=8 * GiB)
        gpu = GpuReading(
            0, "g", "u", GpuMemoryStatus.NOT_SUPPORTED, processes=(GpuProcess(1, 3 * GiB),)
        )
        ref = ConsumerRef("Engine", "ns", "e")
        status = board_status(
            NodeReadings(
                host=host,
                nvml=NvmlReading(True, gpus=(gpu,)),
                gpu_owners={1: ref},
                consumer_host_bytes={ref: 1 * GiB},
            )
        )
        assert sum(c.used_bytes for c in status.consumers) == 2 * GiB

    def test_pods_of_unplaced_workloads_are_not_consumers(self) -> None:
        doc = fixture("x86-h100-hmm")
        doc["attribution"]["pods"] = []
        assert board_of(doc).consumers == []


class TestCapMechanisms:
    def test_a_running_mps_daemon_is_offered(self) -> None:
        status = board_of(fixture("a100x8"))
        assert [m.mechanism for m in status.cap_mechanisms] == [CapMechanism.MPS]
        assert "3110" in status.cap_mechanisms[0].evidence

    def test_a_hami_registration_is_offered(self) -> None:
        status = board_of(fixture("gb10-unified"))
        assert [m.mechanism for m in status.cap_mechanisms] == [CapMechanism.HAMI]

    def test_no_trace_offers_nothing(self) -> None:
        assert board_of(fixture("x86-h100-hmm")).cap_mechanisms == []


def test_a_board_is_a_function_of_its_readings_alone() -> None:
    doc = fixture("gh200-numa")
    assert board_of(copy.deepcopy(doc)) == board_of(doc)


def test_numa_nodes_without_memory_are_ignored() -> None:
    host = HostReading(
        total_bytes=100 * GiB,
        available_bytes=50 * GiB,
        numa_nodes=(NumaNode(0, 100 * GiB, 50 * GiB, 8), NumaNode(2, 0, 0, 0)),
    )
    gpu = GpuReading(
        0, "g", "u", GpuMemoryStatus.MEASURED, capacity_bytes=GiB, used_bytes=0, numa_node=2
    )
    status = board_status(NodeReadings(host=host, nvml=NvmlReading(True, gpus=(gpu,))))
    assert pool(status, PoolKind.HOST).capacity_bytes == 100 * GiB


# --- properties over any readings -----------------------------------------------------------

gpu_readings = st.builds(
    lambda index, memory, capacity, used_fraction, addressing, numa: GpuReading(
        index=index,
        name="g",
        uuid=f"GPU-{index}",
        memory=memory,
        capacity_bytes=capacity if memory is GpuMemoryStatus.MEASURED else None,
        used_bytes=int(capacity * used_fraction) if memory is GpuMemoryStatus.MEASURED else None,
        memory_error="" if memory is GpuMemoryStatus.MEASURED else "NVML_ERROR_X",
        addressing=addressing,
        numa_node=numa,
    ),
    st.just(0),
    st.sampled_from(GpuMemoryStatus),
    st.integers(min_value=GiB, max_value=192 * GiB),
    st.floats(min_value=0, max_value=1),
    st.sampled_from(Addressing),
    st.none() | st.integers(min_value=0, max_value=3),
)


@st.composite
def node_readings(draw: st.DrawFn) -> NodeReadings:
    total = draw(st.integers(min_value=GiB, max_value=4096 * GiB))
    available = draw(st.integers(min_value=0, max_value=total))
    numa = tuple(
        NumaNode(i, t, min(t, f), c)
        for i, (t, f, c) in enumerate(
            draw(
                st.lists(
                    st.tuples(
                        st.integers(min_value=0, max_value=total // 4),
                        st.integers(min_value=0, max_value=total // 4),
                        st.sampled_from([0, 8]),
                    ),
                    max_size=4,
                )
            )
        )
    )
    cgroup = draw(
        st.none()
        | st.builds(
            lambda limit, ws: CgroupLimit("/cg", limit, ws),
            st.integers(min_value=GiB, max_value=8192 * GiB),
            st.integers(min_value=0, max_value=64 * GiB),
        )
    )
    gpus = draw(st.lists(gpu_readings, max_size=8))
    gpus = [replace(g, index=i) for i, g in enumerate(gpus)]
    available_nvml = draw(st.booleans())
    metal = draw(st.none() | st.builds(MetalReading, st.booleans(), chip=st.just("Apple M")))
    return NodeReadings(
        host=HostReading(total, available, cgroup, numa),
        nvml=NvmlReading(available_nvml, "" if available_nvml else "absent", gpus=tuple(gpus)),
        metal=metal,
    )


class TestAnyReadings:
    @given(node_readings())
    def test_make_a_valid_board_whose_mode_follows_the_definitions(self, r: NodeReadings) -> None:
        status = board_status(r)  # the model's own validators run here
        NodeBoardStatus.model_validate(status.model_dump())
        statuses = {g.memory for g in r.nvml.gpus}
        metal = r.metal is not None and r.metal.available
        if status.memory_mode is MemoryMode.UNIFIED:
            assert metal or (
                r.nvml.available
                and GpuMemoryStatus.NOT_SUPPORTED in statuses
                and GpuMemoryStatus.MEASURED not in statuses
            )
        elif status.memory_mode is MemoryMode.DISCRETE:
            assert not metal and r.nvml.available
            assert GpuMemoryStatus.NOT_SUPPORTED not in statuses
            measured = [g.index for g in r.nvml.gpus if g.memory is GpuMemoryStatus.MEASURED]
            assert [p.device for p in status.pools if p.kind is PoolKind.DEVICE] == measured
        else:
            assert status.memory_mode_reason
            assert [p.kind for p in status.pools] == [PoolKind.HOST]
        host = status.pools[0]
        assert host.capacity_bytes <= r.host.total_bytes

    @given(node_readings(), st.sampled_from(Addressing))
    def test_the_addressing_mode_never_changes_the_memory_mode(
        self, r: NodeReadings, addressing: Addressing
    ) -> None:
        other = replace(
            r,
            nvml=replace(
                r.nvml, gpus=tuple(replace(g, addressing=addressing) for g in r.nvml.gpus)
            ),
        )
        assert board_status(other).memory_mode is board_status(r).memory_mode
