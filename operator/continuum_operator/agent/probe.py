"""One probe cycle: every backend's raw answers in one document, then the node's readings.

The document is what tests/fixtures/probes/*.json hold and what tools/device_probe.py saves:

    {"label": {...}, "nvml": {...}, "host": {...}, "metal": {...}, "attribution": {...}}

`capture` asks the machine (and times each backend); `readings` turns a document, captured or
recorded, into `NodeReadings` without I/O; core/nodeboard.py makes the board from those. Keeping
the raw document is what lets a board be re-derived later from exactly what a machine said.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from continuum_operator.agent import attribution, disk, host, metal, nvml
from continuum_operator.core.readings import NodeReadings

__all__ = ["ProbeSettings", "capture", "gpu_pids", "readings"]


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    cgroup_dir: Path | None = None
    """Cgroup whose memory limit bounds the host pool; None: the agent's own, walked to the root."""
    cgroup_root: Path = Path("/sys/fs/cgroup")
    """Where the cgroup hierarchy is mounted (a DaemonSet mounts the host's elsewhere)."""
    scan_environ: bool = True
    """Match bare-machine consumers by their CONTINUUM_CONSUMER environment (one read a process)."""
    configured_cap_bytes: int | None = None
    """An operator-configured per-process GPU cap (bytes) for platforms that report none."""
    disk_path: Path | None = None
    """A directory on the filesystem of the node's emptyDirs: its disk is the board's `disk`
    pool (park stores on disk); None: no disk pool."""
    mps_roots: tuple[Path, ...] = attribution.MPS_PIPE_DIRS
    """Where MPS control daemons' pipes are looked for (`attribution.mps_pipe_dirs`); the
    DaemonSet mounts the host's /run/nvidia/mps, the device plugin's root, and names it."""


def gpu_pids(raw_nvml: Mapping[str, Any]) -> list[int]:
    """Every process NVML listed on any GPU (compute, graphics, MPS clients)."""
    return sorted(
        {p.pid for dev in raw_nvml.get("devices", []) for p in nvml.device_processes(dev)}
    )


def capture(
    settings: ProbeSettings = ProbeSettings(),
    *,
    nv: Any = None,
    placed_pods: Sequence[Mapping[str, str]] = (),
    node_annotations: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """The raw document of this machine now, and seconds spent per backend."""
    timings: dict[str, float] = {}
    doc: dict[str, Any] = {}

    start = time.perf_counter()
    doc["nvml"] = nvml.read_raw(nv)
    timings["nvml"] = time.perf_counter() - start

    start = time.perf_counter()
    doc["host"] = host.read_raw(settings.cgroup_dir, cgroup_root=settings.cgroup_root)
    timings["host"] = time.perf_counter() - start

    start = time.perf_counter()
    doc["metal"] = metal.read_raw()
    timings["metal"] = time.perf_counter() - start

    start = time.perf_counter()
    doc["attribution"] = attribution.read_raw(
        gpu_pids(doc["nvml"]),
        placed_pods,
        scan_environ=settings.scan_environ,
        cgroup_root=settings.cgroup_root,
        node_annotations=node_annotations,
        mps_roots=settings.mps_roots,
    )
    timings["attribution"] = time.perf_counter() - start
    if settings.disk_path is not None:
        doc["disk"] = disk.read_raw(settings.disk_path)
    return doc, timings


def readings(doc: Mapping[str, Any], configured_cap_bytes: int | None = None) -> NodeReadings:
    """The node's readings from one raw document (captured now, or a fixture)."""
    raw_attribution = doc.get("attribution", {})
    owners, host_bytes = attribution.owners(raw_attribution)
    raw_metal = doc.get("metal")
    return NodeReadings(
        host=host.parse(doc["host"]),
        nvml=nvml.parse(doc["nvml"]),
        metal=metal.parse(raw_metal) if raw_metal is not None else None,
        gpu_owners=owners,
        consumer_host_bytes=host_bytes,
        mechanisms=attribution.mechanisms(raw_attribution),
        configured_cap_bytes=configured_cap_bytes,
        disk=disk.parse(doc.get("disk")),
    )
