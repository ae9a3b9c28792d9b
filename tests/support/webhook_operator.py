"""`continuum operator --webhook` on loopback, the mutating webhook of a mind's children
(docs/children.md), for the tests that create pods through the real API server: the operator for
a block (`operator`), waited for while it runs (`wait_while_up`, `wait_ready`), the CRDs with its
webhook configuration deleted after the module (`crds`), and a pod to send through it (`pod`)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.cluster import Cluster
from tests.support.crds import apply_crds
from tests.support.local_http import free_port
from tests.support.operator_process import Operator

WEBHOOK = f"e2e-children-{int(time.time())}"


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> Iterator[None]:
    """The CRDs, once for the module that asks; the webhook's configuration deleted after it."""
    apply_crds(cluster)
    yield
    cluster.kubectl("delete", "mutatingwebhookconfiguration", WEBHOOK, "--ignore-not-found",
                    check=False)  # fmt: skip


@contextmanager
def operator(cluster: Cluster, tmp: Path, webhook_port: int) -> Iterator[Operator]:
    """`continuum operator --webhook` on loopback, until the block ends."""
    log = tmp / f"operator-{time.monotonic_ns()}.log"
    port = free_port()
    cmd = [
        sys.executable, "-m", "continuum_operator.cli", "operator",
        "--kubeconfig", str(cluster.kubeconfig),
        "--engine-image", "continuum-engine:e2e",
        "--metrics-port", str(port),
        "--webhook", "--webhook-name", WEBHOOK,
        "--webhook-listen", "127.0.0.1", "--webhook-host", "127.0.0.1",
        "--webhook-port", str(webhook_port),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env)
    op = Operator(proc, log, f"http://127.0.0.1:{port}/metrics")
    try:
        yield op
    finally:
        op.stop()


def wait_while_up(probe: Callable[[], Any], what: str, op: Operator, timeout: float = 90) -> Any:
    """Poll until `probe` returns something truthy (an exception counts as not yet); fail at
    once if the operator exits, with its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if op.proc.poll() is not None:
            pytest.fail(f"the operator exited while waiting for {what}:\n{op.log.read_text()}")
        try:
            found = probe()
        except Exception:  # not ready yet (metrics port, API)
            found = None
        if found:
            return found
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; operator log:\n{op.log.read_text()[-4000:]}")


def wait_ready(op: Operator, timeout: float = 90) -> list[int]:
    """Poll the operator's `/readyz` closely until it answers 200: the answers before it (a
    refused connection is no answer)."""
    url = op.metrics_url.removesuffix("/metrics") + "/readyz"
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if op.proc.poll() is not None:
            pytest.fail(f"the operator exited while waiting for /readyz:\n{op.log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    return seen
                seen.append(answer.status)
        except urllib.error.HTTPError as err:
            seen.append(err.code)
        except OSError:  # not listening yet
            pass
        time.sleep(0.05)
    pytest.fail(f"/readyz not 200 in {timeout} s: {seen[-3:]}; log:\n{op.log.read_text()[-4000:]}")


def pod(name: str, ns: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels or {}},
        "spec": {
            "containers": [
                {
                    "name": "work",
                    "image": "busybox",
                    "resources": {
                        "requests": {"cpu": "2", "memory": "64Mi"},
                        "limits": {"cpu": "2", "memory": "64Mi"},
                    },
                }
            ]
        },
    }
