"""Every Event the operator posts is built by `kube.base.events.event`: the loop's on Engines, the
lanes' loop's on EmbedLanes, the webhook's on unmutated pods. The bodies below are those each
posted before the builder was their one home, field for field."""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import pytest

from continuum_operator.kube.base import events
from continuum_operator.kube.base.settings import OperatorSettings, PodSettings
from continuum_operator.kube.children import webhook
from continuum_operator.kube.client.api import ApiError
from continuum_operator.kube.engines.engine_pass import Event
from continuum_operator.kube.engines.loop import Loop
from continuum_operator.kube.lanes.loop import LaneLoop
from continuum_operator.kube.state.cache import Cache
from continuum_operator.model.base import API_VERSION
from tests.support.builders import tree
from tests.support.fakes import FakeKubeApi

NOW = 1_800_000_000.0
STAMP = "2027-01-15T08:00:00Z"  # NOW as `format_seconds` writes it


def meta(name: str = "coder") -> dict[str, Any]:
    return {"namespace": "ns", "name": name, "uid": "0123456789abcdef"}


def posted_on(kind: str, instance: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "coder.", "namespace": "ns"},
        "involvedObject": {"apiVersion": API_VERSION, "kind": kind, "name": "coder",
                           "namespace": "ns", "uid": "0123456789abcdef"},
        "reason": "PodNeverStarted",
        "message": message,
        "type": "Warning",
        "source": {"component": "continuum-operator"},
        "reportingComponent": "continuum-operator",
        "reportingInstance": instance,
        "firstTimestamp": STAMP,
        "lastTimestamp": STAMP,
        "count": 1,
    }  # fmt: skip


def test_an_event_names_its_object_and_is_seen_once_at_the_time_given() -> None:
    body = events.event(
        events.reference("v1", "Pod", meta("p")),
        "Normal",
        "Why",
        "what",
        component="c",
        instance="i",
        now=STAMP,
    )
    assert body == {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": "p.", "namespace": "ns"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "p", "namespace": "ns",
                           "uid": "0123456789abcdef"},
        "reason": "Why",
        "message": "what",
        "type": "Normal",
        "source": {"component": "c"},
        "reportingComponent": "c",
        "reportingInstance": "i",
        "firstTimestamp": STAMP,
        "lastTimestamp": STAMP,
        "count": 1,
    }  # fmt: skip


def test_a_named_event_has_that_name_and_no_generated_one() -> None:
    ref = events.reference("v1", "Pod", {"namespace": "ns", "name": "p"})
    assert ref["uid"] is None  # an object not yet given one
    body = events.event(ref, "Warning", "R", "m", component="c", instance="i", now=STAMP, name="n")
    assert body["metadata"] == {"name": "n", "namespace": "ns"}


def test_the_message_is_cut_at_the_limit_unless_told_otherwise() -> None:
    ref = events.reference("v1", "Pod", meta())
    long = "x" * (events.MESSAGE_LIMIT + 10)
    cut = events.event(ref, "Normal", "R", long, component="c", instance="i", now=STAMP)
    assert cut["message"] == "x" * events.MESSAGE_LIMIT == long[:1024]
    whole = events.event(
        ref, "Normal", "R", long, component="c", instance="i", now=STAMP, message_limit=None
    )
    assert whole["message"] == long


def test_the_loop_posts_an_engines_event_as_it_always_did() -> None:
    api = FakeKubeApi()
    fake: Any = api.aio
    loop = Loop(fake, OperatorSettings(), Cache(), clock=lambda: NOW)
    long = "m" * 2000
    asyncio.run(loop.post_event({"metadata": meta()}, Event("Warning", "PodNeverStarted", long)))
    assert api.created == [posted_on("Engine", socket.gethostname(), long[:1024])]


def test_the_lanes_loop_posts_an_embed_lanes_event_as_it_always_did() -> None:
    api = FakeKubeApi()
    fake: Any = api.aio
    loop = LaneLoop(fake, OperatorSettings(), Cache(), lambda: NOW)
    long = "m" * 2000
    event = Event("Warning", "PodNeverStarted", long)
    asyncio.run(loop.post_event({"metadata": meta()}, event))
    assert api.created == [posted_on("EmbedLane", socket.gethostname(), long[:1024])]


class _RefusingApi:
    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        raise ApiError(403, "Forbidden", "events is forbidden")


def test_a_refused_event_is_a_warning_on_the_loops_own_log_not_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api: Any = _RefusingApi()
    loop = Loop(api, OperatorSettings(), Cache(), clock=lambda: NOW)
    lanes = LaneLoop(api, OperatorSettings(), Cache(), lambda: NOW)
    with caplog.at_level(logging.WARNING):
        asyncio.run(loop.post_event({"metadata": meta()}, Event("Warning", "PodNeverStarted", "m")))
        event = Event("Warning", "PodNeverStarted", "m")
        asyncio.run(lanes.post_event({"metadata": meta()}, event))
    warned = [(r.name, r.getMessage()) for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [
        ("continuum.operator", "posting an event on Engine coder failed: 403 Forbidden: "
         "events is forbidden"),
        ("continuum.operator.embedlanes", "posting an event on EmbedLane coder failed: "
         "403 Forbidden: events is forbidden"),
    ]  # fmt: skip


def test_the_webhooks_event_on_an_unmutated_pod_is_as_it_always_was() -> None:
    pod = {
        "metadata": {"namespace": "ns", "name": "p" * 230, "uid": "0123456789abcdef",
                     "labels": {"continuum.dev/mind": "ada"}},
        "spec": {"priority": 7, "priorityClassName": "c" * 900},
    }  # fmt: skip
    body = tree(webhook.unmutated_event(pod, PodSettings(), "op-1", STAMP))
    assert body == {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{'p' * 200}.unmutated.01234567", "namespace": "ns"},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": "p" * 230,
                           "namespace": "ns", "uid": "0123456789abcdef"},
        "reason": webhook.UNMUTATED_REASON,
        "message": body["message"],
        "type": "Warning",
        "source": {"component": "continuum-operator"},
        "reportingComponent": "continuum-operator",
        "reportingInstance": "op-1",
        "firstTimestamp": STAMP,
        "lastTimestamp": STAMP,
        "count": 1,
    }  # fmt: skip
    # Posted whole, never cut: it is longer than the loops' limit here.
    assert len(body["message"]) > events.MESSAGE_LIMIT and body["message"].endswith("reachable?")
