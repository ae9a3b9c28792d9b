"""Kubernetes objects built from an Engine and its plan: plain dicts, no API calls.

The engine runs as a Deployment of one pod (strategy `Recreate`: a rolling update would load the
successor beside the old engine and run out of memory), in the Guaranteed QoS class (requests
equal limits, sized from the plan's host bytes), on the node of its placement, at the engine
priority class. Its container runs `continuum engine`, the grant gateway in front of
`llama-server`, with the plan's arguments after `--`. A Service serves the gateway.

The contract of the container's command line (docs/operator.md):

    continuum engine --engine NAMESPACE/NAME --port PORT [--model PATH [--sha256 HEX]]
                     -- LLAMA_SERVER_ARGS...

`--sha256` is checked by the engine before it serves (the file it reads is the one it was
promised). Built from the plan as written in `status.plan`, so what runs is what status says.
Neighbours: `kube.base.settings` (image, CPU, GPU sharing), `kube.writer` (applies these objects).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from collections.abc import Sequence
from typing import Any, NamedTuple

from continuum_operator.kube.base.settings import GpuClaims, GpuSharing, PodSettings
from continuum_operator.kube.workloads.gpu_env import NO_GPU_ENV, runtime_class
from continuum_operator.kube.workloads.park_volume import park_args, park_volume
from continuum_operator.model.base import API_VERSION
from continuum_operator.model.engine import Engine, ModelRef, ModelSourceKind
from continuum_operator.model.plan_status import PlanStatus

MiB = 2**20
MODEL_MOUNT = "/models"
GPU_RESOURCE = "nvidia.com/gpu"
HAMI_GPUMEM_RESOURCE = "nvidia.com/gpumem"
MPS_LIMIT_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
LAUNCH_ANNOTATION = "continuum.dev/launch"
LAUNCH_ENV = "CONTINUUM_LAUNCH"
#: The engine's admin port: /metrics, /v1/releases, /v1/runtime, never served to minds.
ADMIN_PORT = 9090
#: Namespaces labelled so may reach the admin port (a monitoring namespace, say); no others.
SCRAPE_LABEL = "continuum.dev/scrape-engines"
#: Kubernetes' own role for delegated authentication: what the gateway's TokenReview needs.
AUTH_DELEGATOR = "system:auth-delegator"
ENGINE_LABEL = "continuum.dev/engine"
MANAGED_BY = "continuum-operator"

Manifest = dict[str, Any]
"""A Kubernetes object this room builds to send, or a part of one (a container, a volume, an env
entry): plain JSON. `Any` inside, not `object`: the builders and the tests that read what was
built index into nested parts."""


def app_labels(app: str, key: str, name: str) -> dict[str, str]:
    """The labels of what the operator runs for one resource: `app` names the kind of app,
    `key` the label that names the resource (the selector's two, and the standard ones)."""
    return {
        "app.kubernetes.io/name": app,
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        key: name,
    }


def app_selector(app: str, key: str, name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": app, key: name}


def controller_reference(kind: str, name: str, uid: str) -> Manifest:
    """An ownerReference to one of continuum.dev's resources as the controller of the object."""
    return {
        "apiVersion": API_VERSION,
        "kind": kind,
        "name": name,
        "uid": uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(engine: Engine) -> dict[str, str]:
    return app_labels("continuum-engine", ENGINE_LABEL, engine.metadata.name)


def selector(engine: Engine) -> dict[str, str]:
    return app_selector("continuum-engine", ENGINE_LABEL, engine.metadata.name)


def owner_reference(engine: Engine, uid: str) -> Manifest:
    return controller_reference("Engine", engine.metadata.name, uid)


def _ceil_mib(n: int) -> int:
    return -(-n // MiB)


def memory_limit_bytes(plan: PlanStatus, pods: PodSettings) -> int:
    """Host bytes the engine allocates, plus the processes' overhead, in whole MiB; a host park
    store (a memory emptyDir) is in the pod's memory."""
    return _ceil_mib(plan.bytes.host.in_use() + pods.memory_overhead_bytes) * MiB


def enforcement(plan: PlanStatus, pods: PodSettings, *, node_has_gpus: bool) -> Manifest:
    """Which per-process caps apply to this engine, and their numbers (`status.enforcement`)."""
    gpus = plan.gpus
    per_gpu = _ceil_mib(plan.bytes.device.in_use() // max(len(gpus), 1)) if gpus else 0
    out: Manifest = {
        "engineArgs": True,
        "memoryLimitBytes": memory_limit_bytes(plan, pods),
        "qosClass": "Guaranteed",
        "gpuSharing": str(pods.gpu_sharing),
        "gpus": len(gpus) if node_has_gpus else 0,
    }
    if gpus and pods.gpu_sharing is GpuSharing.HAMI:
        out["hamiGpumemMiB"] = per_gpu
    if gpus and pods.gpu_sharing is GpuSharing.MPS:
        out["mpsPinnedDeviceMemLimit"] = ",".join(f"{i}={per_gpu}M" for i in range(len(gpus)))
    return out


class ModelVolume(NamedTuple):
    """The model's volume, the file's path inside the container, and the volume's mount."""

    volume: Manifest
    path: str
    mount: Manifest


def model_volume(engine: Engine) -> ModelVolume | None:
    """The model's volume and the file's path inside the container; None with inline facts only.

    A hostPath source mounts the file itself (a volume of type File, read-only), never its
    directory: `/srv/models/m.gguf` must not give the pod the rest of `/srv/models`, nor a path
    like `/shadow` the host's `/`. Whether the path may be mounted at all is `host_path_refusal`.
    """
    source = engine.spec.model.source
    if source is None:
        return None
    rel = source.path.lstrip("/")
    whole = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}
    if source.kind is ModelSourceKind.PVC:
        volume: Manifest = {
            "name": "model",
            "persistentVolumeClaim": {"claimName": source.claim_name, "readOnly": True},
        }
        return ModelVolume(volume, posixpath.join(MODEL_MOUNT, rel), whole)
    if source.kind is ModelSourceKind.HOST_PATH:
        volume = {"name": "model", "hostPath": {"path": source.path, "type": "File"}}
        path = posixpath.join(MODEL_MOUNT, posixpath.basename(source.path))
        return ModelVolume(volume, path, {"name": "model", "mountPath": path, "readOnly": True})
    volume = {"name": "model", "image": {"reference": source.image, "pullPolicy": "IfNotPresent"}}
    return ModelVolume(volume, posixpath.join(MODEL_MOUNT, rel), whole)


HOST_PATH_SETTING = (
    "the operator's --allowed-host-path-prefix (the chart's engineSources.allowedHostPathPrefixes)"
)


def host_path_refusal(model: ModelRef, pods: PodSettings) -> str | None:
    """Why a hostPath model source may not be mounted (None: it may, or it is not hostPath).

    A hostPath gives the pod a file of the node, so only files under a directory the cluster
    admin named are mounted; none is named by default. The API server refuses the same paths
    at admission when the chart's policy is installed (engine-source-policy.yaml); this check
    holds where it is not.
    """
    source = model.source
    if source is None or source.kind is not ModelSourceKind.HOST_PATH:
        return None
    if under_allowed_prefix(source.path, pods.allowed_host_path_prefixes):
        return None
    allowed = ", ".join(pods.allowed_host_path_prefixes) or "none is set"
    return (
        f"hostPath {source.path} is not under a directory the cluster admin allows for model "
        f"files ({allowed}); use a pvc or image source, or ask a cluster admin to add the "
        f"model's directory to {HOST_PATH_SETTING}"
    )


def under_allowed_prefix(path: str, prefixes: Sequence[str]) -> bool:
    """Whether `path` names something strictly inside one of `prefixes` (directories)."""
    return any(path.startswith(p.rstrip("/") + "/") for p in prefixes)


def pod_security_context() -> Manifest:
    """The pod's part of the `restricted` Pod Security profile (the images run as UID 65532)."""
    return {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> Manifest:
    """The container's part of `restricted`, and a read-only root: /tmp is an emptyDir."""
    return {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }


TMP_VOLUME: Manifest = {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}
TMP_MOUNT: Manifest = {"name": "tmp", "mountPath": "/tmp"}


def command(engine: Engine, plan: PlanStatus, pods: PodSettings) -> list[str]:
    cmd = [
        "continuum",
        "engine",
        "--engine",
        f"{engine.metadata.namespace}/{engine.metadata.name}",
        "--port",
        str(pods.port),
        # Minds' tokens reviewed with the engine's audience (said, though it is the default).
        "--review-tokens",
        "--admin-port",
        str(ADMIN_PORT),
    ]
    model = model_volume(engine)
    if model is not None:
        cmd += ["--model", model[1]]
        if engine.spec.model.sha256:
            cmd += ["--sha256", engine.spec.model.sha256]
    cmd += park_args(engine)
    cmd += [
        "--threads",
        str(engine_cpus(plan, pods)),
        "--max-restarts",
        str(pods.max_restarts),
        "--restart-window",
        f"{pods.restart_window_seconds:g}",
    ]
    return [*cmd, "--", *plan.engine_args]


def engine_cpus(plan: PlanStatus, pods: PodSettings) -> int:
    """Whole CPUs of the engine's pod (request = limit), and llama-server's threads.

    A layer kept on the host runs on the CPU; a layer on the device on the GPU, driven by a
    thread or two. So `cpu_min` with every layer on the device, and towards `cpu_share` of the
    node's allocatable CPUs (at most `cpu_max`) as the share of layers on the host grows:
    cpu_min + ceil((top - cpu_min) * host_layers / layers). Whole CPUs keep the pod eligible
    for exclusive cores under the kubelet's static CPU manager.
    """
    total, on_device = plan.total_layers, plan.layers_on_device
    host_layers = max(0, total - on_device)
    if pods.node_cpus is None or total <= 0:
        return pods.cpu_min
    top = int(pods.node_cpus * pods.cpu_share)
    if pods.cpu_max is not None:
        top = min(top, pods.cpu_max)
    top = max(top, pods.cpu_min)
    return pods.cpu_min + -(-(top - pods.cpu_min) * host_layers // total)


GPU_CLAIM = "gpus"
DRA_API_VERSION = "resource.k8s.io/v1"


def gpu_claim_template(
    engine: Engine, uid: str, plan: PlanStatus, pods: PodSettings
) -> Manifest | None:
    """The ResourceClaimTemplate of the GPUs the plan charged (`device/N`), with DRA only.

    The claim selects devices of `pods.dra_device_class` whose `uuid` attribute is the UUID
    the node's board reports for one of the plan's GPUs, as many as the plan has: the
    scheduler allocates exactly those or leaves the pod pending, so the ledger's charge is the
    device the pod gets. NVIDIA's DRA driver publishes `uuid` (NVML's, as the agent reads it)
    in every release; the NVML `index` it published up to v25.3 is gone since (its
    cmd/gpu-kubelet-plugin/deviceinfo.go: type, uuid, productName, brand, architecture,
    cudaComputeCapability, driverVersion, cudaDriverVersion, pcieBusID, addressingMode), and a
    selector naming an attribute a device lacks fails the allocation. A planned GPU whose UUID
    the board lacks is selected by a value no device has: the pod stays pending rather than
    run on a GPU no lease charges. The name carries the indices: a template's spec cannot
    change, a plan on other GPUs is another template.
    """
    gpus = plan.gpus
    if pods.gpu_claims is not GpuClaims.DRA or not gpus:
        return None
    domain = pods.dra_driver
    uuid_of = dict(pods.node_gpu_uuids)
    uuids = ", ".join(json.dumps(uuid_of.get(g, f"unknown: GPU {g} has no UUID")) for g in gpus)
    name = f"{engine.metadata.name[:40]}-gpu-{'-'.join(str(g) for g in gpus)}"[:253]
    return {
        "apiVersion": DRA_API_VERSION,
        "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": name,
            "namespace": engine.metadata.namespace,
            "labels": labels(engine),
            "ownerReferences": [owner_reference(engine, uid)],
        },
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": GPU_CLAIM,
                            "exactly": {
                                "deviceClassName": pods.dra_device_class,
                                "allocationMode": "ExactCount",
                                "count": len(gpus),
                                "selectors": [
                                    {
                                        "cel": {
                                            "expression": f'device.attributes["{domain}"]'
                                            f".uuid in [{uuids}]"
                                        }
                                    }
                                ],
                            },
                        }
                    ]
                }
            }
        },
    }


