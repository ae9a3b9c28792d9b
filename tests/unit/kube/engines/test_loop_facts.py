"""The Engines' loop's one read of a facts Job: its pod's log into status.modelFacts, or why not."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import pytest

from continuum_operator.kube.base.settings import OperatorSettings
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.engines import loop as loop_module
from continuum_operator.kube.engines.engine_pass import Memory, Writes
from continuum_operator.kube.engines.facts_read import read_job_facts
from continuum_operator.kube.engines.loop import Loop
from continuum_operator.kube.state.cache import Cache, EngineKey, JobEntry
from tests.support.builders import engine_body
from tests.support.fakes import FakeKubeApi


def facts_api(log: str | None, pods: int = 1) -> FakeKubeApi:
    """Engine ns/eng, the pods of its facts Job, and the first pod's log (None: no log, 404)."""
    api = FakeKubeApi()
    body = engine_body()
    body["metadata"].update(namespace="ns", name="eng", resourceVersion="1")
    api.add(body)
    for i in range(pods):
        api.add({"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"namespace": "ns", "name": f"job-pod-{i}",
                              "labels": {"job-name": JOB.name}}})  # fmt: skip
    if log is not None:
        api.logs["/api/v1/namespaces/ns/pods/job-pod-0/log"] = log
    return api


def read_job(api: FakeKubeApi, key: EngineKey) -> tuple[Mapping[str, object] | None, str | None]:
    fake: Any = api.aio
    real: AsyncKubeApi = fake
    return asyncio.run(read_job_facts(real, key, JOB, 1_800_000_000.0))


JOB = JobEntry("eng-facts-1", "pvc:models/m.gguf@-", succeeded=True, failed=False)


def test_the_facts_a_job_printed_go_to_status_and_the_job_is_deleted() -> None:
    facts = engine_body()["spec"]["model"]["facts"]
    api = facts_api(json.dumps(facts))
    answer, error = read_job(api, ("ns", "eng"))
    assert error is None and answer is not None
    path, patch = api.patches[0]
    assert path.endswith("/namespaces/ns/engines/eng/status")
    read = patch["status"]["modelFacts"]
    assert read["source"] == JOB.source and read["facts"]["layers"] == facts["layers"]
    assert read["readAt"] == "2027-01-15T08:00:00Z"
    assert api.deleted == ["/apis/batch/v1/namespaces/ns/jobs/eng-facts-1"]


def test_output_that_is_not_facts_is_refused_with_a_reason() -> None:
    api = facts_api("error: m.gguf: not a GGUF file (bad magic)")
    answer, error = read_job(api, ("ns", "eng"))
    assert answer is None and error is not None and "not model facts" in error
    assert api.patches == [] and api.deleted == []


def test_a_job_whose_pod_is_gone_says_so() -> None:
    answer, error = read_job(facts_api("{}", pods=0), ("ns", "eng"))
    assert answer is None and error == "no pod of Job eng-facts-1 is left to read"
    answer, error = read_job(facts_api(None), ("ns", "eng"))
    assert answer is None and error is not None and "reading its log failed" in error


class FactsWorld:
    """The Engines' loop with engine ns/eng in its cache and its facts Job ended (`job`), the
    decisions it makes recorded (`decided`: the modelFacts and facts error each one saw)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, api: FakeKubeApi, job: JobEntry) -> None:
        fake: Any = api.aio
        real: AsyncKubeApi = fake
        self.cache = Cache(clock=lambda: 1_800_000_000.0)
        self.loop = Loop(real, OperatorSettings(), self.cache, clock=lambda: 1_800_000_000.0)
        body = api.objects["/apis/continuum.dev/v1alpha1/namespaces/ns/engines/eng"]
        self.cache.observe_engine(body, deleted=False)
        self.cache.jobs[("ns", "eng")] = job
        self.decided: list[tuple[bool, str | None]] = []

        def recorded(body: dict[str, Any], snap: Any, memory: Memory, *args: Any) -> Writes:
            facts = (body.get("status") or {}).get("modelFacts")
            self.decided.append((facts is not None, memory.facts_error))
            return Writes(None, None, None, False, (), memory)

        monkeypatch.setattr(loop_module, "reconcile", recorded)

    def pass_once(self) -> None:
        asyncio.run(self.loop.pass_once())


def test_a_succeeded_jobs_facts_are_read_first_and_the_engine_decided_with_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    facts = engine_body()["spec"]["model"]["facts"]
    api = facts_api(json.dumps(facts))
    w = FactsWorld(monkeypatch, api, JOB)
    w.pass_once()
    assert w.decided == []  # the pass read the Job: a write, not a decision
    assert api.deleted == ["/apis/batch/v1/namespaces/ns/jobs/eng-facts-1"]
    del w.cache.jobs[("ns", "eng")]  # the Job's deletion, as its watch would say
    w.pass_once()  # the read's answer marked the engine
    assert w.decided == [(True, None)]


def test_a_read_that_failed_is_said_in_a_decision_then_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = facts_api("{}", pods=0)
    w = FactsWorld(monkeypatch, api, JOB)
    w.pass_once()
    w.pass_once()
    assert w.decided == [(False, "no pod of Job eng-facts-1 is left to read")]
    w.pass_once()  # not quiet: read again (the Job's pods may be listed now)
    assert w.decided == [(False, "no pod of Job eng-facts-1 is left to read")]
    assert [p for p in api.gets if p.endswith("/pods")] == ["/api/v1/namespaces/ns/pods"] * 2


def test_a_failed_jobs_last_error_line_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    api = facts_api("reading m.gguf\nerror: the model's sha256 is not the one declared\n")
    failed = JobEntry("eng-facts-1", JOB.source, succeeded=False, failed=True)
    w = FactsWorld(monkeypatch, api, failed)
    for _ in range(3):
        w.pass_once()
    assert w.decided == [(False, "the model's sha256 is not the one declared")] * 2
    assert [p for p in api.gets if p.endswith("/pods")] == ["/api/v1/namespaces/ns/pods"]
