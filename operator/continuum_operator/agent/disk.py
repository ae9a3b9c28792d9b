"""The node's disk, where engines' park stores on disk live (an emptyDir of the kubelet's root
directory; docs/gateway.md "Parked contexts"): its capacity and what is used of it, from
statvfs. Read only where the agent is given the path (`--disk-path`); the board then has a
`disk` pool the plan charges park stores of tier disk to."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from continuum_operator.core.readings import DiskReading

__all__ = ["parse", "read_raw"]


def read_raw(path: Path | None) -> dict[str, Any] | None:
    """statvfs of `path` as plain numbers, the error where it fails; None: not asked."""
    if path is None:
        return None
    try:
        st = os.statvfs(path)
    except OSError as err:
        return {"path": str(path), "error": str(err)}
    return {
        "path": str(path),
        "f_frsize": st.f_frsize,
        "f_blocks": st.f_blocks,
        "f_bavail": st.f_bavail,
    }


def parse(raw: Any) -> DiskReading | None:
    """The disk's reading: capacity the blocks an unprivileged writer may fill (what the
    filesystem keeps for root is no pod's), used what of them is not available."""
    if not isinstance(raw, dict) or "error" in raw:
        return None
    try:
        size, blocks, avail = int(raw["f_frsize"]), int(raw["f_blocks"]), int(raw["f_bavail"])
    except (KeyError, TypeError, ValueError):
        return None
    if size <= 0 or blocks <= 0:
        return None
    capacity = blocks * size
    return DiskReading(str(raw.get("path", "")), capacity, max(0, capacity - avail * size))
