"""A stand-in for the `pynvml` module that answers from a recorded NVML document.

The document is the `nvml` part of a probe fixture (tests/fixtures/probes/*.json), as
agent/nvml.py's `read_raw` wrote it on some machine: each answer is kept under the NVML
function that gave it, errors as `{"error": "NVML_ERROR_...", "code": N}`. This module raises
the real nvidia-ml-py's error classes for those, so the probe's own error handling is what runs.
A call the recording has no answer for fails the test loudly instead of inventing one.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pynvml

__all__ = ["FakeNvml", "UnrecordedCall"]


class UnrecordedCall(AssertionError):
    """The probe asked NVML something the fixture never recorded."""


def _answer(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _answer(v) for k, v in value.items()})
    if isinstance(value, list):
        return [_answer(v) for v in value]
    return value


class FakeNvml:
    """Answers pynvml's calls from one recorded `nvml` document; handles are GPU indices."""

    NVMLError = pynvml.NVMLError
    NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, raw: dict[str, Any]) -> None:
        self.raw = raw
        self.calls: list[str] = []
        for name in dir(pynvml):
            if name.startswith("NVML_ERROR_"):
                setattr(self, name, getattr(pynvml, name))

    def _get(self, where: dict[str, Any], name: str) -> Any:
        self.calls.append(name)
        if name not in where:
            raise UnrecordedCall(f"the fixture has no answer for {name}")
        value = where[name]
        if isinstance(value, dict) and value.get("error") == "NVMLLibraryMismatchError":
            raise pynvml.NVMLLibraryMismatchError(value.get("detail", ""))
        if isinstance(value, dict) and "error" in value:
            code = value.get("code")
            if code is None:
                raise OSError(value["error"])
            raise pynvml.NVMLError(code)
        return _answer(value)

    def __getattr__(self, name: str) -> Any:
        """A per-device call the methods below leave out (an MPS process list, a `_v2`): the
        fake has it only where the recording holds its answer for some device, as a probe
        asks only what its nvidia-ml-py has."""
        devices = self.__dict__.get("raw", {}).get("devices", [])
        if name.startswith("nvmlDeviceGet") and any(name in d for d in devices):
            return lambda handle: self._get(self._device(handle), name)
        raise AttributeError(name)

    def _device(self, handle: int) -> dict[str, Any]:
        devices: list[dict[str, Any]] = self.raw["devices"]
        return devices[handle]

    def nvmlInit(self) -> None:
        if "import" in self.raw:
            raise UnrecordedCall("this fixture is of a machine where pynvml did not import")
        self._get(self.raw, "nvmlInit")

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> Any:
        return self._get(self.raw, "nvmlSystemGetDriverVersion")

    def nvmlDeviceGetCount(self) -> Any:
        return self._get(self.raw, "nvmlDeviceGetCount")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.calls.append("nvmlDeviceGetHandleByIndex")
        dev = self._device(index)
        failed = dev.get("nvmlDeviceGetHandleByIndex")
        if isinstance(failed, dict) and failed.get("code") is not None:
            raise pynvml.NVMLError(failed["code"])
        return index

    def nvmlDeviceGetName(self, handle: int) -> Any:
        return self._get(self._device(handle), "nvmlDeviceGetName")

    def nvmlDeviceGetUUID(self, handle: int) -> Any:
        return self._get(self._device(handle), "nvmlDeviceGetUUID")

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> Any:
        name = "nvmlDeviceGetMemoryInfo_v2" if version else "nvmlDeviceGetMemoryInfo"
        return self._get(self._device(handle), name)

    def nvmlDeviceGetAddressingMode(self, handle: int) -> Any:
        return self._get(self._device(handle), "nvmlDeviceGetAddressingMode")

    def nvmlDeviceGetNumaNodeId(self, handle: int) -> Any:
        return self._get(self._device(handle), "nvmlDeviceGetNumaNodeId")

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> Any:
        return self._get(self._device(handle), "nvmlDeviceGetComputeRunningProcesses")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> Any:
        return self._get(self._device(handle), "nvmlDeviceGetGraphicsRunningProcesses")
