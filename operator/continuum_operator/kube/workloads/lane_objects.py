"""The Kubernetes objects that run an EmbedLane: `continuum embed` in a pod on the lane's node.

Built from the lane's `status.placement`, so what runs is what status says (as the engine's
Deployment is built from its plan, `kube.workloads.engine_objects`). The pod runs `continuum embed
--lane NS/NAME`, which reads its lease from the lane and writes the lane's `status.runtime`; its
identity (a ServiceAccount, a Role limited to this one EmbedLane, their binding) allows exactly
that, and a ClusterRoleBinding to `system:auth-delegator` lets it review its callers' tokens
(docs/embedlanes.md, "The door"). A NetworkPolicy admits the lane's namespace on its serving
port and labelled namespaces on its admin port. Everything namespaced is owned by the
EmbedLane, so deleting the lane removes it; the ClusterRoleBinding is left behind, as an
engine's is (`engine_identity.token_review_binding`).

Only host-resident lanes get a pod: a lane on the device would need a share of the engine's
GPU (HAMi, MPS), which the device plugin does not give a second pod; such a lane is placed and
charged, and its `Placed` condition says that its pod is not created. A lane whose model is
known only by inline facts has no file to load and gets no pod either.
Neighbours: `kube.lanes.loop` (decides and applies), `kube.workloads.engine_objects` (the engine's
objects).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence

from continuum_operator.core.embed import LaneSizer
from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.workloads import engine_identity, engine_objects
from continuum_operator.kube.workloads.engine_objects import Manifest
from continuum_operator.kube.workloads.gpu_env import lane_gpu_env, runtime_class
from continuum_operator.model.base import API_VERSION
from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
from continuum_operator.model.engine import Engine, ModelFacts, ModelRef

__all__ = [
    "LANE_LABEL",
    "cpu_cores",
    "deployment_name",
    "lane_deployment",
    "lane_identity",
    "lane_network_policy",
    "lane_threads",
    "name_for",
    "token_review_binding_name",
    "why_no_pod",
]

LANE_LABEL = "continuum.dev/embedlane"
#: The process's own heap beside its context and the mapped weights (bytes).
RUNTIME_OVERHEAD_BYTES = 256 * 2**20
# The CPU quantities the chart's schema takes: 2, 1.5, 500m.
_CPU_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m?)")


def name_for(lane_name: str) -> str:
    """The name of the lane's Deployment and identity (prefixed: an Engine may share its name)."""
    return f"embedlane-{lane_name}"


def deployment_name(lane: EmbedLane) -> str:
    return name_for(lane.metadata.name)


def _labels(lane: EmbedLane) -> dict[str, str]:
    return engine_objects.app_labels("continuum-embedlane", LANE_LABEL, lane.metadata.name)


def _selector(lane: EmbedLane) -> dict[str, str]:
    return engine_objects.app_selector("continuum-embedlane", LANE_LABEL, lane.metadata.name)


def _owner(lane: EmbedLane, uid: str) -> Manifest:
    return engine_objects.controller_reference("EmbedLane", lane.metadata.name, uid)


def _model(lane: EmbedLane, engine: Engine | None) -> ModelRef | None:
    if lane.spec.model is not None:
        return lane.spec.model
    return engine.spec.model if engine is not None else None


def why_no_pod(
    lane: EmbedLane,
    placement: EmbedLanePlacement | None,
    engine: Engine | None,
    pods: PodSettings | None = None,
) -> str | None:
    """Why the lane gets no pod (None: it gets one); with `pods`, a hostPath model outside
    the allowed directories is one reason (`engine_objects.host_path_refusal`)."""
    if placement is None or placement.verdict != "Fits":
        return "the lane is not placed"
    if placement.residence != "host":
        return (
            f"a lane residing on the {placement.residence} needs a share of the engine's "
            "GPU (HAMi or MPS); its pod is not created yet: run `continuum embed --lane` there"
        )
    model = _model(lane, engine)
    if model is None or model.source is None:
        return "the model is known only by inline facts: there is no file for a pod to load"
    if pods is not None:
        return engine_objects.host_path_refusal(model, pods)
    return None


#: What the lane's pod may do with its own EmbedLane (by name): read it, and list and watch it
#: with a field selector on its name, as `continuum embed --lane` follows its lease.
LANE_READ_VERBS = ["get", "list", "watch"]


