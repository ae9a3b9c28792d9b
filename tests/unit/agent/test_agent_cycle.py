"""When the agent writes its board and renews its Lease: only on change, and only when in step."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from continuum_operator.agent.writer import AgentApiError
from continuum_operator.cli import build_parser
from continuum_operator.core.board_change import Thresholds, board_change
from continuum_operator.core.heartbeat import (
    NODE_ANNOTATION,
    lease_fresh,
    lease_name,
    node_of_lease,
)
from continuum_operator.model.board import (
    CapMechanism,
    CapMechanismReading,
    MemoryMode,
    NodeBoard,
    NodeBoardStatus,
    PoolKind,
    PoolReading,
)
from tests.support.agent import FIXTURES, FakeApi, agent_on

GiB = 2**30
MiB = 2**20


def discrete(host_used: int = 10 * GiB, device_used: int = 1 * GiB) -> NodeBoardStatus:
    return NodeBoardStatus(
        memory_mode=MemoryMode.DISCRETE,
        pools=[
            PoolReading(kind=PoolKind.HOST, capacity_bytes=256 * GiB, used_bytes=host_used),
            PoolReading(
                kind=PoolKind.DEVICE, device=0, capacity_bytes=80 * GiB, used_bytes=device_used
            ),
        ],
    )


class TestThresholds:
    def test_the_first_board_is_always_written(self) -> None:
        assert board_change(None, discrete()).write

    def test_usage_moving_less_than_the_step_is_not_written(self) -> None:
        # 2% of 80 GiB is 1.6 GiB
        assert not board_change(discrete(), discrete(device_used=2 * GiB)).write

    def test_usage_moving_past_the_step_is_written_and_says_where(self) -> None:
        change = board_change(discrete(), discrete(device_used=3 * GiB))
        assert change.write and "device/0" in change.reason

    def test_a_small_pool_is_not_rewritten_for_noise_below_the_floor(self) -> None:
        small = NodeBoardStatus(
            memory_mode=MemoryMode.UNKNOWN,
            pools=[PoolReading(kind=PoolKind.HOST, capacity_bytes=GiB, used_bytes=100 * MiB)],
        )
        moved = small.model_copy(
            update={"pools": [small.pools[0].model_copy(update={"used_bytes": 300 * MiB})]}
        )
        assert not board_change(small, moved).write
        assert board_change(small, moved, Thresholds(used_min_bytes=64 * MiB)).write

    @pytest.mark.parametrize(
        "update",
        [
            {"memory_mode_reason": "something else"},
            {"per_process_cap_bytes": 8 * GiB},
            {"cap_mechanisms": [CapMechanismReading(mechanism=CapMechanism.MPS)]},
        ],
    )
    def test_anything_structural_is_written_at_once(self, update: dict[str, Any]) -> None:
        assert board_change(discrete(), discrete().model_copy(update=update)).write

    def test_a_pool_sampled_for_the_first_time_is_written(self) -> None:
        unsampled = discrete().model_copy(
            update={"pools": [discrete().pools[0].model_copy(update={"used_bytes": None}),
                              discrete().pools[1]]}
        )  # fmt: skip
        assert board_change(unsampled, discrete()).write

    @given(st.lists(st.integers(min_value=-200 * MiB, max_value=200 * MiB), max_size=60))
    def test_drift_is_written_once_it_adds_up_against_the_last_written_board(
        self, steps: list[int]
    ) -> None:
        written = discrete(device_used=40 * GiB)
        used = 40 * GiB
        step = Thresholds().step(80 * GiB)
        for delta in steps:
            used = max(0, min(80 * GiB, used + delta))
            new = discrete(device_used=used)
            change = board_change(written, new)
            last = written.pools[1].used_bytes
            assert last is not None
            assert change.write == (abs(used - last) >= step)
            if change.write:
                written = new


class TestCycle:
    def test_the_first_cycle_writes_the_board_and_renews_the_lease(self) -> None:
        api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
        cycle = agent_on("x86-h100-hmm", api, now).cycle()
        assert cycle.wrote and cycle.renewed
        assert len(api.writes) == 1 and api.renewals == now
        assert api.writes[0].memory_mode is MemoryMode.DISCRETE

    def test_a_quiet_node_renews_its_lease_without_rewriting_its_board(self) -> None:
        api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
        agent = agent_on("x86-h100-hmm", api, now)
        agent.cycle()
        for _ in range(3):
            now[0] += timedelta(seconds=10)
            agent.cycle()
        assert len(api.writes) == 1
        assert len(api.renewals) == 4

    def test_a_board_deleted_under_a_quiet_node_is_written_again_before_the_lease_renews(
        self,
    ) -> None:
        api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
        agent = agent_on("x86-h100-hmm", api, now)
        agent.cycle()
        api.stored = None  # kubectl delete nodeboard, a CRD reinstalled
        now[0] += timedelta(seconds=10)
        cycle = agent.cycle()
        assert cycle.wrote and cycle.renewed
        assert api.stored is not None and len(api.writes) == 2

    def test_an_engine_loading_its_weights_gets_the_board_rewritten(self) -> None:
        api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
        doc = json.loads((FIXTURES / "x86-h100-hmm.json").read_text())
        agent = agent_on("x86-h100-hmm", api, now, doc)
        agent.cycle()
        device = doc["nvml"]["devices"][0]
        device["nvmlDeviceGetMemoryInfo_v2"]["used"] += 20 * GiB
        device["nvmlDeviceGetMemoryInfo_v2"]["free"] -= 20 * GiB
        device["nvmlDeviceGetComputeRunningProcesses"][0]["usedGpuMemory"] += 20 * GiB
        cycle = agent.cycle()
        assert cycle.wrote and "device/0" in cycle.change.reason
        assert [c.used_bytes for c in api.writes[-1].consumers if c.device == 0] == [42 * GiB]

    def test_a_restarted_agent_does_not_rewrite_an_unchanged_board(self) -> None:
        api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
        agent_on("x86-h100-hmm", api, now).cycle()
        restarted = agent_on("x86-h100-hmm", api, now)
        restarted.cycle()
        assert len(api.writes) == 1

    def test_a_failed_write_leaves_the_lease_to_expire(self) -> None:
        api, now = FakeApi(), [datetime(2026, 12, 3, tzinfo=UTC)]
        api.fail_writes = True
        with pytest.raises(AgentApiError):
            agent_on("x86-h100-hmm", api, now).cycle()
        assert api.renewals == []


class TestHeartbeat:
    def test_the_agents_lease_never_takes_the_kubelets_name(self) -> None:
        assert lease_name("node-1") == "continuum-agent-node-1"

    def test_a_long_node_name_still_makes_a_valid_lease_name(self) -> None:
        name = lease_name("n" * 253)
        assert len(name) <= 253 and name.startswith("continuum-agent-")
        assert lease_name("n" * 253) != lease_name("n" * 252 + "m")

    def test_a_watcher_maps_the_agents_lease_back_to_its_node_and_ignores_the_kubelets(
        self,
    ) -> None:
        assert node_of_lease(lease_name("node-1")) == "node-1"
        assert node_of_lease("node-1") is None  # the kubelet's own Lease
        long = "n" * 253
        assert node_of_lease(lease_name(long), {NODE_ANNOTATION: long}) == long
        assert node_of_lease(lease_name(long)) != long  # shortened: only the annotation says
        # Annotated by node b's agent (the policy pins the annotation to the writer's node):
        # a Lease named for node a vouches for neither.
        assert node_of_lease(lease_name("a"), {NODE_ANNOTATION: "b"}) is None

    def test_a_lease_is_fresh_for_its_duration(self) -> None:
        t = datetime(2026, 12, 3, tzinfo=UTC)
        assert lease_fresh(t, 40, t + timedelta(seconds=39))
        assert not lease_fresh(t, 40, t + timedelta(seconds=40))
        assert not lease_fresh(None, 40, t)


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class TestCommand:
    def test_print_shows_this_machines_board_as_a_nodeboard_without_a_cluster(self) -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "continuum_operator.cli", "agent", "--print",
             "--node-name", "bare-1"],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        board = NodeBoard.model_validate(yaml.safe_load(proc.stdout))
        assert board.metadata.name == "bare-1"
        assert board.status.pools and board.status.pools[-1].capacity_bytes > 0
        assert "# probe: nvml" in proc.stderr

    def test_without_the_kubernetes_package_the_agent_says_which_extra_to_install(self) -> None:
        # The operator's and the engine's images go without it (pyproject.toml's `agent` extra).
        code = ("import sys; sys.modules['kubernetes'] = None\n"
                "from continuum_operator.cli import main\n"
                "sys.exit(main(['agent', '--print', '--node-name', 'bare-1']))\n")  # fmt: skip
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=False)  # fmt: skip
        assert proc.returncode == 2
        assert "install 'continuum-operator[agent]'" in proc.stderr

    def test_print_from_a_capture_shows_the_recorded_machines_board(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        args = parse(["agent", "--print", "--from-capture", str(FIXTURES / "gb10-unified.json")])
        assert args.func(args) == 0
        board = NodeBoard.model_validate(yaml.safe_load(capsys.readouterr().out))
        assert board.status.memory_mode is MemoryMode.UNIFIED

    def test_a_file_that_is_not_a_capture_is_refused_by_name(
        self, tmp_path: Any, capsys: pytest.CaptureFixture[str]
    ) -> None:
        bad = tmp_path / "board.json"
        bad.write_text('{"status": {}}')
        args = parse(["agent", "--print", "--from-capture", str(bad)])
        assert args.func(args) == 2
        assert f"{bad}: not a probe capture" in capsys.readouterr().err

    def test_from_capture_without_print_is_refused(self) -> None:
        args = parse(["agent", "--once", "--from-capture", str(FIXTURES / "gb10-unified.json")])
        assert args.func(args) == 2

    def test_a_lease_shorter_than_the_interval_is_refused(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        args = parse(["agent", "--print", "--interval", "30", "--lease-seconds", "20"])
        assert args.func(args) == 2
        assert "--lease-seconds" in capsys.readouterr().err

    def test_once_without_a_cluster_configuration_says_so(
        self, tmp_path: Any, capsys: pytest.CaptureFixture[str]
    ) -> None:
        missing = str(tmp_path / "no-kubeconfig")
        args = parse(["agent", "--once", "--kubeconfig", missing])
        assert args.func(args) == 2
        assert "no cluster configuration" in capsys.readouterr().err
