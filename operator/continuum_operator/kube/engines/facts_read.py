"""What a facts Job found, read into its Engine's `status.modelFacts` (`kube.workloads.facts_job`
makes the Job): the facts its pod printed, or, when it failed, the error line it printed last.

Both on the event loop, their calls awaited. Neighbours: `kube.engines.loop` (which reads them as an
Engine's write), `kube.workloads.facts_job`.
"""

from __future__ import annotations

from collections.abc import Mapping

from continuum_operator.core.rfc3339 import format_seconds
from continuum_operator.kube.client.api import ApiError, crd_path
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.state.cache import EngineKey, JobEntry
from continuum_operator.model.engine import ModelFacts
from continuum_operator.model.json_body import items_at, text


async def _pod_names(api: AsyncKubeApi, ns: str, job: JobEntry) -> list[str]:
    """The names of the Job's pods, in the order the API lists them."""
    answer = await api.request(
        "GET", f"/api/v1/namespaces/{ns}/pods", query=[("labelSelector", f"job-name={job.name}")]
    )
    names = (text(pod, "metadata", "name") for pod in items_at(answer, "items"))
    return [name for name in names if name]


async def read_job_facts(
    api: AsyncKubeApi, key: EngineKey, job: JobEntry, now: float
) -> tuple[Mapping[str, object] | None, str | None]:
    """The facts a succeeded Job printed, into status.modelFacts; the Job is deleted after.

    Returns the Engine as written, or why the Job's answer cannot be used.
    """
    ns, name = key
    try:
        pods = await _pod_names(api, ns, job)
        if not pods:
            return None, f"no pod of Job {job.name} is left to read"
        log = await api.text(f"/api/v1/namespaces/{ns}/pods/{pods[0]}/log")
        facts = ModelFacts.model_validate_json(log)
        answer = await api.merge_patch(
            crd_path("engines", ns, name, "status"),
            {
                "status": {
                    "modelFacts": {
                        "source": job.source,
                        "facts": facts.model_dump(mode="json", by_alias=True, exclude_none=True),
                        "readAt": format_seconds(now),
                    }
                }
            },
        )
        await api.delete(f"/apis/batch/v1/namespaces/{ns}/jobs/{job.name}")
        return answer, None
    except ApiError as err:
        return None, f"reading its log failed: {err}"
    except ValueError as err:
        return None, f"its output is not model facts: {str(err)[:300]}"


async def read_job_failure(api: AsyncKubeApi, key: EngineKey, job: JobEntry) -> str:
    """The error line a failed facts Job's pod printed last (a replaced model's digests)."""
    ns = key[0]
    try:
        pods = await _pod_names(api, ns, job)
        if not pods:
            return "the Job failed (no pod of it is left to read)"
        log = await api.text(f"/api/v1/namespaces/{ns}/pods/{pods[-1]}/log")
    except ApiError as err:
        return f"the Job failed (its log could not be read: {err})"
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["the Job failed"])[-1].removeprefix("error: ")[:500]