def launch_hash(engine: Engine, plan: PlanStatus, pods: PodSettings) -> str:
    """Identity of one launch: a new value means the pod must be replaced (a relaunch)."""
    key: dict[str, object] = {"cmd": command(engine, plan, pods), "node": plan.node}
    if pods.gpu_claims is GpuClaims.DRA:
        key["gpus"] = list(plan.gpus)  # another claim: another pod
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def deployment(
    engine: Engine, uid: str, plan: PlanStatus, pods: PodSettings, *, node_has_gpus: bool
) -> Manifest:
    resources, env, claim = _engine_resources(engine, uid, plan, pods, node_has_gpus=node_has_gpus)
    container = _engine_container(engine, plan, pods, resources, env)
    volumes: list[Manifest] = [dict(TMP_VOLUME)]
    model = model_volume(engine)
    if model is not None:
        volumes.append(model.volume)
        container["volumeMounts"].append(model.mount)
    park = park_volume(engine)
    if park is not None:
        volumes.append(park[0])
        container["volumeMounts"].append(park[1])
    launch = launch_hash(engine, plan, pods)
    pod_spec = _engine_pod_spec(engine, plan, pods, container)
    pod_spec["volumes"] = volumes
    if claim is not None:
        # The GPUs come from the claim, not from nvidia.com/gpu: the planned ones or none.
        pod_spec["resourceClaims"] = [
            {"name": GPU_CLAIM, "resourceClaimTemplateName": claim["metadata"]["name"]}
        ]
        container["resources"]["claims"] = [{"name": GPU_CLAIM}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": engine.metadata.name,
            "namespace": engine.metadata.namespace,
            "labels": labels(engine),
            "annotations": {LAUNCH_ANNOTATION: launch},
            "ownerReferences": [owner_reference(engine, uid)],
        },
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(engine)},
            "template": {
                "metadata": {"labels": labels(engine), "annotations": {LAUNCH_ANNOTATION: launch}},
                "spec": pod_spec,
            },
        },
    }


