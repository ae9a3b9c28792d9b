"""The host probe: psutil's memory figures, the cgroup limit that applies, the NUMA nodes.

As with agent/nvml.py, `read_raw` gathers the raw answers (psutil's `svmem` as a dict, the
cgroup files' text, each NUMA node's MemTotal/MemFree and CPU list) and `parse` turns them into
a `HostReading` without I/O. NUMA nodes matter where a GPU's memory is onlined as a memory-only
node (GH200 in NUMA mode): the OS then counts it in MemTotal, and the board takes it off the host
pool. The cgroup read is the agent's own by default, walked up to the root (the tightest limit
wins); a DaemonSet points `cgroup_dir` at the host's kubepods cgroup instead, whose limit is what
pods on the node may use together.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from continuum_operator.core.readings import CgroupLimit, HostReading, NumaNode

__all__ = ["own_cgroup_dir", "parse", "read_raw"]

RawHost = dict[str, Any]

# A cgroup v1 "no limit" is a page-rounded 2**63-1; anything past 2**60 bytes is no limit.
_NO_LIMIT = 2**60
_LIMIT_FILES = ("memory.max", "memory.limit_in_bytes")
_USAGE_FILES = ("memory.current", "memory.usage_in_bytes")


def own_cgroup_dir(
    proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> Path | None:
    """The memory cgroup directory of this process (v2 unified, or v1's memory controller)."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2
            return root / path.lstrip("/")
        if "memory" in controllers.split(","):
            return root / "memory" / path.lstrip("/")
    return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_levels(start: Path, root: Path) -> list[dict[str, Any]]:
    levels = []
    here = start
    while True:
        level: dict[str, Any] = {"dir": str(here)}
        for name in (*_LIMIT_FILES, *_USAGE_FILES, "memory.stat"):
            text = _read(here / name)
            if text is not None:
                level[name] = text if name != "memory.stat" else _inactive_file_line(text)
        if len(level) > 1:
            levels.append(level)
        if here == root or root not in here.parents:
            break
        here = here.parent
    return levels


def _inactive_file_line(stat: str) -> str:
    """Only the line the working set needs (memory.stat has dozens)."""
    keep = [
        ln
        for ln in stat.splitlines()
        if ln.split(" ")[0] in ("inactive_file", "total_inactive_file")
    ]
    return "\n".join(keep)


def _numa(root: Path) -> dict[str, Any]:
    nodes: dict[str, Any] = {}
    for node_dir in sorted(root.glob("node[0-9]*")):
        meminfo = _read(node_dir / "meminfo") or ""
        entry: dict[str, Any] = {"cpulist": (_read(node_dir / "cpulist") or "").strip()}
        for key in ("MemTotal", "MemFree"):
            m = re.search(rf"{key}:\s+(\d+) kB", meminfo)
            if m:
                entry[f"{key}_kB"] = int(m.group(1))
        nodes[node_dir.name.removeprefix("node")] = entry
    return nodes


def read_raw(
    cgroup_dir: Path | None = None,
    *,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    numa_root: Path = Path("/sys/devices/system/node"),
    walk_up: bool = True,
) -> RawHost:
    """psutil's virtual memory, the cgroup levels from `cgroup_dir` up, the NUMA nodes."""
    import psutil

    raw: RawHost = {"virtual_memory": psutil.virtual_memory()._asdict()}
    start = cgroup_dir if cgroup_dir is not None else own_cgroup_dir(root=cgroup_root)
    if start is not None:
        levels = _cgroup_levels(start, cgroup_root if walk_up else start)
        raw["cgroup"] = levels
    raw["numa"] = _numa(numa_root)
    return raw


def _cpus(cpulist: str) -> int:
    count = 0
    for part in cpulist.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if not text.isdigit():
        return None  # "max"
    return int(text)


def _cgroup(levels: list[dict[str, Any]]) -> CgroupLimit | None:
    best: CgroupLimit | None = None
    for level in levels:
        limit = next((_int(level.get(f)) for f in _LIMIT_FILES if f in level), None)
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = next((_int(level.get(f)) for f in _USAGE_FILES if f in level), None) or 0
        stat = dict(
            line.partition(" ")[::2] for line in str(level.get("memory.stat", "")).splitlines()
        )
        # v1 keeps the hierarchy's total apart; v2's inactive_file already covers it.
        inactive = int(stat.get("total_inactive_file") or stat.get("inactive_file") or 0)
        # The working set, as the kubelet counts it: usage less reclaimable page cache.
        working = max(0, usage - inactive)
        if best is None or limit < best.limit_bytes:
            best = CgroupLimit(path=str(level["dir"]), limit_bytes=limit, working_set_bytes=working)
    return best


def parse(raw: RawHost) -> HostReading:
    vm = raw["virtual_memory"]
    numa = tuple(
        NumaNode(
            id=int(node_id),
            total_bytes=int(entry.get("MemTotal_kB", 0)) * 1024,
            free_bytes=int(entry.get("MemFree_kB", 0)) * 1024,
            cpus=_cpus(str(entry.get("cpulist", ""))),
        )
        for node_id, entry in sorted(raw.get("numa", {}).items(), key=lambda kv: int(kv[0]))
    )
    return HostReading(
        total_bytes=int(vm["total"]),
        available_bytes=int(vm["available"]),
        cgroup=_cgroup(raw.get("cgroup") or []),
        numa_nodes=numa,
    )
