"""Fixtures for end-to-end tests against a real local control plane started by `tools/cluster`.

- `cluster` (session): etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK
  in a state directory under pytest's tmp; torn down at the end of the session. Needs the
  binaries of `tools/cluster build` (run by `make toolchain`).
- `namespace` (function): a fresh namespace per test, deleted afterwards.
- `gpu_node` (function): a KWOK fake node with `nvidia.com/gpu` capacity, deleted afterwards.

When a test that uses the cluster fails, the tail of every component's log is attached to its
report.
"""

from __future__ import annotations

import os
import re
import subprocess
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.support.cluster import CLUSTER_SCRIPT, Cluster


def _run_cluster_script(command: str, state_dir: Path) -> subprocess.CompletedProcess[str]:
    # The API server listens where the real node's pods reach it (tests/e2e/test_real_node.py
    # starts that node; every other test runs without it).
    env = {**os.environ, "CONTINUUM_CLUSTER_DIR": str(state_dir), "CONTINUUM_REAL_NODE": "1"}
    return subprocess.run(
        [str(CLUSTER_SCRIPT), command],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=600,
    )


def _exports(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        m = re.match(r"export (\w+)=(.*)$", line.strip())
        if m:
            found[m.group(1)] = m.group(2)
    return found


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    state_dir = tmp_path_factory.mktemp("cluster")
    up = _run_cluster_script("up", state_dir)
    if up.returncode != 0:
        logs = ""
        for log in sorted((state_dir / "logs").glob("*.log")):
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
            logs += f"\n--- {log.name} ---\n{tail}"
        _run_cluster_script("down", state_dir)
        pytest.fail(f"tools/cluster up failed:\n{up.stdout}\n{up.stderr}{logs}", pytrace=False)
    exports = _exports(_run_cluster_script("env", state_dir).stdout)
    path = exports["PATH"].replace("$PATH", os.environ.get("PATH", ""))
    bin_dir = Path(path.split(":")[0])
    try:
        yield Cluster(
            state_dir=state_dir,
            kubeconfig=Path(exports["KUBECONFIG"]),
            bin_dir=bin_dir,
            path=path,
        )
    finally:
        _run_cluster_script("down", state_dir)


def _dns_name(prefix: str, node_name: str) -> str:
    base = re.sub(r"[^a-z0-9-]+", "-", node_name.lower()).strip("-")[:40].strip("-")
    return f"{prefix}-{base}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = _dns_name("e2e", request.node.name)
    # Pods are admitted only once the namespace's default ServiceAccount exists: applied here
    # with the namespace, in one kubectl, rather than waited for from kube-controller-manager
    # (two kubectl runs a test). Server-side: whichever of the two makes it first, the other's
    # write is a no-op, not AlreadyExists.
    default_account = {"apiVersion": "v1", "kind": "ServiceAccount",
                       "metadata": {"name": "default", "namespace": name}}  # fmt: skip
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
    cluster.apply([namespace, default_account], "--server-side")
    try:
        yield name
    finally:
        cluster.kubectl(
            "delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False
        )


@pytest.fixture
def gpu_node(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[str]:
    name = _dns_name("gpu", request.node.name)
    cluster.create_fake_node(name)
    cluster.kubectl("wait", "--for=condition=Ready", f"node/{name}", "--timeout=60s")
    try:
        yield name
    finally:
        cluster.kubectl("delete", "node", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        funcargs = getattr(item, "funcargs", {})
        found = funcargs.get("cluster")
        if isinstance(found, Cluster):
            for name, tail in found.log_tails().items():
                report.sections.append((f"{name} log (tail)", tail))
            report.sections.append(("cluster state dir", str(found.state_dir)))
    return report


# Hook for the llama.cpp fixtures (tools/llama's side): they live in tests/e2e/llama_fixtures.py and
# are re-exported here so that every e2e test can request them.
if (Path(__file__).parent / "llama_fixtures.py").exists():
    from tests.e2e.llama_fixtures import *  # noqa: F403