def _engine_resources(
    engine: Engine, uid: str, plan: PlanStatus, pods: PodSettings, *, node_has_gpus: bool
) -> tuple[dict[str, str], list[Manifest], Manifest | None]:
    """The engine container's resources and environment, and the ResourceClaimTemplate its
    GPUs come from where they come from DRA."""
    gpus = len(plan.gpus) if node_has_gpus else 0
    memory = str(memory_limit_bytes(plan, pods))
    resources: dict[str, str] = {"cpu": str(engine_cpus(plan, pods)), "memory": memory}
    # The runtime names its launch in status.runtime, so the operator reads only the report
    # of the pod it is deciding for (`kube.engines.runtime_report`).
    env: list[Manifest] = [
        {
            "name": LAUNCH_ENV,
            "valueFrom": {
                "fieldRef": {"fieldPath": f"metadata.annotations['{LAUNCH_ANNOTATION}']"}
            },
        }
    ]
    rules = enforcement(plan, pods, node_has_gpus=node_has_gpus)
    claim = gpu_claim_template(engine, uid, plan, pods)
    if gpus and claim is None:
        resources[GPU_RESOURCE] = str(gpus)
    if not gpus and claim is None:
        env.extend(dict(e) for e in NO_GPU_ENV)
    if gpus:
        if "hamiGpumemMiB" in rules:
            resources[HAMI_GPUMEM_RESOURCE] = str(rules["hamiGpumemMiB"])
        if "mpsPinnedDeviceMemLimit" in rules:
            env.append({"name": MPS_LIMIT_ENV, "value": rules["mpsPinnedDeviceMemLimit"]})
    return resources, env, claim


