"""The probes' shells: NVML asked through pynvml's API, host files read, processes matched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.agent import attribution, host, metal, nvml, probe
from continuum_operator.core.readings import Addressing, GpuMemoryStatus
from continuum_operator.testing.fake_nvml import FakeNvml, UnrecordedCall
from tests.support.builders import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "probes"
GiB = 2**30


def fixture(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((FIXTURES / f"{name}.json").read_text())
    return doc


class TestNvmlProbe:
    @pytest.mark.parametrize("path", sorted(FIXTURES.glob("*.json")), ids=lambda p: p.stem)
    def test_reading_a_recorded_machine_reproduces_its_recording(self, path: Path) -> None:
        raw = json.loads(path.read_text())["nvml"]
        if "import" in raw:
            pytest.skip("recorded where pynvml did not import: nothing to call")
        assert nvml.read_raw(FakeNvml(raw)) == raw

    def test_memory_info_v2_is_asked_through_pynvmls_version_argument(self) -> None:
        fake = FakeNvml(fixture("x86-h100-hmm")["nvml"])
        nvml.read_raw(fake)
        assert "nvmlDeviceGetMemoryInfo_v2" in fake.calls
        assert "nvmlDeviceGetMemoryInfo" not in fake.calls  # v1 only where v2 fails
        assert fake.calls[-1] == "nvmlShutdown"

    def test_a_probe_asking_what_the_machine_never_said_fails_loudly(self) -> None:
        raw = fixture("x86-h100-hmm")["nvml"]
        del raw["devices"][0]["nvmlDeviceGetNumaNodeId"]
        with pytest.raises(UnrecordedCall):
            nvml.read_raw(FakeNvml(raw))

    def test_a_missing_library_is_no_nvidia_not_a_crash(self) -> None:
        reading = nvml.parse(nvml.read_raw(FakeNvml(fixture("no-nvml")["nvml"])))
        assert not reading.available
        assert "NVML_ERROR_LIBRARY_NOT_FOUND" in reading.reason

    def test_a_missing_nvidia_ml_py_is_no_nvidia(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setitem(sys.modules, "pynvml", None)
        raw = nvml.read_raw()
        assert "import" in raw
        assert not nvml.parse(raw).available

    def test_this_machine_without_a_gpu_reads_no_nvidia(self) -> None:
        if Path("/dev/nvidiactl").exists():
            pytest.skip("this machine has an NVIDIA driver")
        reading = nvml.parse(nvml.read_raw())
        assert not reading.available and reading.reason

    def test_parse_keeps_addressing_numa_and_processes(self) -> None:
        reading = nvml.parse(fixture("gh200-numa")["nvml"])
        (gpu,) = reading.gpus
        assert gpu.addressing is Addressing.ATS
        assert gpu.numa_node == 1
        assert gpu.memory is GpuMemoryStatus.MEASURED
        assert [p.pid for p in gpu.processes] == [8080]

    def test_a_driver_older_than_nvidia_ml_py_is_a_gpu_read_by_v2_not_a_failed_cycle(
        self,
    ) -> None:
        # nvidia-ml-py's unversioned process lists call `_v3` and raise NVMLLibraryMismatchError
        # (not an NVMLError) where the driver's library lacks it: kept as that GPU's answer,
        # `_v2` asked instead, and the rest of the GPU read.
        raw = fixture("x86-h100-hmm")["nvml"]
        dev = raw["devices"][0]
        listed = dev["nvmlDeviceGetComputeRunningProcesses"]
        dev["nvmlDeviceGetComputeRunningProcesses"] = {
            "error": "NVMLLibraryMismatchError",
            "code": None,
            "detail": "Unversioned function called and the pyNVML version does not match",
        }
        dev["nvmlDeviceGetComputeRunningProcesses_v2"] = listed
        assert nvml.read_raw(FakeNvml(raw)) == raw
        (gpu,) = nvml.parse(raw).gpus
        assert gpu.memory is GpuMemoryStatus.MEASURED
        assert [p.pid for p in gpu.processes] == [4242, 5151]
        assert probe.gpu_pids(raw) == [4242, 5151]

    def test_mps_clients_are_listed_by_their_own_call(self) -> None:
        raw = fixture("x86-h100-hmm")["nvml"]
        dev = raw["devices"][0]
        dev["nvmlDeviceGetMPSComputeRunningProcesses"] = [
            {"pid": 7070, "usedGpuMemory": 3 * GiB, "gpuInstanceId": 4294967295,
             "computeInstanceId": 4294967295}
        ]  # fmt: skip
        fake = FakeNvml(raw)
        assert nvml.read_raw(fake) == raw
        assert "nvmlDeviceGetMPSComputeRunningProcesses" in fake.calls
        (gpu,) = nvml.parse(raw).gpus
        assert 7070 in [p.pid for p in gpu.processes]
        assert 7070 in probe.gpu_pids(raw)

    def test_a_process_listed_as_compute_and_graphics_is_counted_once(self) -> None:
        raw = fixture("x86-h100-hmm")["nvml"]
        dev = raw["devices"][0]
        dev["nvmlDeviceGetGraphicsRunningProcesses"] = [
            dict(dev["nvmlDeviceGetComputeRunningProcesses"][0])
        ]
        (gpu,) = nvml.parse(raw).gpus
        assert [p.pid for p in gpu.processes] == [4242, 5151]
        assert gpu.processes[0].used_bytes == 22 * GiB


class TestHostProbe:
    def test_this_machines_memory_is_read(self) -> None:
        reading = host.parse(host.read_raw())
        assert 0 < reading.available_bytes <= reading.total_bytes

    def test_the_tightest_cgroup_level_bounds_the_pool(self, tmp_path: Path) -> None:
        root = tmp_path / "cgroup"
        leaf = root / "kubepods.slice" / "agent"
        leaf.mkdir(parents=True)
        (root / "kubepods.slice" / "memory.max").write_text(f"{8 * GiB}\n")
        (root / "kubepods.slice" / "memory.current").write_text(f"{3 * GiB}\n")
        (root / "kubepods.slice" / "memory.stat").write_text(
            f"anon 1\ninactive_file {GiB}\nactive_file 2\n"
        )
        (leaf / "memory.max").write_text("max\n")
        (leaf / "memory.current").write_text("4096\n")
        raw = host.read_raw(leaf, cgroup_root=root, numa_root=tmp_path / "none")
        cg = host.parse(raw).cgroup
        assert cg is not None
        assert (cg.limit_bytes, cg.working_set_bytes) == (8 * GiB, 2 * GiB)
        assert cg.path.endswith("kubepods.slice")

    def test_cgroup_v1s_huge_no_limit_is_no_limit(self, tmp_path: Path) -> None:
        (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        (tmp_path / "memory.usage_in_bytes").write_text("100\n")
        raw = host.read_raw(tmp_path, cgroup_root=tmp_path, numa_root=tmp_path / "none")
        assert host.parse(raw).cgroup is None

    def test_numa_nodes_are_read_with_their_cpus(self, tmp_path: Path) -> None:
        for node, cpus, total in (("node0", "0-3,8-11", 1000), ("node1", "", 500)):
            (tmp_path / node).mkdir()
            (tmp_path / node / "cpulist").write_text(cpus + "\n")
            (tmp_path / node / "meminfo").write_text(
                f"Node {node[-1]} MemTotal:       {total} kB\nNode {node[-1]} MemFree:  10 kB\n"
            )
        raw = host.read_raw(tmp_path / "none", cgroup_root=tmp_path, numa_root=tmp_path)
        nodes = host.parse(raw).numa_nodes
        assert [(n.id, n.cpus, n.total_bytes) for n in nodes] == [
            (0, 8, 1000 * 1024),
            (1, 0, 500 * 1024),
        ]

    def test_the_agents_own_cgroup_is_found_for_v2_and_v1(self, tmp_path: Path) -> None:
        v2 = tmp_path / "v2"
        v2.write_text("0::/system.slice/agent.service\n")
        assert host.own_cgroup_dir(v2, tmp_path) == tmp_path / "system.slice/agent.service"
        v1 = tmp_path / "v1"
        v1.write_text("4:cpu,cpuacct:/x\n9:memory:/kubepods/pod1/abc\n")
        assert host.own_cgroup_dir(v1, tmp_path) == tmp_path / "memory/kubepods/pod1/abc"


class TestMetalProbe:
    def test_linux_is_not_metal(self) -> None:
        assert not metal.parse(metal.read_raw("Linux", "x86_64")).available

    def test_an_intel_mac_reports_no_gpu_memory(self) -> None:
        raw = {"system": "Darwin", "machine": "x86_64", "sysctl": {"hw.optional.arm64": "0"}}
        assert not metal.parse(raw).available

    def test_apple_silicon_reads_its_wired_limit(self) -> None:
        reading = metal.parse(fixture("apple-m5-unified")["metal"])
        assert reading.available and reading.wired_limit_bytes == 27246 * 2**20


class TestAttributionProbe:
    @pytest.mark.parametrize(
        "line",
        [
            "0::/kubepods.slice/kubepods-burstable.slice/"
            "kubepods-burstable-pod5f0c8a3e_2b1d_4c6e_9a7f_1e2d3c4b5a69.slice/cri-containerd-1.scope",
            "0::/kubepods.slice/kubepods-pod5f0c8a3e_2b1d_4c6e_9a7f_1e2d3c4b5a69.slice/x",
            "12:memory:/kubepods/besteffort/pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69/abc",
            # A kubelet with a cgroup root of its own (kind), and as seen from a cgroup namespace.
            "0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
            "kubelet-kubepods-besteffort-pod5f0c8a3e_2b1d_4c6e_9a7f_1e2d3c4b5a69.slice/cri-1.scope",
            "0::/../../kubepods/pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69/abc",
            # As containerd's CRI shows them to the agent in its own cgroup namespace on cgroup
            # v2 (paths relative to the agent container's cgroup): a guaranteed pod, a pod of
            # the agent's own QoS class, one of another class, under systemd and cgroupfs.
            "0::/../../../kubepods-pod5f0c8a3e_2b1d_4c6e_9a7f_1e2d3c4b5a69.slice/"
            "cri-containerd-0a1b.scope",
            "0::/../../kubepods-burstable-pod5f0c8a3e_2b1d_4c6e_9a7f_1e2d3c4b5a69.slice/"
            "cri-containerd-0a1b.scope",
            "0::/../../../kubepods-besteffort.slice/"
            "kubepods-besteffort-pod5f0c8a3e_2b1d_4c6e_9a7f_1e2d3c4b5a69.slice/cri-containerd-1.scope",
            "0::/../../../pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69/0a1b",
            "0::/../../../burstable/pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69/0a1b",
            "0::/../../pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69/0a1b",
        ],
    )
    def test_a_pods_uid_is_read_from_any_cgroup_layout(self, line: str) -> None:
        assert attribution.pod_uid(line) == "5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69"

    @pytest.mark.parametrize(
        "line",
        [
            "0::/user.slice/user-1000.slice/session-4.scope",
            # A user's own units named after an engine pod (its UID is on its node's NodeBoard):
            # not the kubelet's pod cgroup, whatever the name says.
            "0::/user.slice/user-1000.slice/user@1000.service/app.slice/"
            "pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69.scope",
            "0::/user.slice/user-1000.slice/user@1000.service/kubepods.slice/"
            "kubepods-pod5f0c8a3e_2b1d_4c6e_9a7f_1e2d3c4b5a69.slice/x.scope",
            "0::/system.slice/pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69/x",
            "0::/kubepods.slice/not-a-pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69-dir/x",
            # The same, as the agent reads them from its cgroup namespace: the climb reaches
            # the root and names the user's (or a service's) levels in full.
            "0::/../../../../user.slice/user-1000.slice/user@1000.service/app.slice/"
            "pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69",
            "0::/../../../../user.slice/user-1000.slice/user@1000.service/kubepods.slice/"
            "kubepods-pod5f0c8a3e_2b1d_4c6e_9a7f_1e2d3c4b5a69.slice/x.scope",
            "0::/../../../../system.slice/pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69/x",
            "0::/../../../../system.slice/x.service/burstable/"
            "pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69/x",
            "0::/../x.scope/pod5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69",
        ],
    )
    def test_a_process_outside_the_kubelets_pod_cgroups_has_no_pod(self, line: str) -> None:
        assert attribution.pod_uid(line) is None

    def test_a_process_marked_with_its_consumer_is_matched_on_a_bare_machine(self) -> None:
        # A real child process carrying the marker in its environment, as `continuum engine`
        # would pass it to llama-server.
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(30)"],
            env={**os.environ, attribution.CONSUMER_ENV: "Engine/default/test-engine"},
        )
        try:
            raw = attribution.read_raw([], scan_environ=True)
        finally:
            child.kill()
            child.wait()
        owners, host_bytes = attribution.owners(raw)
        assert owners.get(child.pid) is not None
        assert owners[child.pid].name == "test-engine"
        assert sum(host_bytes.values()) > 0

    def test_a_placed_pods_working_set_is_read_from_its_cgroup(self, tmp_path: Path) -> None:
        uid = "5f0c8a3e-2b1d-4c6e-9a7f-1e2d3c4b5a69"
        pod_dir = (
            tmp_path
            / "kubepods.slice/kubepods-burstable.slice"
            / f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
        )
        pod_dir.mkdir(parents=True)
        (pod_dir / "memory.current").write_text(f"{3 * GiB}\n")
        (pod_dir / "memory.stat").write_text(f"inactive_file {GiB}\n")
        pods = [{"uid": uid, "kind": "Engine", "namespace": "a", "name": "e"}]
        raw = attribution.read_raw([], pods, scan_environ=False, cgroup_root=tmp_path)
        assert raw["pods"][0]["working_set"] == 2 * GiB
        _, host_bytes = attribution.owners(raw)
        assert list(host_bytes.values()) == [2 * GiB]


def test_a_capture_on_this_machine_makes_a_board_and_times_each_backend() -> None:
    doc, timings = probe.capture()
    assert set(timings) == {"nvml", "host", "metal", "attribution"}
    assert all(t >= 0 for t in timings.values())
    json.dumps(doc)  # a capture is a fixture: it must be JSON
    probe.readings(doc)
