"""An operator replica is ready (`/readyz`) only once its children's webhook serves knowing every
Mind (kube/base/readiness.py): the Service sends admission reviews to ready replicas only, and one
that answered before listing the Minds admitted her service account's pods as ordinary ones."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import kopf
from prometheus_client import CollectorRegistry, Counter

from continuum_operator.kube.base.readiness import (
    MINDS_LISTED,
    WEBHOOK_SERVING,
    Readiness,
    serve_metrics,
)
from continuum_operator.kube.children.webhook import _Installing
from continuum_operator.kube.state.mind_cache import MindCache, list_minds
from tests.support.fakes import FakeKubeApi
from tests.support.local_http import free_port


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_readyz_answers_503_naming_what_it_waits_for_until_all_is_done_and_metrics_meanwhile() -> (
    None
):
    registry = CollectorRegistry()
    Counter("continuum_probe", "a metric to find", registry=registry).inc()
    ready = Readiness((MINDS_LISTED, WEBHOOK_SERVING))
    port = free_port()
    serve_metrics(port, registry, ready, addr="127.0.0.1")
    base = f"http://127.0.0.1:{port}"

    assert get(f"{base}/readyz") == (
        503,
        f"waiting for {MINDS_LISTED}, {WEBHOOK_SERVING}\n",
    )
    status, text = get(f"{base}/metrics")
    assert status == 200 and "continuum_probe_total 1.0" in text  # liveness, Prometheus

    ready.done(MINDS_LISTED)
    assert get(f"{base}/readyz") == (503, f"waiting for {WEBHOOK_SERVING}\n")
    ready.done(WEBHOOK_SERVING)
    ready.done(WEBHOOK_SERVING)  # the server restarted: still done
    assert get(f"{base}/readyz") == (200, "ok\n")


def test_a_replica_waiting_for_nothing_is_ready_at_once() -> None:
    assert Readiness().waiting() == ()


def test_the_webhook_is_ready_only_once_its_configuration_is_installed() -> None:
    ready = Readiness((WEBHOOK_SERVING,))
    seen: list[tuple[str, tuple[str, ...]]] = []

    async def server(fn: kopf.WebhookFn) -> AsyncIterator[kopf.WebhookClientConfig]:
        seen.append(("listening", ready.waiting()))
        yield {"url": "https://127.0.0.1:9443"}

    async def install(config: Mapping[str, Any]) -> None:
        seen.append(("installing", ready.waiting()))

    async def run() -> None:
        async for _ in _Installing(server, install, ready)(cast("kopf.WebhookFn", None)):
            seen.append(("yielded", ready.waiting()))

    asyncio.run(run())
    assert seen == [
        ("listening", (WEBHOOK_SERVING,)),
        ("installing", (WEBHOOK_SERVING,)),
        ("yielded", ()),
    ]


def mind(ns: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Mind",
        "metadata": {"name": name, "namespace": ns, "resourceVersion": "1"},
        "spec": {"engine": "coder", "contextTokens": 256},
    }


def test_the_minds_are_listed_into_the_cache_the_webhook_asks() -> None:
    api = FakeKubeApi([mind("team", "ada"), mind("lab", "bo")])
    cache = MindCache()
    asyncio.run(list_minds(api.aio, cache))  # type: ignore[arg-type]
    assert set(cache.minds) == {"team/ada", "lab/bo"}