def _engine_container(
    engine: Engine,
    plan: PlanStatus,
    pods: PodSettings,
    resources: dict[str, str],
    env: list[Manifest],
) -> Manifest:
    container: Manifest = {
        "name": "engine",
        "image": pods.image,
        "imagePullPolicy": pods.image_pull_policy,
        "command": command(engine, plan, pods),
        "ports": [{"name": "http", "containerPort": pods.port}],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
        # The gateway's own event loop answering; llama-server's exits are the runtime's to
        # count and stop (`--max-restarts`), and the gateway answers while the model is hashed.
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "periodSeconds": 10,
            "timeoutSeconds": 5,
            "failureThreshold": 6,
        },
        "securityContext": container_security_context(),
        "volumeMounts": [dict(TMP_MOUNT)],  # the gateway's slot directory (tempfile)
    }
    if env:
        container["env"] = env
    return container


def _engine_pod_spec(
    engine: Engine, plan: PlanStatus, pods: PodSettings, container: Manifest
) -> Manifest:
    """The engine's pod, pinned to the plan's node (its volumes and claims are added after)."""
    return {
        "priorityClassName": pods.engine_priority_class,
        "serviceAccountName": service_account_name(engine),
        "securityContext": pod_security_context(),
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [plan.node]}
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [container],
        "terminationGracePeriodSeconds": 30,
    } | runtime_class(pods)


def service_account_name(engine: Engine) -> str:
    return f"continuum-engine-{engine.metadata.name}"[:253]


def service(engine: Engine, uid: str, pods: PodSettings) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": engine.metadata.name,
            "namespace": engine.metadata.namespace,
            "labels": labels(engine),
            "ownerReferences": [owner_reference(engine, uid)],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": selector(engine),
            "ports": [
                {"name": "http", "port": pods.port, "targetPort": "http"},
                # Metrics, releases, runtime: the NetworkPolicy admits labelled namespaces only.
                {"name": "admin", "port": ADMIN_PORT, "targetPort": ADMIN_PORT},
            ],
        },
    }
