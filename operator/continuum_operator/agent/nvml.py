"""The NVIDIA probe: raw NVML answers through nvidia-ml-py, then plain GPU readings.

Two steps, so that what a machine said can be kept and replayed. `read_raw` calls NVML and keeps
each answer as the JSON form of its raw pynvml structure, keyed by the NVML function that gave
it; an error is kept as `{"error": "NVML_ERROR_NOT_SUPPORTED", "code": 3}`. `parse` turns that
document into an `NvmlReading`, and does no I/O. Fixtures under tests/fixtures/probes hold these
documents; testing/fake_nvml.py answers pynvml's calls from one, so `read_raw` is tested too.

A missing library or driver is a reading ("no NVIDIA: ..."), never a crash. Memory info v2 is
asked first (its `used` leaves out the driver's reserve); v1 where v2 fails. Not Supported
for memory is kept apart from other failures: on GB10 it means the GPU has no framebuffer.

nvidia-ml-py's unversioned process lists call the newest version of the NVML function it knows
(`_v3`) and raise `NVMLLibraryMismatchError`, which is not an `NVMLError`, where the driver's
library lacks it: that answer is kept as an error like any other (and `_v2` asked in its
place), so an older driver is a GPU whose processes are unread, not a failed cycle and a lapsed
Lease. MPS clients are listed by their own call (`nvmlDeviceGetMPSComputeRunningProcesses`).
"""

from __future__ import annotations

import contextlib
from typing import Any, TypeGuard

from continuum_operator.core.readings import (
    Addressing,
    GpuMemoryStatus,
    GpuProcess,
    GpuReading,
    NvmlReading,
)
from continuum_operator.model.base import MAX_BYTES

__all__ = ["PROCESS_LISTS", "device_processes", "parse", "read_raw"]

RawNvml = dict[str, Any]

NOT_SUPPORTED = "NVML_ERROR_NOT_SUPPORTED"
MISMATCH = "NVMLLibraryMismatchError"
#: Each device's process lists: compute, graphics, and MPS clients (asked where the
#: nvidia-ml-py has the call; a recording made before the agent asked it has none).
PROCESS_LISTS = (
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses",
)
_ADDRESSING = {0: Addressing.NONE, 1: Addressing.HMM, 2: Addressing.ATS}


def _error_name(nv: Any, err: Exception) -> dict[str, Any]:
    code = getattr(err, "value", None)
    names = [
        name
        for name in dir(nv)
        if name.startswith("NVML_ERROR_") and getattr(nv, name, None) == code
    ]
    return {"error": names[0] if names else str(err), "code": code}


def _struct(value: Any) -> Any:
    """The JSON form of a pynvml answer: ctypes structures and friendly objects to dicts."""
    fields = getattr(value, "_fields_", None)
    if fields is not None:
        return {name: _struct(getattr(value, name)) for name, *_ in fields}
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    if isinstance(value, list | tuple):
        return [_struct(v) for v in value]
    if hasattr(value, "__dict__") and not isinstance(value, type):
        return {k: _struct(v) for k, v in vars(value).items() if not k.startswith("_")}
    return value


def read_raw(nv: Any = None) -> RawNvml:
    """Ask NVML (the `pynvml` module, or a stand-in) everything the board needs."""
    if nv is None:
        try:
            import pynvml
        except ImportError as err:
            return {"import": {"error": f"{type(err).__name__}: {err}"}}
        nv = pynvml
    try:
        nv.nvmlInit()
    except nv.NVMLError as err:
        return {"nvmlInit": _error_name(nv, err)}
    except OSError as err:  # a broken library that loads but cannot bind
        return {"nvmlInit": {"error": f"{type(err).__name__}: {err}", "code": None}}
    raw: RawNvml = {"nvmlInit": None}
    mismatch = getattr(nv, MISMATCH, _NeverRaised)
    try:

        def ask(target: dict[str, Any], name: str, *args: Any) -> Any:
            """Call NVML's `name`; keep its answer (or error) under that name in `target`."""
            key = name
            try:
                if name == "nvmlDeviceGetMemoryInfo_v2":  # pynvml: v1's function, a version arg
                    value = nv.nvmlDeviceGetMemoryInfo(*args, version=nv.nvmlMemory_v2)
                else:
                    value = getattr(nv, name)(*args)
            except nv.NVMLError as err:
                target[key] = _error_name(nv, err)
                return None
            except mismatch as err:  # the driver's library lacks the version pynvml calls
                target[key] = {"error": MISMATCH, "code": None, "detail": str(err)}
                return None
            except AttributeError:  # an nvidia-ml-py older than the call
                target[key] = {"error": "NVML_ERROR_FUNCTION_NOT_FOUND", "code": 13}
                return None
            target[key] = _struct(value)
            return value

        ask(raw, "nvmlSystemGetDriverVersion")
        count = ask(raw, "nvmlDeviceGetCount") or 0
        devices: list[dict[str, Any]] = []
        for index in range(count):
            dev: dict[str, Any] = {}
            devices.append(dev)
            handle = ask(dev, "nvmlDeviceGetHandleByIndex", index)
            dev.pop("nvmlDeviceGetHandleByIndex", None)  # a pointer: nothing to keep
            if handle is None:
                dev["nvmlDeviceGetHandleByIndex"] = {"error": "no handle", "code": None}
                continue
            ask(dev, "nvmlDeviceGetName", handle)
            ask(dev, "nvmlDeviceGetUUID", handle)
            # v1 where v2 fails: an older driver may lack v2 (or not support it) yet answer v1;
            # memory is Not Supported (GB10) only when both say so.
            if ask(dev, "nvmlDeviceGetMemoryInfo_v2", handle) is None:
                ask(dev, "nvmlDeviceGetMemoryInfo", handle)
            ask(dev, "nvmlDeviceGetAddressingMode", handle)
            ask(dev, "nvmlDeviceGetNumaNodeId", handle)
            for name in PROCESS_LISTS:
                if not hasattr(nv, name):
                    continue  # an nvidia-ml-py (or a recording) without the call
                answer = ask(dev, name, handle)
                if answer is None and _failed(dev[name]) and dev[name]["error"] == MISMATCH:
                    ask(dev, f"{name}_v2", handle)  # the version an older driver has
        raw["devices"] = devices
    finally:
        with contextlib.suppress(nv.NVMLError):
            nv.nvmlShutdown()
    return raw


