"""The Deployment, Service and priority classes built from an Engine and its plan."""

from __future__ import annotations

from typing import Any

import pytest

from continuum_operator.core.plan import plan
from continuum_operator.kube.base.settings import GpuSharing, PodSettings
from continuum_operator.kube.workloads import engine_identity, engine_objects
from continuum_operator.kube.workloads.priority_classes import priority_classes
from continuum_operator.model.engine import Engine
from continuum_operator.model.plan_status import PlanStatus
from tests.support.builders import GiB, MiB, board, board_body, engine, engine_body

SHA = "ab" * 32


def planned(**spec: Any) -> tuple[Engine, PlanStatus]:
    e = engine(engine_body(**spec))
    b = board(
        board_body(
            "discrete",
            [
                {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 0},
                {"kind": "device", "device": 0, "capacityBytes": 80 * GiB, "usedBytes": 0},
                {"kind": "device", "device": 1, "capacityBytes": 80 * GiB, "usedBytes": 0},
            ],
        )
    )
    assert e.spec.model.facts is not None
    return e, PlanStatus.model_validate(plan(b, e.spec, e.spec.model.facts).to_dict())


def container(d: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = d["spec"]["template"]["spec"]["containers"][0]
    return c


def test_the_deployment_recreates_and_runs_the_plans_arguments_on_the_placed_node() -> None:
    e, p = planned()
    d = engine_objects.deployment(e, "uid-1", p, PodSettings(), node_has_gpus=True)
    assert d["spec"]["strategy"] == {"type": "Recreate"}
    assert d["spec"]["replicas"] == 1
    cmd = container(d)["command"]
    assert cmd[:4] == ["continuum", "engine", "--engine", "ns/eng"]
    assert cmd[cmd.index("--") + 1 :] == list(p.engine_args)
    terms = d["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    assert terms[0]["matchFields"][0]["values"] == ["node-a"]
    assert d["spec"]["template"]["spec"]["priorityClassName"] == "continuum-engine"
    owner = d["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("Engine", "uid-1", True)


def test_requests_equal_limits_sized_from_the_plans_host_bytes() -> None:
    e, p = planned()
    pods = PodSettings(memory_overhead_bytes=256 * MiB)
    r = container(engine_objects.deployment(e, "u", p, pods, node_has_gpus=True))["resources"]
    assert r["requests"] == r["limits"]  # Guaranteed QoS
    host = p.bytes.host
    in_use = host.weights + host.kv + host.compute
    assert int(r["limits"]["memory"]) >= in_use + 256 * MiB
    assert int(r["limits"]["memory"]) - (in_use + 256 * MiB) < MiB
    assert r["limits"]["nvidia.com/gpu"] == "1"


def test_no_gpu_is_requested_on_a_node_without_gpus() -> None:
    e, p = planned()
    r = container(engine_objects.deployment(e, "u", p, PodSettings(), node_has_gpus=False))[
        "resources"
    ]
    assert "nvidia.com/gpu" not in r["limits"]


def env_of(d: dict[str, Any]) -> dict[str, str]:
    return {v["name"]: v.get("value", "") for v in container(d).get("env", [])}


def test_an_engine_planned_with_nothing_on_a_gpu_sees_none() -> None:
    """A CUDA build of llama.cpp that can see a GPU holds a context and a graph there even at
    --n-gpu-layers 0 (562 MiB on an H200, tests/fixtures/h200): the pod hides the GPUs."""
    e, p = planned(offload="none")
    assert p.layers_on_device == 0 and p.gpus == ()
    d = engine_objects.deployment(e, "u", p, PodSettings(), node_has_gpus=True)
    assert "nvidia.com/gpu" not in container(d)["resources"]["limits"]
    env = env_of(d)
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void" and env["CUDA_VISIBLE_DEVICES"] == ""
    e, p = planned()  # layers on a GPU: that GPU, from the device plugin, and no hiding
    env = env_of(engine_objects.deployment(e, "u", p, PodSettings(), node_has_gpus=True))
    assert "NVIDIA_VISIBLE_DEVICES" not in env and "CUDA_VISIBLE_DEVICES" not in env


def test_several_gpus_are_requested_when_the_plan_splits_the_model() -> None:
    e, p = planned(placement={"gpus": 2})
    r = container(engine_objects.deployment(e, "u", p, PodSettings(), node_has_gpus=True))[
        "resources"
    ]
    assert r["limits"]["nvidia.com/gpu"] == "2"
    assert "--tensor-split" in p.engine_args


def test_hami_caps_each_gpu_at_the_plans_device_bytes() -> None:
    e, p = planned(placement={"gpus": 2})
    pods = PodSettings(gpu_sharing=GpuSharing.HAMI)
    r = container(engine_objects.deployment(e, "u", p, pods, node_has_gpus=True))["resources"]
    device = p.bytes.device
    per_gpu_mib = -(-(device.weights + device.kv + device.compute) // 2 // MiB)
    assert r["limits"]["nvidia.com/gpumem"] == str(per_gpu_mib)
    rules = engine_objects.enforcement(p, pods, node_has_gpus=True)
    assert rules["gpuSharing"] == "hami" and rules["hamiGpumemMiB"] == per_gpu_mib


def test_mps_pins_each_visible_device_in_the_environment() -> None:
    e, p = planned(placement={"gpus": 2})
    pods = PodSettings(gpu_sharing=GpuSharing.MPS)
    env = container(engine_objects.deployment(e, "u", p, pods, node_has_gpus=True))["env"]
    (limit,) = [v["value"] for v in env if v["name"] == "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
    assert limit.startswith("0=") and ",1=" in limit and limit.endswith("M")


def test_engine_arguments_are_always_enforced_and_nothing_else_by_default() -> None:
    _, p = planned()
    rules = engine_objects.enforcement(p, PodSettings(), node_has_gpus=True)
    assert rules["engineArgs"] is True and rules["gpuSharing"] == "none"
    assert "hamiGpumemMiB" not in rules and "mpsPinnedDeviceMemLimit" not in rules


@pytest.mark.parametrize(
    ("source", "volume_key", "model_path"),
    [
        ({"kind": "pvc", "claimName": "models", "path": "qwen/q4.gguf"},
         "persistentVolumeClaim", "/models/qwen/q4.gguf"),
        ({"kind": "hostPath", "path": "/srv/models/q4.gguf"}, "hostPath", "/models/q4.gguf"),
        ({"kind": "image", "image": "registry.example/models:q4", "path": "q4.gguf"},
         "image", "/models/q4.gguf"),
    ],
)  # fmt: skip
def test_the_model_source_becomes_a_read_only_volume_and_its_digest_is_passed(
    source: dict[str, Any], volume_key: str, model_path: str
) -> None:
    facts = engine_body()["spec"]["model"]["facts"]
    e, p = planned(model={"source": source, "sha256": SHA, "facts": facts})
    d = engine_objects.deployment(e, "u", p, PodSettings(), node_has_gpus=True)
    (volume,) = [v for v in d["spec"]["template"]["spec"]["volumes"] if v["name"] == "model"]
    assert volume_key in volume
    c = container(d)
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model"]
    cmd = c["command"]
    assert cmd[cmd.index("--model") + 1] == model_path
    assert cmd[cmd.index("--sha256") + 1] == SHA
    if volume_key == "hostPath":
        # The file itself, never its directory: the rest of /srv/models stays on the host.
        assert volume["hostPath"] == {"path": "/srv/models/q4.gguf", "type": "File"}
        assert mount == {"name": "model", "mountPath": "/models/q4.gguf", "readOnly": True}
    else:
        assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}


def test_the_launch_changes_with_the_arguments_and_only_with_them() -> None:
    e, p = planned()
    pods = PodSettings()
    same = engine_objects.launch_hash(e, p.model_copy(), pods)
    assert engine_objects.launch_hash(e, p, pods) == same
    moved = p.model_copy(update={"engine_args": (*p.engine_args[:-1], "off")})
    assert engine_objects.launch_hash(e, moved, pods) != same
    d = engine_objects.deployment(e, "u", p, pods, node_has_gpus=True)
    template = d["spec"]["template"]["metadata"]["annotations"]
    assert template[engine_objects.LAUNCH_ANNOTATION] == same


def test_the_service_selects_the_engines_pod() -> None:
    e, _ = planned()
    s = engine_objects.service(e, "u", PodSettings(port=9000))
    assert s["spec"]["selector"] == engine_objects.selector(e)
    assert s["spec"]["ports"][0]["port"] == 9000


def test_engines_outrank_minds_and_minds_never_preempt() -> None:
    engine_class, mind_class, *_ = priority_classes(PodSettings())
    assert engine_class["value"] > mind_class["value"]
    assert mind_class["preemptionPolicy"] == "Never"


def test_a_minds_children_rank_below_every_class_and_ordinary_pods_and_never_preempt() -> None:
    pods = PodSettings(children_priority_class="kids", children_priority=-7)
    classes = priority_classes(pods)
    children = next(c for c in classes if c["metadata"]["name"] == "kids")
    assert children["value"] == -7
    assert children["value"] < 0  # ordinary pods have priority 0
    assert all(children["value"] < c["value"] for c in classes if c is not children)
    assert children["preemptionPolicy"] == "Never"
    assert children["globalDefault"] is False


def test_the_engine_pod_may_read_its_own_engine_and_ledger_and_write_its_status_only() -> None:
    e, p = planned()
    account, role, binding, _review = engine_identity.engine_rbac(e, "u")
    assert account["kind"] == "ServiceAccount"
    assert {tuple(r["resourceNames"]) for r in role["rules"]} == {("eng",)}
    verbs = {r["resources"][0]: set(r["verbs"]) for r in role["rules"]}
    # Its GrantLedger is read (watched by name) and never written: the operator's alone.
    assert verbs == {
        "engines": {"get", "list", "watch"},
        "engines/status": {"get", "patch"},
        "grantledgers": {"get", "list", "watch"},
    }
    assert all(len(r["resources"]) == 1 for r in role["rules"])
    assert binding["subjects"][0]["name"] == account["metadata"]["name"]
    d = engine_objects.deployment(e, "u", p, PodSettings(), node_has_gpus=True)
    assert d["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
