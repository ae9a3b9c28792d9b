"""tools/device_probe.py: clear about a machine without NVIDIA, and honest about what it saves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.builders import ROOT

TOOL = ROOT / "tools" / "device_probe.py"
FIXTURES = ROOT / "tests" / "fixtures" / "probes"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has an NVIDIA driver")
def test_without_an_nvidia_gpu_it_says_so_and_saves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "capture.json"
    proc = run("--out", str(out))
    assert proc.returncode == 1
    assert proc.stderr.startswith("no NVIDIA: ")
    assert not out.exists()


def test_a_replayed_machine_prints_readings_board_and_timings_and_saves_nothing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "capture.json"
    proc = run("--replay-nvml", str(FIXTURES / "gh200-numa.json"), "--repeat", "2",
               "--out", str(out), "--expect", "discrete")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    for heading in ("## raw readings", "## board", "## probe timings over 2 cycles"):
        assert heading in proc.stdout
    assert "memoryMode: discrete" in proc.stdout
    assert not out.exists()


def test_an_unexpected_mode_fails(tmp_path: Path) -> None:
    proc = run("--replay-nvml", str(FIXTURES / "x86-h100-hmm.json"), "--repeat", "1",
               "--expect", "unified")  # fmt: skip
    assert proc.returncode == 3
    assert "expected unified, read discrete" in proc.stderr