def lane_identity(lane: EmbedLane, uid: str) -> list[Manifest]:
    """The pod's identity: it reads and watches its own EmbedLane and patches its
    status.runtime, and it may review its callers' tokens (TokenReviews, through
    `system:auth-delegator`)."""
    name = deployment_name(lane)
    ns = lane.metadata.namespace
    meta = {
        "name": name,
        "namespace": ns,
        "labels": _labels(lane),
        "ownerReferences": [_owner(lane, uid)],
    }
    return [
        *engine_identity.own_account(meta, "embedlanes", lane.metadata.name, LANE_READ_VERBS),
        engine_identity.token_review_binding(
            token_review_binding_name(lane),
            {**_labels(lane), "continuum.dev/embedlane-namespace": ns},
            name,
            ns,
        ),
    ]


def token_review_binding_name(lane: EmbedLane) -> str:
    """One per lane: `:` cannot appear in a namespace or a name, so two never collide (nor
    with an engine's, `continuum-engine-tokenreview:NS:NAME`)."""
    return f"continuum-embedlane-tokenreview:{lane.metadata.namespace}:{lane.metadata.name}"


def lane_network_policy(lane: EmbedLane, uid: str, pods: PodSettings) -> Manifest:
    """Who reaches the lane's pod: its own namespace on the serving port (the namespace whose
    service accounts it serves: no one else could be served), namespaces labelled
    `continuum.dev/scrape-engines=true` on the admin port (/metrics, /v1/runtime). Enforced
    where the cluster's network plugin enforces NetworkPolicies."""
    metadata = {
        "name": deployment_name(lane),
        "namespace": lane.metadata.namespace,
        "labels": _labels(lane),
        "ownerReferences": [_owner(lane, uid)],
    }
    callers = engine_identity.namespaces_named([lane.metadata.namespace])
    return engine_identity.door_policy(metadata, _selector(lane), callers, pods.port)


def whole_cpus(quantity: object) -> int | None:
    """Whole CPUs of a Kubernetes CPU quantity ("16", "15500m", 16): rounded down; None where
    it is not one (the engine then gets its minimum)."""
    text = str(quantity).strip() if quantity is not None else ""
    try:
        if text.endswith("m"):
            return int(text[:-1]) // 1000
        return int(float(text))
    except ValueError:
        return None


def cpu_cores(quantity: str) -> float | None:
    """A CPU quantity (`2`, `1.5`, `500m`) in cores; None if it is not one."""
    found = _CPU_QUANTITY.fullmatch(quantity.strip())
    if found is None:
        return None
    value = float(found.group(1))
    return value / 1000 if found.group(2) else value


def lane_threads(quantity: str) -> int:
    """llama.cpp threads for a lane's pod of `quantity` CPUs: its whole CPUs, at least 1 (a
    thread more than the pod's CPUs only waits for its share)."""
    return max(1, whole_cpus(quantity) or 1)


def _weights(facts: ModelFacts | None) -> int:
    if facts is None:
        return 0
    return sum(facts.layer_bytes_list()) + facts.input_bytes + facts.output_bytes


def lane_deployment(
    lane: EmbedLane,
    uid: str,
    placement: EmbedLanePlacement,
    engine: Engine | None,
    pods: PodSettings,
    facts: ModelFacts | None = None,
) -> Manifest:
    """The lane's Deployment on its node (call only when `why_no_pod` is None). `facts` are
    the model's when they are known beyond its spec (an engine's facts Job read them).

    Memory is requested and limited at the lane's host bytes, the mapped weights (their pages
    are charged to the pod's cgroup) and the process's overhead: the Guaranteed QoS class, as
    engines have, so the kernel never swaps the lane out first.
    """
    model, volume = _model_and_volume(lane, engine)
    memory = str(_memory_bytes(lane, placement, facts or model.facts))
    ns, name = lane.metadata.namespace, lane.metadata.name
    command = _command(lane, model, volume, pods)
    node = placement.node
    gpus = list(placement.gpus)
    key: dict[str, object] = {"cmd": command, "node": node, "memory": memory}
    if gpus:  # the engine's GPUs it sees (a lane on the host keeps its launch)
        key["gpus"] = gpus
    launch = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    container = _container(command, memory, volume, pods, gpus)
    labels = _labels(lane)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": deployment_name(lane),
            "namespace": ns,
            "labels": labels,
            "annotations": {engine_objects.LAUNCH_ANNOTATION: launch},
            "ownerReferences": [_owner(lane, uid)],
        },
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {LANE_LABEL: name}},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {engine_objects.LAUNCH_ANNOTATION: launch},
                },
                "spec": _pod_spec(lane, node, container, volume, pods),
            },
        },
    }


