"""The loop's one read of a facts Job: its pod's log into status.modelFacts, or why not."""

from __future__ import annotations

import json
from typing import Any

from continuum_operator.kube.api import ApiError, KubeApi
from continuum_operator.kube.cache import Cache, JobEntry
from continuum_operator.kube.loop import Loop
from continuum_operator.kube.settings import OperatorSettings
from tests.builders import engine_body


class FakeApi:
    """Answers the few calls `Loop.read_facts` makes, and records the writes."""

    def __init__(self, log: str, pods: int = 1) -> None:
        self.log = log
        self.pods = pods
        self.patches: list[tuple[str, Any]] = []
        self.deleted: list[str] = []

    def request(self, method: str, path: str, body: Any = None, **_: Any) -> dict[str, Any]:
        assert method == "GET" and path.endswith("/pods")
        return {"items": [{"metadata": {"name": f"job-pod-{i}"}} for i in range(self.pods)]}

    def text(self, path: str, query: Any = ()) -> str:
        if self.log == "404":
            raise ApiError(404, "NotFound", "pods not found")
        return self.log

    def merge_patch(self, path: str, patch: Any) -> dict[str, Any]:
        self.patches.append((path, patch))
        return {"metadata": {"name": "eng", "namespace": "ns"}, "status": patch["status"]}

    def delete(self, path: str) -> None:
        self.deleted.append(path)


def loop(api: FakeApi) -> Loop:
    fake: Any = api
    real: KubeApi = fake
    return Loop(real, OperatorSettings(), Cache(), clock=lambda: 1_800_000_000.0)


JOB = JobEntry("eng-facts-1", "pvc:models/m.gguf@-", succeeded=True, failed=False)


def test_the_facts_a_job_printed_go_to_status_and_the_job_is_deleted() -> None:
    facts = engine_body()["spec"]["model"]["facts"]
    api = FakeApi(json.dumps(facts))
    answer, error = loop(api).read_facts(("ns", "eng"), JOB)
    assert error is None and answer is not None
    path, patch = api.patches[0]
    assert path.endswith("/namespaces/ns/engines/eng/status")
    read = patch["status"]["modelFacts"]
    assert read["source"] == JOB.source and read["facts"]["layers"] == facts["layers"]
    assert read["readAt"] == "2027-01-15T08:00:00Z"
    assert api.deleted == ["/apis/batch/v1/namespaces/ns/jobs/eng-facts-1"]


def test_output_that_is_not_facts_is_refused_with_a_reason() -> None:
    api = FakeApi("error: m.gguf: not a GGUF file (bad magic)")
    answer, error = loop(api).read_facts(("ns", "eng"), JOB)
    assert answer is None and error is not None and "not model facts" in error
    assert api.patches == [] and api.deleted == []


def test_a_job_whose_pod_is_gone_says_so() -> None:
    answer, error = loop(FakeApi("{}", pods=0)).read_facts(("ns", "eng"), JOB)
    assert answer is None and error == "no pod of Job eng-facts-1 is left to read"
    answer, error = loop(FakeApi("404")).read_facts(("ns", "eng"), JOB)
    assert answer is None and error is not None and "reading its log failed" in error
