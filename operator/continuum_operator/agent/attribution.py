"""Whose memory is it: the engines and lanes the operator placed, told apart from the rest.

Two ways to match a process to a consumer (docs/design.md: availability is not counted twice):

- by pod: the process's cgroup path names its pod's UID (`.../kubepods-burstable-pod<uid>.slice/`
  or `.../kubepods/burstable/pod<uid>/`), and the pod is one the operator placed on this node
  (label `continuum.dev/engine` or `continuum.dev/embedlane`). The pod's host memory is its
  cgroup's working set.
- by process, on a bare machine: the process (or the one that launched it) runs with
  `CONTINUUM_CONSUMER=Engine/<namespace>/<name>` in its environment. Its host memory is the sum
  of the RSS of the processes so marked.

Also here, because it is the same scan of the process table: which per-process cap mechanisms
the node offers (an NVIDIA MPS control daemon running or its pipe directory present; HAMi's node
registration annotation or its libvgpu on the host). `read_raw` gathers, `parse` decides.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from continuum_operator.core.readings import ConsumerRef, MechanismReading
from continuum_operator.model.board import CapMechanism

__all__ = [
    "CONSUMER_ENV",
    "HAMI_ANNOTATION",
    "mechanisms",
    "mps_pipe_dirs",
    "owners",
    "pod_uid",
    "read_raw",
]

CONSUMER_ENV = "CONTINUUM_CONSUMER"
HAMI_ANNOTATION = "hami.io/node-nvidia-register"
HAMI_LIBRARY = Path("/usr/local/vgpu/libvgpu.so")
MPS_PIPE_DIRS = (Path("/tmp/nvidia-mps"), Path("/run/nvidia/mps"), Path("/var/run/nvidia/mps"))
MPS_DAEMON = "nvidia-cuda-mps-control"

_UID = r"([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
#: A pod's own cgroup, whole: `pod<uid>` (cgroupfs) or `kubepods[-qos]-pod<uid>.slice` (systemd).
_POD_DIR = re.compile(rf"(?:pod{_UID}|[\w.-]*kubepods[\w-]*-pod{_UID}\.slice)")
#: The cgroupfs driver's QoS levels, between `kubepods` and a pod: `kubepods/burstable/pod<uid>`.
_CGROUPFS_QOS = frozenset({"burstable", "besteffort"})


def pod_uid(cgroup_text: str) -> str | None:
    """The UID of the pod whose cgroup holds a process (`/proc/PID/cgroup`), or None.

    Only a pod cgroup the kubelet made counts: its parent is a kubepods level
    (`kubepods.slice`, `kubepods-burstable.slice`, `kubepods`, or cgroupfs's `burstable` and
    `besteffort` under one), and no level above it is a user's (`user.slice`,
    `user@1000.service`): any user may name a unit of their own `pod<uid>`
    (`systemd-run --user --unit=...`), and an engine pod's UID is no secret (its node's
    NodeBoard lists it), so a name alone would charge a stranger's GPU memory to it.

    The agent's container has a cgroup namespace of its own (containerd's CRI gives every
    non-privileged container one on cgroup v2), and the kernel writes another process's path
    relative to the reader's namespace root: `/../../kubepods-besteffort-pod<uid>.slice/...`,
    `/../../../pod<uid>/...`. The first level after the `..`s is a child of an ancestor of the
    agent's own cgroup: the root or one of the kubelet's pod levels. Only root may create a
    cgroup there (a user's delegated subtree is below `user@N.service`, which the climb names
    in full, and is refused as above), so that level is trusted as the kubelet's; every level
    below it must still be a kubepods level for a pod directory to count, exactly as in an
    absolute path."""
    for line in cgroup_text.splitlines():
        parts = [p for p in line.split(":", 2)[-1].split("/") if p]
        below = list(itertools.dropwhile(lambda p: p == "..", parts))
        parent_is_kubelets = len(below) < len(parts)
        for part in below:
            if part.startswith("user") or part == "..":
                break
            m = _POD_DIR.fullmatch(part)
            if m and parent_is_kubelets:
                return (m.group(1) or m.group(2)).replace("_", "-")
            qos_level = part in _CGROUPFS_QOS and parent_is_kubelets
            parent_is_kubelets = "kubepods" in part or qos_level
    return None


def mps_pipe_dirs(roots: Sequence[Path]) -> list[Path]:
    """The MPS pipe directories under `roots` whose daemon's `control` pipe exists: a root
    that is one (a daemon started with CUDA_MPS_PIPE_DIRECTORY there), or NVIDIA's device
    plugin's `<root>/<resource>/pipe` (k8s-device-plugin's internal/plugin/mps.go mounts the
    host's `<mps-root>/<resource>/pipe` into each client; `nvidia.com/gpu` is two levels)."""
    found: list[Path] = []
    for root in roots:
        for pattern in ("control", "*/pipe/control", "*/*/pipe/control"):
            found += sorted(c.parent for c in root.glob(pattern) if c.parent not in found)
    return found


def _consumer(value: str | None) -> ConsumerRef | None:
    if not value:
        return None
    kind, _, rest = value.partition("/")
    namespace, _, name = rest.partition("/")
    if kind not in ("Engine", "EmbedLane") or not namespace or not name:
        return None
    return ConsumerRef(kind, namespace, name)  # type: ignore[arg-type]


