"""The facts Job: a pod on the Engine's node that reads its model file's GGUF header (and checks
its digest) and writes `status.modelFacts`, before a plan is made from the file rather than from
inline facts. Plain dicts, no API calls. Neighbours: `kube.workloads.engine_objects` (the model
volume, security contexts), `kube.engines.reconcile` (when to run it).
"""

from __future__ import annotations

import hashlib

from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.workloads.engine_objects import (
    GPU_RESOURCE,
    MANAGED_BY,
    Manifest,
    container_security_context,
    model_volume,
    owner_reference,
    pod_security_context,
)
from continuum_operator.kube.workloads.gpu_env import NO_GPU_ENV
from continuum_operator.model.engine import Engine, ModelSourceKind

__all__ = ["FACTS_FOR_LABEL", "facts_command", "facts_job", "facts_job_name", "source_key"]


FACTS_FOR_LABEL = "continuum.dev/facts-for"


def source_key(engine: Engine) -> str | None:
    """Identity of the model file: what the facts in status were read from."""
    source = engine.spec.model.source
    if source is None:
        return None
    where = {
        ModelSourceKind.PVC: f"pvc:{source.claim_name}",
        ModelSourceKind.HOST_PATH: "hostPath:",
        ModelSourceKind.IMAGE: f"image:{source.image}",
    }[source.kind]
    return f"{where}/{source.path.lstrip('/')}@{engine.spec.model.sha256 or '-'}"


def facts_job_name(engine: Engine) -> str:
    key = hashlib.sha256((source_key(engine) or "").encode()).hexdigest()[:8]
    return f"{engine.metadata.name[:45]}-facts-{key}"


def facts_command(engine: Engine, path: str) -> list[str]:
    """`continuum facts`, checking the file's digest where the Engine names one: a replaced
    file fails the Job (both digests in its log) rather than feed its facts to the plan."""
    cmd = ["continuum", "facts", path, "-o", "json"]
    if engine.spec.model.sha256:
        cmd += ["--expect-sha256", engine.spec.model.sha256]
    return cmd


def facts_job(engine: Engine, uid: str, pods: PodSettings) -> Manifest:
    """A short Job that reads the model's GGUF header where the file is and prints its facts.

    It runs on a node the engine may be placed on (its nodeSelector), with the model's volume;
    `continuum facts` reads the header and tensor index only, never the weights. The operator
    reads the facts from the pod's log when the Job succeeds.
    """
    model = model_volume(engine)
    assert model is not None, "a facts Job needs spec.model.source"
    volume, path = model.volume, model.path
    selector = dict(engine.spec.placement.node_selector)
    if engine.spec.placement.node_pool:
        selector["continuum.dev/node-pool"] = engine.spec.placement.node_pool
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        "priorityClassName": pods.engine_priority_class,
        # It reads one file and prints; it has no business with the API server.
        "automountServiceAccountToken": False,
        "securityContext": pod_security_context(),
        "tolerations": [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [
            {
                "name": "facts",
                "image": pods.image,
                "imagePullPolicy": pods.image_pull_policy,
                "command": facts_command(engine, path),
                "resources": {
                    "requests": {"cpu": "100m", "memory": "256Mi"},
                    "limits": {"cpu": "1", "memory": "256Mi"},
                },
                "securityContext": container_security_context(),
                "volumeMounts": [model.mount],
                # It reads a file: no GPU, whatever the CUDA image's NVIDIA_VISIBLE_DEVICES says.
                "env": [dict(e) for e in NO_GPU_ENV],
            }
        ],
        "volumes": [volume],
    }
    if selector:
        pod_spec["nodeSelector"] = selector
    job_labels = {
        "app.kubernetes.io/name": "continuum-facts",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        FACTS_FOR_LABEL: engine.metadata.name,
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": facts_job_name(engine),
            "namespace": engine.metadata.namespace,
            "labels": job_labels,
            "annotations": {"continuum.dev/model-source": source_key(engine)},
            "ownerReferences": [owner_reference(engine, uid)],
        },
        "spec": {
            "backoffLimit": 1,
            "activeDeadlineSeconds": 600,
            "ttlSecondsAfterFinished": 3600,
            "template": {"metadata": {"labels": job_labels}, "spec": pod_spec},
        },
    }