def _model_and_volume(
    lane: EmbedLane, engine: Engine | None
) -> tuple[ModelRef, engine_objects.ModelVolume]:
    """The lane's model and the volume that mounts its file, the one the engine mounts."""
    model = _model(lane, engine)
    assert model is not None and model.source is not None
    probe = Engine.model_validate(
        {
            "apiVersion": API_VERSION,
            "kind": "Engine",
            "metadata": {"name": lane.metadata.name, "namespace": lane.metadata.namespace},
            "spec": {
                "model": model.model_dump(by_alias=True, exclude_none=True),
                "contextTokensPerMind": 16,
            },
        }
    )
    volume = engine_objects.model_volume(probe)  # the same volume the engine mounts
    assert volume is not None
    return model, volume


def _memory_bytes(lane: EmbedLane, placement: EmbedLanePlacement, facts: ModelFacts | None) -> int:
    leased = sum(p.bytes for p in placement.pools)
    # A lane with a model of its own has its weights in its lease already; one beside an
    # engine maps the engine's file, whose pages still count against this pod.
    weights = _weights(facts)
    own = lane.spec.model is not None
    host = leased if own else leased + weights
    # The pod is sized at no less than the estimate of its context: the calibration's receipt
    # (never above the estimate for the models measured, docs/embedlanes.md) then shrinks the
    # lease but not the pod, which a changed limit would relaunch just after it started (seen
    # on the real node: a lane's first pod replaced 2 s after start, 60 KB smaller). A receipt
    # above the estimate still grows the pod.
    tokens = placement.context_tokens
    if facts is not None and tokens > 0:
        host = max(host, LaneSizer(facts).estimate(tokens).total + weights)
    return host + RUNTIME_OVERHEAD_BYTES


def _command(
    lane: EmbedLane, model: ModelRef, volume: engine_objects.ModelVolume, pods: PodSettings
) -> list[str]:
    ns, name = lane.metadata.namespace, lane.metadata.name
    command = [
        "continuum",
        "embed",
        "--lane",
        f"{ns}/{name}",
        "--model",
        volume.path,
        "--listen",
        f"0.0.0.0:{pods.port}",
        # Callers' tokens reviewed with the lane's audience (said, though it is the default);
        # /metrics and /v1/runtime on the admin port only.
        "--review-tokens",
        "--admin-port",
        str(engine_objects.ADMIN_PORT),
    ]
    if model.sha256:
        command += ["--sha256", model.sha256]
    command += ["--threads", str(lane_threads(pods.cpu))]
    return command


def _container(
    command: list[str],
    memory: str,
    volume: engine_objects.ModelVolume,
    pods: PodSettings,
    gpus: Sequence[int],
) -> Manifest:
    resources = {"cpu": pods.cpu, "memory": memory}
    return {
        "name": "embed",
        "image": pods.image,
        "imagePullPolicy": pods.image_pull_policy,
        "command": command,
        "ports": [
            {"name": "http", "containerPort": pods.port},
            {"name": "admin", "containerPort": engine_objects.ADMIN_PORT},
        ],
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "http"}, "periodSeconds": 5},
        "securityContext": engine_objects.container_security_context(),
        "volumeMounts": [volume.mount, dict(engine_objects.TMP_MOUNT)],
        # The GPUs its placement names, or none: the engine image's CUDA base sets
        # NVIDIA_VISIBLE_DEVICES=all, so where NVIDIA's runtime is the default a lane on the
        # host would see every GPU and llama.cpp would open a context on GPU 0 that no lease
        # charges.
        "env": lane_gpu_env(gpus),
    }


def _pod_spec(
    lane: EmbedLane,
    node: str,
    container: Manifest,
    volume: engine_objects.ModelVolume,
    pods: PodSettings,
) -> Manifest:
    return {
        "priorityClassName": pods.engine_priority_class,
        "serviceAccountName": deployment_name(lane),
        "securityContext": engine_objects.pod_security_context(),
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node]}
                            ]
                        }
                    ]
                }
            }
        },
        "tolerations": [
            {"key": engine_objects.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ],
        "containers": [container],
        "volumes": [volume.volume, dict(engine_objects.TMP_VOLUME)],
        "terminationGracePeriodSeconds": 30,
    } | runtime_class(pods)
