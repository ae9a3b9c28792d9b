"""What an engine's or lane's pod needs from the node's GPU stack, besides its resources: the
GPU environment it runs with, its RuntimeClass, and the GPU sharing modes it cannot run under.

Every pod the operator builds says which GPUs it sees (docs/install.md, "GPU nodes"): an engine
on GPUs gets them from the device plugin or its DRA claim, anything else sees none.
"""

from __future__ import annotations

from collections.abc import Sequence

from continuum_operator.kube.base.settings import GpuSharing, PodSettings

__all__ = ["NO_GPU_ENV", "gpu_sharing_refusal", "lane_gpu_env", "runtime_class"]

# A pod planned with nothing on a GPU sees none: where the node's default runtime is NVIDIA's,
# a CUDA image (NVIDIA_VISIBLE_DEVICES=all, as NVIDIA's CUDA base images set it) would get every
# GPU, and llama.cpp's CUDA build then holds a context and a graph on GPU 0 that no lease
# charges (562 MiB on an H200 with no layers offloaded: tests/fixtures/h200). `void` is the
# container toolkit's "as runc" (no device, no driver library mounted); the empty
# CUDA_VISIBLE_DEVICES hides any device mounted all the same.
NO_GPU_ENV: tuple[dict[str, str], ...] = (
    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
    {"name": "CUDA_VISIBLE_DEVICES", "value": ""},
)


def lane_gpu_env(gpus: Sequence[int]) -> list[dict[str, str]]:
    """The GPU environment of a lane's pod: none on the host (`NO_GPU_ENV`), else the engine's
    GPUs its placement names (residence device or split). A lane asks the device plugin for no
    GPU (the engine holds it), so NVIDIA's runtime, reading NVIDIA_VISIBLE_DEVICES, is what
    puts the engine's GPUs in its container (its default
    accept-nvidia-visible-devices-envvar-when-unprivileged; docs/install.md)."""
    if not gpus:
        return [dict(e) for e in NO_GPU_ENV]
    return [{"name": "NVIDIA_VISIBLE_DEVICES", "value": ",".join(str(g) for g in gpus)}]


def runtime_class(pods: PodSettings) -> dict[str, str]:
    """`runtimeClassName` of an engine's or lane's pod, where one is configured
    (`--runtime-class`): the device plugin's default `envvar` strategy names the GPUs in
    NVIDIA_VISIBLE_DEVICES only, which nothing but NVIDIA's runtime acts on."""
    return {"runtimeClassName": pods.runtime_class} if pods.runtime_class else {}


def gpu_sharing_refusal(gpus: int, pods: PodSettings) -> str | None:
    """Why an engine of `gpus` GPUs cannot run under the configured sharing, or None.

    Under MPS, NVIDIA's device plugin refuses a request for more than one replica of its shared
    resource unless its config says `failRequestsGreaterThanOne: false` (its
    api/config/v1/config.go sets it true when the MPS section leaves it out), so such a pod
    fails admission on its node and never starts."""
    if pods.gpu_sharing is GpuSharing.MPS and gpus > 1:
        return (
            f"{gpus} GPUs under --gpu-sharing mps: NVIDIA's device plugin gives an MPS client "
            "one GPU (it refuses a request above 1 unless its MPS config sets "
            "failRequestsGreaterThanOne: false); set spec.placement.gpus to 1, or run this "
            "engine where GPUs are not shared by MPS"
        )
    return None
