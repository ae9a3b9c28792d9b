"""What every engine and lane pod the operator builds says to the node's GPU stack: which GPUs
it sees (none unless it was given some), the RuntimeClass it runs with, and the GPU sharing
modes an engine cannot run under (kube/workloads/gpu_env.py)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from continuum_operator.kube.base.settings import GpuSharing, PodSettings
from continuum_operator.kube.engines.engine_pass import Memory
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.state.cache import BoardEntry
from continuum_operator.kube.workloads import engine_objects, lane_objects
from continuum_operator.model.embedlane import EmbedLane, EmbedLanePlacement
from tests.support import builders
from tests.support.builders import ROOT, GiB
from tests.support.helm import documents, find_helm, one, template
from tests.support.reconcile import NOW, SETTINGS, after, discrete, engine_obj, snapshot

PLACEMENT = EmbedLanePlacement(node="n", verdict="Fits", residence="host")


def lane_pod(pods: PodSettings, placement: EmbedLanePlacement = PLACEMENT) -> dict[str, Any]:
    engine, _ = builders.engine_planned_on_a_gpu()
    lane = EmbedLane.model_validate(
        yaml.safe_load((ROOT / "examples" / "embedlanes" / "notes.yaml").read_text())
    )
    made = lane_objects.lane_deployment(lane, "u", placement, engine, pods)
    spec: dict[str, Any] = made["spec"]["template"]["spec"]
    return spec


def env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def test_a_lane_on_the_host_sees_no_gpu_whatever_its_image_says() -> None:
    # The engine image's CUDA base sets NVIDIA_VISIBLE_DEVICES=all; a lane asks for no GPU, so
    # its pod says `void` (NVIDIA's runtime mounts nothing) and hides any device all the same.
    [container] = lane_pod(PodSettings())["containers"]
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    seen = env(container)
    assert (seen["NVIDIA_VISIBLE_DEVICES"], seen["CUDA_VISIBLE_DEVICES"]) == ("void", "")
    # A lane placed on its engine's GPU (residence device) sees that GPU, and only it.
    beside = PLACEMENT.model_copy(update={"residence": "device", "gpus": [1]})
    [container] = lane_pod(PodSettings(), beside)["containers"]
    assert env(container) == {"NVIDIA_VISIBLE_DEVICES": "1"}


def test_engine_and_lane_pods_run_with_the_configured_runtime_class_and_none_by_default() -> None:
    engine, plan_doc = builders.engine_planned_on_a_gpu()
    assert plan_doc.gpus == (0,)
    on_cpu = plan_doc.model_copy(update={"gpus": (), "layers_on_device": 0})
    for pods, expected in ((PodSettings(), None), (PodSettings(runtime_class="nvidia"), "nvidia")):
        for p in (plan_doc, on_cpu):
            dep = engine_objects.deployment(engine, "u", p, pods, node_has_gpus=True)
            assert dep["spec"]["template"]["spec"].get("runtimeClassName") == expected
        assert lane_pod(pods).get("runtimeClassName") == expected


def test_the_charts_runtime_class_value_reaches_the_operator() -> None:
    from continuum_operator.cli import build_parser

    helm = find_helm()
    for values, expected in (({}, ""), ({"operator": {"runtimeClassName": "nvidia"}}, "nvidia")):
        docs = documents(template(helm, values).stdout)
        [container] = one(docs, "Deployment", "-operator")["spec"]["template"]["spec"]["containers"]
        assert build_parser().parse_args(container["args"]).runtime_class == expected


def test_an_engine_of_two_gpus_under_mps_is_refused_saying_why() -> None:
    # NVIDIA's device plugin refuses an MPS request above one replica by default: the pod would
    # fail admission on its node. The Engine says so instead, and nothing is built.
    mps = replace(SETTINGS, pods=replace(SETTINGS.pods, gpu_sharing=GpuSharing.MPS))
    body = engine_obj(placement={"gpus": 2})
    w = reconcile(body, snapshot([discrete("n1", 80)]), Memory(), NOW, mps)
    assert w.deployment is None
    [ready] = [c for c in after(body, w)["status"]["conditions"] if c["type"] == "Ready"]
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "spec.placement.gpus" in ready["message"]
    assert "failRequestsGreaterThanOne" in ready["message"]
    # One GPU under MPS, or two without it, is placed.
    one_gpu = reconcile(engine_obj(), snapshot([discrete("n1", 80)]), Memory(), NOW, mps)
    assert one_gpu.deployment is not None
    assert "InvalidSpec" not in str(after(engine_obj(), one_gpu)["status"]["conditions"])
    plain = reconcile(body, snapshot([discrete("n1", 80)]), Memory(), NOW, SETTINGS)
    assert "InvalidSpec" not in str(after(body, plain)["status"]["conditions"])


def test_the_agent_sees_the_device_plugins_mps_pipes_through_the_host_path_the_chart_mounts(
    tmp_path: Path,
) -> None:
    from continuum_operator.agent import attribution, probe
    from continuum_operator.cli import build_parser

    helm = find_helm()
    ds = one(documents(template(helm).stdout), "DaemonSet", "-agent")
    pod = ds["spec"]["template"]["spec"]
    [container] = pod["containers"]
    args = build_parser().parse_args(container["args"])
    [mount] = [m for m in container["volumeMounts"] if m["name"] == "mps"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "mps"]
    # The device plugin's layout on the host: <mps-root>/<resource>/pipe (nvidia.com/gpu).
    assert volume["hostPath"]["path"] == "/run/nvidia/mps" and mount["readOnly"] is True
    assert [str(r) for r in args.mps_roots] == [mount["mountPath"]]
    host_root = tmp_path / "run-nvidia-mps"
    pipe = host_root / "nvidia.com" / "gpu" / "pipe"
    pipe.mkdir(parents=True)
    os.mkfifo(pipe / "control")
    raw = attribution.read_raw([], mps_roots=[host_root])
    [mechanism] = attribution.mechanisms(raw)
    assert str(mechanism.mechanism) == "mps" and str(pipe / "control") in mechanism.evidence
    # The probe's settings carry the roots the flag names; "" in the chart mounts nothing.
    settings = probe.ProbeSettings(mps_roots=tuple(args.mps_roots))
    assert settings.mps_roots == (Path(mount["mountPath"]),)
    ds = one(documents(template(helm, {"agent": {"mpsRoot": ""}}).stdout), "DaemonSet", "-agent")
    assert "mps" not in str(ds["spec"]["template"]["spec"]["volumes"])
    assert "--mps-root" not in str(ds["spec"]["template"]["spec"]["containers"][0]["args"])


def test_a_facts_job_reads_its_file_seeing_no_gpu() -> None:
    from continuum_operator.kube.workloads import facts_job

    engine, _ = builders.engine_planned_on_a_gpu()
    job = facts_job.facts_job(engine, "u", PodSettings())
    [container] = job["spec"]["template"]["spec"]["containers"]
    seen = env(container)
    assert (seen["NVIDIA_VISIBLE_DEVICES"], seen["CUDA_VISIBLE_DEVICES"]) == ("void", "")


def two_gpus(name: str, offered: tuple[str, ...] = ()) -> BoardEntry:
    """A node of two 80 GiB GPUs whose agent saw the per-process caps `offered`."""
    body = builders.board_body(
        "discrete",
        [
            {"kind": "host", "capacityBytes": 256 * GiB, "usedBytes": 4 * GiB},
            {"kind": "device", "device": 0, "capacityBytes": 80 * GiB, "usedBytes": 0},
            {"kind": "device", "device": 1, "capacityBytes": 80 * GiB, "usedBytes": 0},
        ],
        name=name,
    )
    return BoardEntry(builders.board(body), f"rv-{name}", cap_mechanisms=offered)


def test_an_engine_of_two_gpus_under_auto_is_not_placed_where_auto_resolves_to_mps() -> None:
    # `auto` resolves per node: on a node offering MPS (and not HAMi) it is MPS, where the device
    # plugin refuses the pod two GPUs as it does under `mps`. Such a node is no candidate.
    auto = replace(SETTINGS, pods=replace(SETTINGS.pods, gpu_sharing=GpuSharing.AUTO))
    body = engine_obj(placement={"gpus": 2})
    w = reconcile(body, snapshot([two_gpus("mps-node", ("mps",))]), Memory(), NOW, auto)
    assert w.deployment is None
    got = after(body, w)
    [placed] = [c for c in got["status"]["conditions"] if c["type"] == "Unschedulable"]
    assert placed["status"] == "True" and placed["reason"] == "NoMatchingNode"
    assert "MPS" in placed["message"] and "spec.placement.gpus" in placed["message"]
    assert "mpsPinnedDeviceMemLimit" not in str(got["status"].get("enforcement"))
    # Beside a node that shares by HAMi (offered with MPS: HAMi first) or not at all, the engine
    # goes there; one GPU goes to the MPS node as before.
    for other in (two_gpus("hami-node", ("hami", "mps")), two_gpus("plain-node")):
        snap = snapshot([two_gpus("mps-node", ("mps",)), other])
        w = reconcile(body, snap, Memory(), NOW, auto)
        assert after(body, w)["status"]["plan"]["node"] == other.board.node  # type: ignore[union-attr]
        assert w.deployment is not None
    one = engine_obj()
    w = reconcile(one, snapshot([two_gpus("mps-node", ("mps",))]), Memory(), NOW, auto)
    assert after(one, w)["status"]["enforcement"]["gpuSharing"] == "mps"
