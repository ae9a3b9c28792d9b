"""Runtime truth (issue 21): the model served is the model named, the bytes planned are the
bytes measured, the engine's CPUs are what its plan keeps on the host, and a crash loop stops.

The engine runtime runs tests/support/fake_llama.py (or a script that fails) as its llama-server;
the operator's side is one reconcile pass at a time against snapshots, with a fake clock.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from continuum_operator.cli import main
from continuum_operator.core.plan import plan
from continuum_operator.core.pools import BoardLeases
from continuum_operator.core.receipts import (
    LOG_RESOLUTION_BYTES,
    BufferKind,
    Receipt,
)
from continuum_operator.engine import digest
from continuum_operator.engine.runtime import (
    EngineRuntime,
    LaunchSettings,
    error_line,
    thread_args,
)
from continuum_operator.kube.base.metrics import OperatorMetrics
from continuum_operator.kube.base.settings import PodSettings
from continuum_operator.kube.engines.engine_pass import pods_on
from continuum_operator.kube.engines.reconcile import reconcile
from continuum_operator.kube.workloads import engine_objects, facts_job
from continuum_operator.kube.workloads.lane_objects import whole_cpus
from continuum_operator.model.engine import Engine
from continuum_operator.model.plan_status import PlanStatus
from tests.support import builders
from tests.support.builders import engine, engine_body
from tests.support.engine_runtime import fake_server, run_runtime
from tests.support.reconcile import (
    NOW,
    SETTINGS,
    after,
    conditions,
    discrete,
    engine_obj,
    snapshot,
)
from tests.support.runtime_truth import SHA_NAMED, _launch, _receipt_for, _serving
from tests.support.waiting import until

MiB = 1 << 20
BYTES = b"GGUF" + b"\0" * 1000


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the digest --------------------------------------------------------------------------------


def test_a_file_is_hashed_in_chunks_with_progress_and_the_digest_of_its_bytes(
    tmp_path: Path,
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(BYTES * 50)
    seen: list[tuple[int, int]] = []
    ticks = iter(range(1000))
    got = digest.hash_file(
        model,
        chunk_bytes=4096,
        progress=lambda done, total, s: seen.append((done, total)),
        clock=lambda: float(next(ticks)),
        every_seconds=3,
    )
    assert got == sha(BYTES * 50)
    total = len(BYTES) * 50
    assert seen[-1] == (total, total) and len(seen) > 2
    assert all(a[0] < b[0] for a, b in itertools.pairwise(seen))


def test_a_file_verified_before_is_not_hashed_again_but_a_rewritten_one_is(
    tmp_path: Path,
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(BYTES)
    first = digest.verify(model, sha(BYTES), None, node="a")
    assert first.verdict is digest.DigestOutcome.HASHED and first.matches(sha(BYTES))
    record = digest.VerifiedModel.from_status(json.loads(json.dumps(first.record.to_status())))
    assert record == first.record
    again = digest.verify(model, sha(BYTES), record, node="a")
    assert again.verdict is digest.DigestOutcome.SKIPPED
    # Another node's file of the same path, a record of another digest, --rehash: hashed.
    assert digest.verify(model, sha(BYTES), record, node="b").verdict is digest.DigestOutcome.HASHED
    assert digest.verify(model, "0" * 64, record, node="a").verdict is digest.DigestOutcome.HASHED
    assert (
        digest.verify(model, sha(BYTES), record, node="a", rehash=True).verdict
        is digest.DigestOutcome.HASHED
    )
    # Replaced with other bytes, its times set back to the old ones: ctime still moved.
    st = os.stat(model)
    time.sleep(0.01)
    model.write_bytes(b"GGUF" + b"\1" * 1000)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    replaced = digest.verify(model, sha(BYTES), record, node="a")
    assert replaced.verdict is digest.DigestOutcome.HASHED
    assert not replaced.matches(sha(BYTES))


def test_a_malformed_record_vouches_for_nothing() -> None:
    assert digest.VerifiedModel.from_status({"path": "/m", "sha256": "x"}) is None
    assert digest.VerifiedModel.from_status("junk") is None
    assert digest.VerifiedModel.from_status(None) is None


def test_the_facts_job_refuses_a_file_of_another_digest_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from continuum_operator.testing.tiny_gguf import TinyModelShape, write_tiny_gguf

    model = tmp_path / "m.gguf"
    write_tiny_gguf(model, TinyModelShape(n_layer=2, n_embd=64, n_ff=96, vocab_size=300))
    actual = sha(model.read_bytes())
    assert main(["facts", str(model), "-o", "json", "--expect-sha256", actual]) == 0
    assert "layers" in json.loads(capsys.readouterr().out)
    assert main(["facts", str(model), "-o", "json", "--expect-sha256", "ab" * 32]) == 2
    err = capsys.readouterr().err
    assert actual in err and "ab" * 32 in err and "spec.model.sha256" in err
    body = engine_body(
        model={"source": {"kind": "pvc", "claimName": "models", "path": "m.gguf"},
               "sha256": "cd" * 32}
    )  # fmt: skip
    cmd = facts_job.facts_command(engine(body), "/models/m.gguf")
    assert cmd[-2:] == ["--expect-sha256", "cd" * 32]


# --- the runtime -------------------------------------------------------------------------------


def test_a_model_file_of_another_digest_is_never_served_nor_receipted(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(BYTES)
    named = "ab" * 32
    launch = LaunchSettings(
        llama_server=fake_server(tmp_path), model=model, args=(), model_sha256=named
    )

    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        await until(
            lambda: bool(published) and published[-1]["phase"] == "ModelMismatch", timeout=60.0
        )
        await asyncio.sleep(0.3)  # time enough to start llama-server, were it to
        doc = published[-1]
        assert runtime.process is None
        assert doc["ready"] is False and doc["receipts"] == []
        assert named in doc["message"] and sha(BYTES) in doc["message"]
        assert doc["modelFile"]["sha256"] == sha(BYTES)
        assert doc["modelFile"]["verdict"] == "Mismatch"

    run_runtime(launch, body)


def test_the_model_checked_is_receipted_under_its_digest_with_threads_set(
    tmp_path: Path,
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(BYTES)
    launch = LaunchSettings(
        llama_server=fake_server(tmp_path),
        model=model,
        args=("--ctx-size", "1024", "--parallel", "2"),
        model_sha256=sha(BYTES),
        threads=6,
        launch="abc123",
    )

    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        await until(lambda: bool(published) and published[-1]["phase"] == "Serving", timeout=60.0)
        doc = published[-1]
        assert doc["receipts"][0]["modelSha256"] == sha(BYTES)
        assert doc["modelFile"]["verdict"] == "Hashed"
        assert (doc["threads"], doc["launch"]) == (6, "abc123")
        argv = runtime.launch.argv(1, tmp_path)
        assert argv[argv.index("--threads") + 1] == "6"
        assert argv[argv.index("--threads-batch") + 1] == "6"

    run_runtime(launch, body)


def test_thread_arguments_given_to_llama_server_are_kept() -> None:
    assert thread_args(["-t", "3"], 8) == ["-t", "3", "--threads-batch", "8"]
    assert thread_args(["--ctx-size", "9"], None) == ["--ctx-size", "9"]


def test_a_llama_server_that_keeps_failing_is_stopped_after_n_restarts_saying_why(
    tmp_path: Path,
) -> None:
    script = tmp_path / "llama-server"
    script.write_text(
        "#!/bin/sh\necho 'load_tensors: loading model'\n"
        "echo 'llama_model_load: error loading model: tensor data is not within file bounds'\n"
        "echo 'main: exiting due to model loading error'\nexit 1\n"
    )
    script.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(BYTES)
    launch = LaunchSettings(
        llama_server=str(script),
        model=model,
        args=(),
        verify_model=False,
        restart_backoff=(0.05,),
        max_restarts=2,
        restart_window_seconds=60,
    )

    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        await until(lambda: bool(published) and published[-1]["phase"] == "Stopped", timeout=60.0)
        doc = published[-1]
        assert doc["restarts"] == 2 and doc["ready"] is False
        assert doc["lastExit"]["code"] == 1
        # The cause, not the consequence llama.cpp prints after it.
        assert doc["lastExit"]["line"] == (
            "llama_model_load: error loading model: tensor data is not within file bounds"
        )
        assert "exited 3 times in 60 s" in doc["message"]
        first = runtime.process
        await asyncio.sleep(0.3)
        assert runtime.process is first  # not started again

    run_runtime(launch, body)


def test_the_line_kept_from_a_failed_load_is_its_cause_not_llama_cpps_goodbye() -> None:
    # llama-server's own lines (this build) loading a model with a tokenizer it does not know.
    log = [
        "0.00.009.383 E llama_model_load: error loading model: error loading model vocabulary: "
        "unknown tokenizer: 'lxama'",
        "0.00.009.468 E llama_model_load_from_file_impl: failed to load model",
        "0.00.009.528 E common_fit_params: encountered an error while trying to fit params to "
        "free device memory: failed to load model",
        "0.00.010.212 E cmn  common_init_: failed to load model '/models/m.gguf'",
        "0.00.010.246 E srv    load_model: failed to load model, '/models/m.gguf'",
        "0.00.010.830 E srv  llama_server: exiting due to model loading error",
    ]
    assert error_line(log).endswith("unknown tokenizer: 'lxama'")
    # Only a goodbye: that, rather than nothing; no error at all: the last line.
    assert error_line(log[-1:]) == log[-1]
    assert error_line(["GGML_ASSERT(n > 0) failed", "Aborted (core dumped)"]) == (
        "GGML_ASSERT(n > 0) failed"
    )
    assert error_line(["load_tensors: ok", "", "bye"]) == "bye"


# --- receipts feed plans -----------------------------------------------------------------------


def _sum(r: Receipt, host: bool, *kinds: BufferKind) -> int:
    return sum(
        b.bytes + LOG_RESOLUTION_BYTES
        for b in r.buffers
        if b.kind in kinds and (b.device == "CPU") == host
    )


def test_a_plan_says_whether_its_bytes_are_a_receipts_or_an_estimate() -> None:
    body = engine_body(model={**engine_body()["spec"]["model"], "sha256": "ab" * 32})
    spec = engine(body).spec
    assert spec.model.facts is not None
    b = discrete("a", 80).board
    assert b is not None
    estimate = plan(b, spec, spec.model.facts, BoardLeases(b))
    assert estimate.to_dict()["source"] == "estimate" and estimate.to_dict()["receipt"] is None
    receipt = _receipt_for(estimate.to_dict(), "ab" * 32)
    measured = plan(b, spec, spec.model.facts, BoardLeases(b), receipts=[receipt])
    doc = measured.to_dict()
    assert doc["source"] == "receipt" and doc["receipt"]["modelSha256"] == "ab" * 32
    assert doc["bytes"]["device"]["weights"] == _sum(receipt, False, BufferKind.MODEL)
    assert doc["bytes"]["device"]["kv"] == _sum(receipt, False, BufferKind.KV)
    assert doc["bytes"]["host"]["compute"] == _sum(receipt, True, BufferKind.COMPUTE)
    # Another build than the one running: not this launch's receipt.
    other = plan(b, spec, spec.model.facts, BoardLeases(b), receipts=[receipt], llama_build="1 (x)")
    assert other.to_dict()["source"] == "estimate"


def _with_runtime(body: dict[str, Any], runtime: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(body))
    out["status"]["runtime"] = runtime
    return out


def test_a_receipt_in_status_runtime_recharges_the_running_launch_without_a_relaunch() -> None:
    body, mem, snap = _serving()
    planned = body["status"]["plan"]
    assert planned["source"] == "estimate"
    receipt = _receipt_for(planned, SHA_NAMED)
    launch = snap.deployments[("ns", "coder")].launch
    runtime = {"receipts": [receipt.model_dump(mode="json", by_alias=True)],
               "llamaBuild": receipt.llama_build, "phase": "Serving", "launch": launch}  # fmt: skip
    w = reconcile(_with_runtime(body, runtime), snap, mem, NOW + 2, SETTINGS)
    body2 = after(_with_runtime(body, runtime), w)
    new = body2["status"]["plan"]
    assert new["source"] == "receipt" and new["engineArgs"] == planned["engineArgs"]
    assert new["bytes"]["device"]["kv"] == _sum(receipt, False, BufferKind.KV)
    # The lease follows the plan; the pod is the same launch (nothing relaunched).
    assert {x["pool"]: x["bytes"] for x in body2["status"]["placement"]["pools"]} == {
        c["pool"]: c["bytes"] for c in new["charges"]
    }
    assert body2["status"]["placement"]["assumed"] is False
    assert w.deployment is not None
    assert w.deployment["metadata"]["annotations"][engine_objects.LAUNCH_ANNOTATION] == launch
    assert [e.reason for e in w.events] == ["Recharged"]
    # llama-server restarts and reports no receipt for a while: the plan keeps the one it used.
    w = reconcile(_with_runtime(body2, {"receipts": []}), snap, w.memory, NOW + 3, SETTINGS)
    assert w.status_patch is None or "plan" not in w.status_patch["status"]


def test_a_receipt_of_another_model_digest_is_never_planned_from() -> None:
    body, mem, snap = _serving()
    receipt = _receipt_for(body["status"]["plan"], "cd" * 32)
    runtime = {"receipts": [receipt.model_dump(mode="json", by_alias=True)],
               "launch": _launch(body, snap)}  # fmt: skip
    w = reconcile(_with_runtime(body, runtime), snap, mem, NOW + 2, SETTINGS)
    assert w.status_patch is None or "plan" not in w.status_patch["status"]


def test_a_receipt_alone_relaunches_a_running_engine_only_as_damping_allows() -> None:
    # 24 GiB with 14 used by another: the estimate fits 2 minds. The receipt of that launch says
    # llama.cpp allocated 1.12 times the estimated KV and compute and 1.05 times the weights
    # (within the bound of the estimate), more than the budget: with nothing else
    # changed (the board reads the same), the smaller launch follows after three agreeing
    # readings, not before; without the receipt nothing moves.
    body, mem, snap = _serving(24, used_gib=14)
    planned = body["status"]["plan"]
    assert planned["mindsGrantable"] == 2
    receipt = _receipt_for(planned, SHA_NAMED, scale=1.12, weights=1.05)
    outcomes: dict[bool, list[list[str]]] = {}
    for with_receipt in (False, True):
        runtime = {
            "receipts": [receipt.model_dump(mode="json", by_alias=True)] if with_receipt else [],
            "launch": _launch(body, snap),
        }
        b, m = _with_runtime(body, runtime), mem
        outcomes[with_receipt] = []
        for i in range(5):  # distinct readings: Lease renewals
            s = replace(snap, leases={"a": replace(snap.leases["a"], resource_version=f"r{i}")})
            w = reconcile(b, s, m, NOW + 10 + i, SETTINGS)
            b, m = _with_runtime(after(b, w), runtime), w.memory
            outcomes[with_receipt].append(
                [e.reason for e in w.events if e.reason in ("Recharged", "Relaunching")]
            )
        if with_receipt:
            assert b["status"]["plan"]["mindsGrantable"] == 1
    assert outcomes == {False: [[]] * 5, True: [[], [], ["Relaunching"], [], []]}


# --- what the runtime reports, in conditions ---------------------------------------------------


def test_a_refused_model_makes_the_engine_not_ready_naming_both_digests() -> None:
    body, mem, snap = _serving()
    message = f"model file /models/m.gguf has sha256 {'ef' * 32}, but ... {SHA_NAMED}"
    stale = {"phase": "ModelMismatch", "message": message, "launch": "an-older-pod"}
    w = reconcile(_with_runtime(body, stale), snap, mem, NOW + 2, SETTINGS)
    assert conditions(after(_with_runtime(body, stale), w))["Ready"] == ("True", "PodReady")
    current = {**stale, "launch": _launch(body, snap)}
    w = reconcile(_with_runtime(body, current), snap, mem, NOW + 2, SETTINGS)
    out = after(_with_runtime(body, current), w)
    assert conditions(out)["Ready"] == ("False", "ModelDigestMismatch")
    ready_c = next(c for c in out["status"]["conditions"] if c["type"] == "Ready")
    assert "ef" * 32 in ready_c["message"] and SHA_NAMED in ready_c["message"]


def test_a_recent_restart_is_degraded_with_its_error_line_then_clears() -> None:
    body, mem, snap = _serving()
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(NOW))
    last = {"code": 134, "at": at, "line": "GGML_ASSERT(n_ctx > 0) failed"}
    runtime = {"phase": "Serving", "restarts": 2, "launch": _launch(body, snap), "lastExit": last}
    w = reconcile(_with_runtime(body, runtime), snap, mem, NOW + 5, SETTINGS)
    out = after(_with_runtime(body, runtime), w)
    assert conditions(out)["Degraded"] == ("True", "EngineRestarted")
    degraded = next(c for c in out["status"]["conditions"] if c["type"] == "Degraded")
    assert (
        "GGML_ASSERT(n_ctx > 0) failed" in degraded["message"] and "2 time" in degraded["message"]
    )
    later = NOW + SETTINGS.pods.restart_window_seconds + 10
    w = reconcile(out, snap, w.memory, later, SETTINGS)
    assert conditions(after(out, w))["Degraded"][1] != "EngineRestarted"
    stopped = {**runtime, "phase": "Stopped", "message": "llama-server exited 6 times"}
    w = reconcile(_with_runtime(body, stopped), snap, mem, NOW + 5, SETTINGS)
    assert conditions(after(_with_runtime(body, stopped), w))["Ready"] == (
        "False",
        "EngineStopped",
    )


def test_runtime_restarts_count_as_crashed_relaunches_once_each() -> None:
    m = OperatorMetrics()

    def crashed() -> float:
        v = m.registry.get_sample_value(
            "continuum_engine_relaunches_total",
            {"namespace": "ns", "engine": "coder", "cause": "Crashed"},
        )
        return v or 0.0

    m.record_runtime_restarts("ns", "coder", {"runtime": {"restarts": 4, "launch": "l1"}})
    assert crashed() == 0  # the baseline: restarts before this replica looked
    m.record_runtime_restarts("ns", "coder", {"runtime": {"restarts": 6, "launch": "l1"}})
    m.record_runtime_restarts("ns", "coder", {"runtime": {"restarts": 6, "launch": "l1"}})
    assert crashed() == 2
    m.record_runtime_restarts("ns", "coder", {"runtime": {"restarts": 1, "launch": "l2"}})
    assert crashed() == 3
    m.record_relaunch("ns", "coder")
    planned = m.registry.get_sample_value(
        "continuum_engine_relaunches_total",
        {"namespace": "ns", "engine": "coder", "cause": "Planned"},
    )
    assert planned == 1


# --- CPUs from the plan ------------------------------------------------------------------------


def _plan(on_device: int, total: int = 33) -> PlanStatus:
    return builders.plan_on_a_gpu(
        layers_on_device=on_device,
        total_layers=total,
        node="a",
        gpus=(0,),
        engine_args=("--n-gpu-layers", str(on_device)),
    )


@pytest.mark.parametrize(
    ("on_device", "node_cpus", "cpu_max", "want"),
    [
        (33, 64, None, 2),  # every layer on the device: the minimum
        (0, 64, None, 32),  # every layer on the host: half the node's
        (0, 64, 12, 12),  # bounded by cpu_max
        (17, 64, None, 2 + -(-30 * 16 // 33)),  # 16 of 33 layers on the host
        (0, 3, None, 2),  # a node smaller than the minimum: the minimum
        (0, None, None, 2),  # a node of unknown CPUs: the minimum
    ],
)
def test_an_engines_cpus_follow_the_layers_kept_on_the_host_and_the_nodes_cores(
    on_device: int, node_cpus: int | None, cpu_max: int | None, want: int
) -> None:
    pods = PodSettings(node_cpus=node_cpus, cpu_max=cpu_max)
    assert engine_objects.engine_cpus(_plan(on_device), pods) == want
    e = Engine.model_validate(engine_obj())
    dep = engine_objects.deployment(e, "uid", _plan(on_device), pods, node_has_gpus=True)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    res = container["resources"]
    assert res["requests"] == res["limits"] and res["limits"]["cpu"] == str(want)  # Guaranteed
    cmd = container["command"]
    assert cmd[cmd.index("--threads") + 1] == str(want)


def test_the_engine_container_has_a_liveness_probe_and_names_its_launch() -> None:
    e = Engine.model_validate(engine_obj())
    dep = engine_objects.deployment(e, "uid", _plan(33), PodSettings(), node_has_gpus=True)
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    [env] = [x for x in container["env"] if x["name"] == engine_objects.LAUNCH_ENV]
    assert engine_objects.LAUNCH_ANNOTATION in env["valueFrom"]["fieldRef"]["fieldPath"]
    cmd = container["command"]
    assert cmd[cmd.index("--max-restarts") + 1] == "5"


def test_the_operator_reads_a_nodes_cpus_from_its_allocatable() -> None:
    assert [whole_cpus(q) for q in ("16", "15500m", 8, "junk", None)] == [16, 15, 8, None, None]
    snap = snapshot([discrete("a", 80)])
    snap = replace(snap, nodes={"a": replace(snap.nodes["a"], cpus_allocatable=48)})
    assert pods_on(snap, "a", SETTINGS).node_cpus == 48


# --- the GPU charged is the GPU the pod gets (DRA) ---------------------------------------------


def test_with_dra_the_pod_claims_the_planned_gpus_by_uuid_instead_of_a_count() -> None:
    from continuum_operator.kube.base.settings import GpuClaims

    e = Engine.model_validate(engine_obj())
    plan_doc = _plan(33).model_copy(update={"gpus": (1, 3)})
    uuids = tuple((i, f"GPU-0000000{i}-aaaa-bbbb-cccc-dddddddddddd") for i in range(4))
    dra = PodSettings(gpu_claims=GpuClaims.DRA, node_gpu_uuids=uuids)
    template = engine_objects.gpu_claim_template(e, "uid", plan_doc, dra)
    assert template is not None and template["metadata"]["name"] == "coder-gpu-1-3"
    [request] = template["spec"]["spec"]["devices"]["requests"]
    exactly = request["exactly"]
    assert (exactly["deviceClassName"], exactly["count"]) == ("gpu.nvidia.com", 2)
    # NVIDIA's DRA driver publishes no `index` since v25.8: the UUIDs the board reports.
    assert exactly["selectors"][0]["cel"]["expression"] == (
        'device.attributes["gpu.nvidia.com"].uuid in '
        '["GPU-00000001-aaaa-bbbb-cccc-dddddddddddd", "GPU-00000003-aaaa-bbbb-cccc-dddddddddddd"]'
    )
    # A GPU the board gave no UUID for is selected by a value no device has: pending, never
    # another GPU.
    unknown = engine_objects.gpu_claim_template(e, "uid", plan_doc, replace(dra, node_gpu_uuids=()))
    assert unknown is not None
    [request] = unknown["spec"]["spec"]["devices"]["requests"]
    assert "GPU-" not in request["exactly"]["selectors"][0]["cel"]["expression"]
    dep = engine_objects.deployment(e, "uid", plan_doc, dra, node_has_gpus=True)
    pod = dep["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "gpus", "resourceClaimTemplateName": "coder-gpu-1-3"}]
    resources = pod["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in resources["limits"] and resources["claims"] == [{"name": "gpus"}]
    # Other GPUs: another pod. With the device plugin, nothing of this.
    moved = engine_objects.launch_hash(e, plan_doc.model_copy(update={"gpus": (0, 3)}), dra)
    assert moved != engine_objects.launch_hash(e, plan_doc, dra)
    plugin = PodSettings()
    assert engine_objects.gpu_claim_template(e, "uid", plan_doc, plugin) is None
    dep = engine_objects.deployment(e, "uid", plan_doc, plugin, node_has_gpus=True)
    assert "resourceClaims" not in dep["spec"]["template"]["spec"]
    limits = dep["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "2"
    no_gpus = plan_doc.model_copy(update={"gpus": ()})
    assert engine_objects.gpu_claim_template(e, "uid", no_gpus, dra) is None