def _pod_cgroup_dir(uid: str, root: Path) -> Path | None:
    """The pod's cgroup, under the systemd or the cgroupfs driver's layout, any QoS class."""
    under = uid.replace("-", "_")
    patterns = (
        f"kubepods.slice/kubepods-pod{under}.slice",
        f"kubepods.slice/kubepods-*.slice/kubepods-*-pod{under}.slice",
        f"kubepods/pod{uid}",
        f"kubepods/*/pod{uid}",
        f"memory/kubepods/pod{uid}",
        f"memory/kubepods/*/pod{uid}",
    )
    for pattern in patterns:
        for found in root.glob(pattern):
            return found
    return None


def _working_set(cgroup: Path) -> int | None:
    for usage_file, stat_key in (
        ("memory.current", "inactive_file"),
        ("memory.usage_in_bytes", "total_inactive_file"),
    ):
        try:
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        inactive = 0
        try:
            for line in (cgroup / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == stat_key:
                    inactive = int(value)
        except OSError:
            pass
        return max(0, usage - inactive)
    return None


def read_raw(
    gpu_pids: Iterable[int],
    placed_pods: Sequence[Mapping[str, str]] = (),
    *,
    scan_environ: bool = True,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_root: Path = Path("/proc"),
    node_annotations: Mapping[str, str] | None = None,
    mps_roots: Sequence[Path] = MPS_PIPE_DIRS,
) -> dict[str, Any]:
    """Processes of interest, the placed pods' working sets, and the cap mechanisms' traces.

    `placed_pods` are `{"uid", "kind", "namespace", "name"}` from the API server (empty on a
    bare machine). `scan_environ` reads each process's environment for CONSUMER_ENV: the
    bare-machine match, which costs one read per process, so the agent turns it off in a cluster.
    """
    import psutil

    processes: dict[str, dict[str, Any]] = {}
    mps_daemons: list[int] = []
    wanted = set(gpu_pids)
    for proc in psutil.process_iter(["pid", "name"]):
        pid = proc.info["pid"]
        if proc.info["name"] == MPS_DAEMON:
            mps_daemons.append(pid)
        marker = None
        if scan_environ:
            try:
                marker = proc.environ().get(CONSUMER_ENV)
            except (psutil.Error, OSError):
                marker = None
        if pid not in wanted and marker is None:
            continue
        entry: dict[str, Any] = {"consumer": marker}
        try:
            entry["cgroup"] = (proc_root / str(pid) / "cgroup").read_text().strip()
        except OSError:
            entry["cgroup"] = ""
        try:
            entry["rss"] = proc.memory_info().rss
        except (psutil.Error, OSError):
            entry["rss"] = 0
        processes[str(pid)] = entry
    pods = []
    for pod in placed_pods:
        cg = _pod_cgroup_dir(pod["uid"], cgroup_root)
        pods.append({**pod, "working_set": None if cg is None else _working_set(cg)})
    annotations = node_annotations or {}
    return {
        "processes": processes,
        "pods": pods,
        "mechanisms": {
            "mps_daemons": sorted(mps_daemons),
            "mps_pipe_dirs": [str(d) for d in mps_pipe_dirs(mps_roots)],
            "hami_annotation": HAMI_ANNOTATION if HAMI_ANNOTATION in annotations else None,
            "hami_library": str(HAMI_LIBRARY) if HAMI_LIBRARY.exists() else None,
        },
    }


def owners(raw: Mapping[str, Any]) -> tuple[dict[int, ConsumerRef], dict[ConsumerRef, int]]:
    """(process -> consumer, consumer -> host bytes) from a raw attribution document."""
    by_uid = {
        str(p["uid"]): ConsumerRef(p["kind"], p["namespace"], p["name"])
        for p in raw.get("pods", [])
    }
    owner_of: dict[int, ConsumerRef] = {}
    rss: dict[ConsumerRef, int] = {}
    for pid, entry in raw.get("processes", {}).items():
        uid = pod_uid(str(entry.get("cgroup", "")))
        ref = by_uid.get(uid) if uid is not None else None
        if ref is None:
            ref = _consumer(entry.get("consumer"))
            if ref is not None:
                rss[ref] = rss.get(ref, 0) + int(entry.get("rss") or 0)
        if ref is not None:
            owner_of[int(pid)] = ref
    host: dict[ConsumerRef, int] = dict(rss)
    for pod in raw.get("pods", []):
        if pod.get("working_set") is not None:
            ref = by_uid[str(pod["uid"])]
            host[ref] = host.get(ref, 0) + int(pod["working_set"])
    return owner_of, host


def mechanisms(raw: Mapping[str, Any]) -> tuple[MechanismReading, ...]:
    m = raw.get("mechanisms", {})
    found = []
    if m.get("mps_daemons") or m.get("mps_pipe_dirs"):
        evidence = [f"{MPS_DAEMON} pid {pid}" for pid in m.get("mps_daemons", [])]
        evidence += [f"pipe {d}/control" for d in m.get("mps_pipe_dirs", [])]
        found.append(MechanismReading(CapMechanism.MPS, ", ".join(evidence)))
    if m.get("hami_annotation") or m.get("hami_library"):
        evidence = [f"node annotation {m['hami_annotation']}"] if m.get("hami_annotation") else []
        evidence += [f"library {m['hami_library']}"] if m.get("hami_library") else []
        found.append(MechanismReading(CapMechanism.HAMI, ", ".join(evidence)))
    return tuple(found)
