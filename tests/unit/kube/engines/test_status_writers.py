"""Every status part a writer writes is named by the CRD (docs/design.md "One writer per status
field"): with a structural schema the API server prunes a field its schema does not name, and
says nothing. Each writer's document is built here with the writer's own code and read twice: by
its pydantic model (`model.runtime`, `model.engine`, `model.embedlane`; unknown keys refused), and
by the generated CRD's schema as the API server applies it (closed objects, nulls only where
`nullable`), so a key added to a writer without its field fails here, not silently in a cluster.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from jsonschema import Draft202012Validator
from pydantic import BaseModel

from continuum_operator.core.grants import PriorityPolicy
from continuum_operator.core.receipts import parse_llama_log
from continuum_operator.embed import runtime as lane_runtime
from continuum_operator.embed.runtime import LaneRuntime, LaneState
from continuum_operator.engine import digest
from continuum_operator.engine.gateway import Gateway, GatewaySettings, SlotRelease
from continuum_operator.engine.runtime import (
    EngineRuntime,
    LaunchSettings,
    RuntimePhase,
    runtime_status,
)
from continuum_operator.kube.base.settings import GpuSharing, PodSettings
from continuum_operator.kube.grants import ledger_write
from continuum_operator.kube.lanes.lane_pass import reconcile_lane
from continuum_operator.kube.ledger import grant_ledger, routing
from continuum_operator.kube.workloads import engine_objects
from continuum_operator.model.embedlane import EmbedLaneStatus
from continuum_operator.model.engine import EngineStatus
from continuum_operator.model.grant_ledger import GrantLedgerStatus
from continuum_operator.model.plan_status import PlanBytes, PlanPart
from continuum_operator.model.runtime import EngineRuntimeStatus, LaneRuntimeStatus
from tests.support import builders, fake_llama
from tests.support.builders import ROOT
from tests.support.embed import WordModel
from tests.support.lanes import host_lane, lane_obj, placed_engine, with_objects
from tests.support.plans import as_json_schema
from tests.support.reconcile import NOW, SETTINGS, discrete, snapshot

SHA = hashlib.sha256(b"model").hexdigest()


def status_schema(plural: str) -> dict[str, Any]:
    crd = yaml.safe_load((ROOT / "crds" / f"continuum.dev_{plural}.yaml").read_text())
    status: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "status"
    ]
    return status


def kept_whole(plural: str, status: dict[str, Any]) -> None:
    """The API server keeps every key of `status` (a key its schema does not name is an error
    here), and `status` is valid against the schema."""
    schema = as_json_schema(status_schema(plural))
    errors = sorted(Draft202012Validator(schema).iter_errors(status), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])


def strictly(model: type[BaseModel], doc: dict[str, Any]) -> None:
    """Read by its model, and written back the same: nothing dropped on the way."""
    parsed = model.model_validate(doc)
    assert parsed.model_dump(mode="json", by_alias=True, exclude_unset=True) == doc


# --- the engine runtime: status.runtime --------------------------------------------------------


def engine_runtime_documents(tmp_path: Path) -> list[dict[str, Any]]:
    """`status.runtime` as the engine runtime writes it: starting (all unknown), serving with a
    receipt and releases, after a model mismatch, and stopped after too many exits."""
    log = fake_llama.LOAD_LOG.format(ctx=1024, parallel=2, host="h", port=1)
    receipt = parse_llama_log(log).receipt(model_sha256=SHA, context_tokens=1024)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"model")
    record = digest.VerifiedModel(str(model), SHA, digest.FileStamp.of(model), "n1")
    release = SlotRelease("minds/mira", 0, "Preempted", "2026-01-01T00:00:00.000001Z", 5.0, 812)
    unknown = SlotRelease("minds/bo", 1, "Released", None, 6.0, 0)
    plan = {"bytes": {"device": {"weights": 10, "kv": 5, "compute": 1}, "host": {"weights": 3}}}
    docs = [
        runtime_status(
            phase=RuntimePhase.STARTING,
            ready=False,
            restarts=0,
            receipt=None,
            log_text="",
            plan={},
            slots=None,
            slot_tokens=None,
            releases=[],
        ),
        runtime_status(
            phase=RuntimePhase.SERVING,
            ready=True,
            restarts=2,
            receipt=receipt,
            log_text=log,
            plan=plan,
            slots=2,
            slot_tokens=512,
            releases=[release.to_status(), unknown.to_status()],
            threads=4,
            last_exit={"code": -9, "at": "2026-01-01T00:00:00Z", "line": "killed"},
            model_file={**record.to_status(), "verdict": str(digest.DigestOutcome.HASHED)},
            launch="launch-1",
        ),
    ]
    assert docs[1]["receipts"] and docs[1]["estimateError"]
    assert docs[1]["layersOffloaded"] is not None

    async def stopped() -> dict[str, Any]:
        launch = LaunchSettings(
            llama_server="llama-server", model=model, args=(), model_sha256=SHA, max_restarts=0
        )
        runtime = EngineRuntime(launch, Gateway(GatewaySettings(upstream="http://127.0.0.1:1")))
        runtime.model_file = {**record.to_status(), "verdict": "Mismatch"}
        runtime.tail.append("error: unknown tokenizer")
        assert runtime._exited(1)
        doc = runtime.status()
        await runtime.gateway.close()
        return doc

    docs.append(asyncio.run(stopped()))
    assert docs[-1]["lastExit"] and docs[-1]["message"] and docs[-1]["phase"] == "Stopped"
    return docs


def test_the_engine_runtimes_document_is_kept_whole(tmp_path: Path) -> None:
    for doc in engine_runtime_documents(tmp_path):
        strictly(EngineRuntimeStatus, doc)
        kept_whole("engines", {"runtime": doc})


def test_the_runtime_model_names_every_key_the_writer_writes(tmp_path: Path) -> None:
    """Every key is written (a merge patch keeps a key left out): the model has them all."""
    [starting, *_] = engine_runtime_documents(tmp_path)
    assert set(starting) == {f.alias for f in EngineRuntimeStatus.model_fields.values()}


# --- the operator: status.enforcement ----------------------------------------------------------


@pytest.mark.parametrize("sharing", list(GpuSharing))
@pytest.mark.parametrize("gpus", [[], [0], [0, 1]])
def test_the_enforcement_is_kept_whole(sharing: GpuSharing, gpus: list[int]) -> None:
    part = PlanPart(weights=0, kv=0, compute=0, reserve=0, park=0, total=0)
    plan = builders.plan_on_a_gpu(
        gpus=tuple(gpus),
        bytes=PlanBytes(
            device=part.model_copy(update={"weights": 2**30, "kv": 2**29}),
            host=part.model_copy(update={"weights": 2**28}),
        ),
    )
    doc = engine_objects.enforcement(
        plan, PodSettings(gpu_sharing=sharing), node_has_gpus=bool(gpus)
    )
    strictly(EngineStatus, {"enforcement": doc})
    kept_whole("engines", {"enforcement": doc})


# --- the operator's leader: a GrantLedger's grants, grantCapacity, grantQueue, grantStep -------


def test_the_ledgers_write_is_kept_whole() -> None:
    """The GrantLedger's status replace of a ledger step (`kube.grants.ledger_write`), through a
    preemption (a reclaim with its deadline and by), a drain (targetSlots) and a queue longer
    than the object keeps (grantQueue)."""
    ns = "minds"
    classes, default = routing.classes_of(
        [
            {"metadata": {"name": "low"}, "spec": {"priority": 0, "protectionWindowSeconds": 0}},
            {"metadata": {"name": "high"}, "spec": {"priority": 9, "protectionWindowSeconds": 0}},
        ]
    )

    def mind(name: str, cls: str = "low", second: int = 0) -> dict[str, Any]:
        return {
            "metadata": {
                "namespace": ns,
                "name": name,
                "creationTimestamp": f"2026-12-03T06:{second // 60:02d}:{second % 60:02d}Z",
            },
            "spec": {"engine": "coder", "contextTokens": 1024, "className": cls},
        }

    body: dict[str, Any] = {
        "metadata": {"namespace": ns, "name": "coder", "resourceVersion": "1"},
        "spec": {"contextTokensPerMind": 4096},
        "status": {
            "plan": {
                "node": "n1",
                "engineArgs": ["-np", "1"],
                "mindsGrantable": 1,
                "contextTokensPerMind": 4096,
                "schedulable": True,
            },
            "conditions": [{"type": "Ready", "status": "True", "reason": "PodReady"}],
        },
    }
    policy = PriorityPolicy(grace_seconds=30.0)
    minds = [mind("a")]
    written: list[dict[str, Any]] = []
    for t, change in enumerate(["first", "preempt", "drain", "crowd"]):
        if change == "preempt":
            minds.append(mind("boss", "high", 1))
        if change == "drain":
            body["status"]["plan"] = {**body["status"]["plan"], "engineArgs": ["-np", "2"]}
            body["status"]["plan"]["mindsGrantable"] = 2
        if change == "crowd":
            minds += [mind(f"m{i}", second=2 + i) for i in range(grant_ledger.QUEUE_KEPT + 4)]
        wanted = routing.demands_of(minds, classes, default or "low")
        s = grant_ledger.step(body, wanted, 100.0 + t, policy)
        doc, _, _ = ledger_write._ledger_doc((ns, "coder"), body, s, 100.0 + t, "uid-1", "1")
        status = cast(dict[str, Any], doc["status"])
        written.append(status)
        body = {**body, "status": {**body["status"], **status}}
    step = [w[grant_ledger.STEP_FIELD] for w in written]
    lines = [x for s in step for x in s["lines"]]
    assert {x["event"] for x in lines} == {"capacity", "transition"}
    assert any(x.get("by") and x.get("deadline") for x in lines), "a reclaim with its deadline"
    assert any(x.get("from") is None for x in lines if x["event"] == "transition")
    assert any("targetSlots" in w[grant_ledger.CAPACITY_FIELD] for w in written), "a drain"
    assert grant_ledger.QUEUE_FIELD in written[-1]
    for status in written:
        assert (
            set(status) <= grant_ledger.LEDGER_FIELDS
        )  # the ledger alone: the Engine's is not sent
        strictly(GrantLedgerStatus, status)
        kept_whole("grantledgers", status)


# --- the lane runtime and the operator: an EmbedLane's status ----------------------------------


def test_the_lane_runtimes_document_is_kept_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lane_runtime, "gpu_offload_supported", lambda: False)
    monkeypatch.setattr(lane_runtime, "llama_build", lambda: "llama-cpp-python 0.3.16")

    async def scenario() -> list[dict[str, Any]]:
        rt = LaneRuntime(
            WordModel(),  # type: ignore[arg-type]
            LaneState(max_context_tokens=1024, leased_context_tokens=512),
        )
        docs = [rt.status()]
        await rt.calibrate()
        await rt.embed(["a b c"])
        await rt.embed([" ".join(["w"] * 600)])  # above the lease: refused
        docs.append(rt.status())
        return docs

    docs = asyncio.run(scenario())
    assert docs[-1]["lastRefusal"] and docs[-1]["requests"]["refused"]
    assert set(docs[0]) == {f.alias for f in LaneRuntimeStatus.model_fields.values()}
    for doc in docs:
        strictly(LaneRuntimeStatus, doc)
        kept_whole("embedlanes", {"runtime": doc})


def test_the_lane_runtimes_receipts_are_kept_whole() -> None:
    log = fake_llama.LOAD_LOG.format(ctx=1024, parallel=1, host="h", port=1)
    receipt = parse_llama_log(log).receipt(model_sha256=SHA, context_tokens=1024)
    doc = {"receipts": [receipt.model_dump(mode="json", by_alias=True)]}  # as `status()` dumps
    strictly(LaneRuntimeStatus, doc)
    kept_whole("embedlanes", {"runtime": doc})


def test_the_operators_lane_status_is_kept_whole() -> None:
    """`status.placement`, `conditions` and `observedGeneration` as the lanes' pass writes them:
    a lane placed beside its engine, one the pool limits, and one that waits for its engine."""
    base = snapshot([discrete("gpu-a", 80, host_gib=16)])
    eng = placed_engine(base, offload="none", reserveBytes=0)
    big, waiting = lane_obj(maxContextTokens=1_000_000), lane_obj(engine="absent")
    writes = [
        host_lane()[1],
        reconcile_lane(big, with_objects(base, [eng], [big]), NOW, SETTINGS),
        reconcile_lane(waiting, with_objects(base, [eng], [waiting]), NOW, SETTINGS),
    ]
    for w in writes:
        assert w.status_patch is not None
        status = {k: v for k, v in w.status_patch["status"].items() if v is not None}
        strictly(EmbedLaneStatus, status)
        kept_whole("embedlanes", status)
