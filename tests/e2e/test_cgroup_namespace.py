"""The node agent's attribution as the kernel shows it from a cgroup namespace (containerd's CRI
gives every non-privileged container one on cgroup v2): a process in a pod-shaped cgroup, read
by the agent's probe from a sibling pod's cgroup, in a namespace rooted there and as the agent
image's user, is the pod's; one in a user's unit named after the same pod is not. The kernel
writes both paths (`/../../kubepods-besteffort-pod<uid>.slice/...`), not a test; NVML is the
fake one listing the process (no GPU here). Needs root and a cgroup v2 hierarchy."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.builders import ROOT

pytestmark = pytest.mark.e2e

AGENT_UID = 65533
FIXTURE = ROOT / "tests" / "fixtures" / "probes" / "h200-captured.json"
READ = """
import json, sys
from pathlib import Path
from typing import Any
from continuum_operator.agent import probe
from continuum_operator.testing.fake_nvml import FakeNvml
nvml, placed = json.loads(sys.argv[1]), json.loads(sys.argv[2])
settings = probe.ProbeSettings(cgroup_root=Path(sys.argv[3]), scan_environ=False)
doc, _ = probe.capture(settings, nv=FakeNvml(nvml), placed_pods=placed)
print(json.dumps({
    "cgroup": {p: e["cgroup"] for p, e in doc["attribution"]["processes"].items()},
    "owners": {str(p): o.name for p, o in probe.readings(doc).gpu_owners.items()},
}))
"""


def v2_root() -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root: it makes cgroups and a cgroup namespace")
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.controllers").exists() and os.access(root, os.W_OK):
            return root
    pytest.skip("no writable cgroup v2 hierarchy")


@contextlib.contextmanager
def cgroup(path: Path) -> Iterator[Path]:
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        for level in (path, *path.parents):
            if level.name in ("", "cgroup", "unified") or not level.name:
                break
            with contextlib.suppress(OSError):
                level.rmdir()


def sleeper(where: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(["sleep", "120"])
    (where / "cgroup.procs").write_text(str(proc.pid))
    return proc


def agent_read(
    root: Path, agent: Path, pids: list[int], placed: list[dict[str, str]]
) -> dict[str, Any]:
    nvml = json.loads(FIXTURE.read_text())["nvml"]
    nvml["devices"][0]["nvmlDeviceGetComputeRunningProcesses"] = [
        {"pid": p, "usedGpuMemory": 2**30, "gpuInstanceId": 0xFFFFFFFF,
         "computeInstanceId": 0xFFFFFFFF}
        for p in pids
    ]  # fmt: skip
    script = (
        f"echo $$ > {agent}/cgroup.procs && exec unshare --cgroup setpriv --reuid {AGENT_UID} "
        f'--regid {AGENT_UID} --clear-groups {sys.executable} -c "$0" "$@"'
    )
    done = subprocess.run(
        ["sh", "-c", script, READ, json.dumps(nvml), json.dumps(placed), str(root)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT / "operator")},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout)
    return out


def test_a_pods_process_is_its_pods_from_a_sibling_cgroup_namespace_a_users_unit_is_not() -> None:
    root = v2_root()
    uid = str(uuid.uuid4())
    run = uuid.uuid4().hex[:8]
    qos = root / f"kubepods-e2e{run}.slice" / f"kubepods-e2e{run}-besteffort.slice"
    pod = qos / f"kubepods-besteffort-pod{uid.replace('-', '_')}.slice" / "cri-containerd-e.scope"
    agent = (
        qos / "kubepods-besteffort-pod00000000_0000_0000_0000_000000000000.slice" / "agent.scope"
    )
    user = root / f"user-e2e{run}.slice" / "user@1000.service" / f"pod{uid}"
    placed = [{"uid": uid, "kind": "Engine", "namespace": "ns", "name": "engine"}]
    with cgroup(pod), cgroup(agent), cgroup(user):
        engine, stranger = sleeper(pod), sleeper(user)
        try:
            seen = agent_read(root, agent, [engine.pid, stranger.pid], placed)
        finally:
            for proc in (engine, stranger):
                proc.kill()
                proc.wait()
    engine_line = seen["cgroup"][str(engine.pid)].splitlines()[-1]
    assert engine_line.startswith("0::/../../kubepods-besteffort-pod"), (
        seen
    )  # relative: a namespace
    assert seen["owners"] == {str(engine.pid): "engine"}, seen
    assert "/user@1000.service/" in seen["cgroup"][str(stranger.pid)], seen