class _NeverRaised(Exception):
    """Stands for NVMLLibraryMismatchError with an nvidia-ml-py that has none."""


def _failed(answer: Any) -> TypeGuard[dict[str, Any]]:
    return isinstance(answer, dict) and "error" in answer


def device_processes(dev: dict[str, Any]) -> tuple[GpuProcess, ...]:
    used: dict[int, int | None] = {}
    for key in PROCESS_LISTS:
        answer = dev.get(key)
        if not isinstance(answer, list):
            answer = dev.get(f"{key}_v2")  # asked where the unversioned call mismatched
        if not isinstance(answer, list):
            continue
        for proc in answer:
            pid = int(proc["pid"])
            n = proc.get("usedGpuMemory")
            # A process in two lists holds one allocation, not two.
            prev = used.get(pid)
            used[pid] = n if prev is None else max(prev, n or 0)
    return tuple(GpuProcess(pid, n) for pid, n in sorted(used.items()))


def _gpu(index: int, dev: dict[str, Any]) -> GpuReading:
    name = dev.get("nvmlDeviceGetName")
    uuid = dev.get("nvmlDeviceGetUUID")
    name = name if isinstance(name, str) else ""
    uuid = uuid if isinstance(uuid, str) else ""
    mode = dev.get("nvmlDeviceGetAddressingMode")
    addressing = (
        _ADDRESSING.get(mode, Addressing.UNREPORTED)
        if isinstance(mode, int)
        else (Addressing.UNREPORTED)
    )
    numa = dev.get("nvmlDeviceGetNumaNodeId")
    numa_node = numa if isinstance(numa, int) and numa >= 0 else None
    common: dict[str, Any] = {
        "index": index,
        "name": name,
        "uuid": uuid,
        "addressing": addressing,
        "numa_node": numa_node,
        "processes": device_processes(dev),
    }
    if _failed(dev.get("nvmlDeviceGetHandleByIndex")):
        return GpuReading(memory=GpuMemoryStatus.FAILED, memory_error="no handle", **common)
    v2 = dev.get("nvmlDeviceGetMemoryInfo_v2")
    v1 = dev.get("nvmlDeviceGetMemoryInfo")
    if isinstance(v2, dict) and not _failed(v2):
        return _measured(int(v2["total"]) - int(v2["reserved"]), int(v2["used"]), common)
    if isinstance(v1, dict) and not _failed(v1):
        # v1's `used` includes the driver's reserve and its `total` does too: free is the same.
        return _measured(int(v1["total"]), int(v1["used"]), common)
    errors = [a["error"] for a in (v2, v1) if _failed(a)]
    if errors and all(e == NOT_SUPPORTED for e in errors):
        return GpuReading(
            memory=GpuMemoryStatus.NOT_SUPPORTED, memory_error=NOT_SUPPORTED, **common
        )
    return GpuReading(
        memory=GpuMemoryStatus.FAILED,
        memory_error=", ".join(str(e) for e in errors) or "memory info not read",
        **common,
    )


def _measured(capacity: int, used: int, common: dict[str, Any]) -> GpuReading:
    """A GPU's memory as read, or FAILED for figures no GPU has (a reserve above the total, a
    negative use, past the 2^62 bytes a board carries: a driver's quirk or a hostile shim).
    That GPU is left out of the pools and named; the rest of the board is still written."""
    if not 0 < capacity <= MAX_BYTES or not 0 <= used <= MAX_BYTES:
        return GpuReading(
            memory=GpuMemoryStatus.FAILED,
            memory_error=f"memory reading out of range (capacity {capacity}, used {used})",
            **common,
        )
    return GpuReading(
        memory=GpuMemoryStatus.MEASURED, capacity_bytes=capacity, used_bytes=used, **common
    )


def parse(raw: RawNvml) -> NvmlReading:
    """The readings in a raw NVML document (from `read_raw`, or a fixture)."""
    if "import" in raw:
        return NvmlReading(
            available=False, reason=f"nvidia-ml-py not importable ({raw['import']['error']})"
        )
    init = raw.get("nvmlInit")
    if init is not None:
        return NvmlReading(available=False, reason=f"NVML did not initialise ({init['error']})")
    driver = raw.get("nvmlSystemGetDriverVersion")
    count = raw.get("nvmlDeviceGetCount")
    if _failed(count):
        return NvmlReading(available=False, reason=f"NVML could not count GPUs ({count['error']})")
    gpus = tuple(_gpu(i, dev) for i, dev in enumerate(raw.get("devices", [])))
    return NvmlReading(available=True, driver=driver if isinstance(driver, str) else "", gpus=gpus)
