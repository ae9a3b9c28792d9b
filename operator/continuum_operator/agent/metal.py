"""The Apple probe: Apple silicon's one memory pool and Metal's working-set limit, via sysctl.

On Apple silicon the GPU draws from the same memory as the CPU, so the board is unified; the cap
on what one process may wire for the GPU is `iogpu.wired_limit_mb` (0: the OS default, which
sysctl does not show; the board then says so and carries no cap unless one is configured).
Elsewhere this probe reports "not Apple silicon" and the other backends decide.
"""

from __future__ import annotations

import platform
import subprocess
from typing import Any

from continuum_operator.core.readings import MetalReading

__all__ = ["parse", "read_raw"]

RawMetal = dict[str, Any]
MiB = 2**20
_KEYS = ("hw.memsize", "hw.optional.arm64", "machdep.cpu.brand_string", "iogpu.wired_limit_mb")


def read_raw(system: str | None = None, machine: str | None = None) -> RawMetal:
    """`sysctl` answers on macOS; only the platform elsewhere (there is nothing to ask)."""
    system = system or platform.system()
    machine = machine or platform.machine()
    raw: RawMetal = {"system": system, "machine": machine}
    if system != "Darwin":
        return raw
    sysctl: dict[str, str] = {}
    for key in _KEYS:
        try:
            out = subprocess.run(
                ["sysctl", "-n", key], capture_output=True, text=True, timeout=5, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0:
            sysctl[key] = out.stdout.strip()
    raw["sysctl"] = sysctl
    return raw


def parse(raw: RawMetal) -> MetalReading:
    if raw.get("system") != "Darwin":
        return MetalReading(available=False, reason=f"not macOS ({raw.get('system')})")
    sysctl: dict[str, str] = raw.get("sysctl", {})
    if sysctl.get("hw.optional.arm64") != "1":
        return MetalReading(available=False, reason="an Intel Mac: its GPU memory is not reported")
    memsize = int(sysctl.get("hw.memsize", "0") or 0)
    wired_mb = sysctl.get("iogpu.wired_limit_mb", "")
    wired = int(wired_mb) * MiB if wired_mb.isdigit() and int(wired_mb) > 0 else None
    return MetalReading(
        available=True,
        chip=sysctl.get("machdep.cpu.brand_string", "Apple silicon"),
        memory_bytes=memsize,
        wired_limit_bytes=wired,
    )
