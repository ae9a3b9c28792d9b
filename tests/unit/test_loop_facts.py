"""The loop's one read of a facts Job: its pod's log into status.modelFacts, or why not."""

from __future__ import annotations

import json
from typing import Any

from continuum_operator.kube.api import KubeApi
from continuum_operator.kube.cache import Cache, JobEntry
from continuum_operator.kube.loop import Loop
from continuum_operator.kube.settings import OperatorSettings
from tests.builders import engine_body
from tests.fakes import FakeKubeApi


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


def loop(api: FakeKubeApi) -> Loop:
    fake: Any = api
    real: KubeApi = fake
    return Loop(real, OperatorSettings(), Cache(), clock=lambda: 1_800_000_000.0)


JOB = JobEntry("eng-facts-1", "pvc:models/m.gguf@-", succeeded=True, failed=False)


def test_the_facts_a_job_printed_go_to_status_and_the_job_is_deleted() -> None:
    facts = engine_body()["spec"]["model"]["facts"]
    api = facts_api(json.dumps(facts))
    answer, error = loop(api).read_facts(("ns", "eng"), JOB)
    assert error is None and answer is not None
    path, patch = api.patches[0]
    assert path.endswith("/namespaces/ns/engines/eng/status")
    read = patch["status"]["modelFacts"]
    assert read["source"] == JOB.source and read["facts"]["layers"] == facts["layers"]
    assert read["readAt"] == "2027-01-15T08:00:00Z"
    assert api.deleted == ["/apis/batch/v1/namespaces/ns/jobs/eng-facts-1"]


def test_output_that_is_not_facts_is_refused_with_a_reason() -> None:
    api = facts_api("error: m.gguf: not a GGUF file (bad magic)")
    answer, error = loop(api).read_facts(("ns", "eng"), JOB)
    assert answer is None and error is not None and "not model facts" in error
    assert api.patches == [] and api.deleted == []


def test_a_job_whose_pod_is_gone_says_so() -> None:
    answer, error = loop(facts_api("{}", pods=0)).read_facts(("ns", "eng"), JOB)
    assert answer is None and error == "no pod of Job eng-facts-1 is left to read"
    answer, error = loop(facts_api(None)).read_facts(("ns", "eng"), JOB)
    assert answer is None and error is not None and "reading its log failed" in error
