"""`continuum operator` as a process on the local control plane: a running one (`Operator`,
its /metrics read with `scrape_metric`), stopped as a pod would be (`stop`); and, as a module's
fixture, the operator that plans and places Engines with short timings (`operator`), serving only
the Engines `engine` makes, each test's nodes and engines under its own `tag`."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.cluster import Cluster
from tests.support.local_http import free_port

POD_START_TIMEOUT = 12
COOLDOWN = 900
READINGS = 3
# The `operator` fixture serves only the Engines `engine` makes: Engines other tests leave behind
# (their namespaces are deleted without waiting) never land on these tests' nodes.
RUN_LABEL = ("continuum.dev/e2e-run", uuid.uuid4().hex[:10])


@dataclass(frozen=True)
class Operator:
    """A running `continuum operator`: its process, its log, and its /metrics."""

    proc: subprocess.Popen[bytes]
    log: Path
    metrics_url: str

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the operator's /metrics (0 when the series is absent)."""
        value = scrape_metric(self.metrics_url, name, **labels)
        return 0.0 if value is None else value

    def stop(self) -> None:
        stop(self.proc, timeout=30)


def scrape_metric(url: str, name: str, **labels: str) -> float | None:
    """One sample of a Prometheus endpoint, or None when the series is absent."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def stop(proc: subprocess.Popen[bytes], timeout: float = 20) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, crds: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Operator]:
    """`continuum operator` with short timings. Stopped (SIGTERM) at teardown."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    port = free_port()
    cmd = [
        sys.executable, "-m", "continuum_operator.cli", "operator",
        "--kubeconfig", str(cluster.kubeconfig),
        "--resync", "1",
        "--pod-start-timeout", str(POD_START_TIMEOUT),
        "--backoff", "600",
        "--damping-readings", str(READINGS),
        "--damping-min-gain", "0.1",
        "--relaunch-cooldown", str(COOLDOWN),
        "--engine-image", "continuum-engine:e2e",
        "--metrics-port", str(port),
        "--engine-selector", "=".join(RUN_LABEL),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env)
    try:
        time.sleep(3)  # a bad flag exits within the imports' time
        if proc.poll() is not None:
            pytest.fail(f"continuum operator exited at once:\n{log.read_text()}", pytrace=False)
        yield Operator(proc, log, f"http://127.0.0.1:{port}/metrics")
    finally:
        stop(proc)


@pytest.fixture
def tag(request: pytest.FixtureRequest) -> str:
    """A label value that keeps this test's engines on this test's nodes."""
    return f"t{uuid.uuid4().hex[:8]}"


def engine(name: str, tag: str, **spec: Any) -> dict[str, Any]:
    """An Engine of a 32-layer model (up to 8 minds of 16,384 tokens) on the nodes of `tag`,
    one the `operator` fixture serves; `spec` replaces fields of its spec."""
    body: dict[str, Any] = {
        "model": {
            "facts": {
                "layers": 32,
                "layerBytes": 232783872,
                "inputBytes": 532676608,
                "outputBytes": 532676608,
                "kvBytesPerTokenPerLayer": 4096,
                "computeBytes": 268435456,
            }
        },
        "contextTokensPerMind": 16384,
        "minds": {"min": 1, "max": 8},
        "placement": {"nodeSelector": {"e2e-tag": tag}},
    }
    body.update(spec)
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "Engine",
            "metadata": {"name": name, "labels": dict([RUN_LABEL])}, "spec": body}  # fmt: skip
