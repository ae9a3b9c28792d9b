"""What the benches that run on a real control plane share: the cluster (and its processes),
kubectl, percentiles.

Used by `bench/reconcile.py`, `bench/scale.py` and `bench/write_cost.py`. The cluster is
`tools/cluster` (etcd, kube-apiserver, controller-manager, scheduler, KWOK) in a directory of
its own.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))
sys.path.insert(0, str(ROOT))

GiB = 2**30
GROUP, VERSION = "continuum.dev", "v1alpha1"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def micro() -> str:
    """Now, as a Lease's MicroTime."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def cluster_up(state: Path, **extra: str) -> tuple[str, dict[str, str]]:
    """Start a control plane in `state` (`extra`: more environment for `tools/cluster`); its
    kubeconfig and `tools/cluster env`'s exports."""
    env = {**os.environ, "CONTINUUM_CLUSTER_DIR": str(state), **extra}
    subprocess.run([str(ROOT / "tools/cluster"), "up"], env=env, check=True, capture_output=True)
    out = subprocess.run(
        [str(ROOT / "tools/cluster"), "env"], env=env, check=True, capture_output=True, text=True
    ).stdout
    exports = {}
    for line in out.splitlines():
        if line.startswith("export ") and "=" in line:
            k, _, v = line[len("export ") :].partition("=")
            exports[k] = v.replace("$PATH", os.environ.get("PATH", ""))
    return exports["KUBECONFIG"], exports


def control_plane(state: Path) -> dict[str, psutil.Process]:
    """The processes of a control plane `tools/cluster` runs in `state` (its pid files)."""
    found = {}
    for who in ("kube-apiserver", "etcd", "kwok"):
        pid = state / "pids" / f"{who}.pid"
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            found[who] = psutil.Process(int(pid.read_text().strip()))
    return found


def cluster_down(state: Path) -> None:
    env = {**os.environ, "CONTINUUM_CLUSTER_DIR": str(state)}
    subprocess.run([str(ROOT / "tools/cluster"), "down"], env=env, check=False, capture_output=True)


def kubectl(kubeconfig: str, path: str, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(
        ["kubectl", "--kubeconfig", kubeconfig, *args],
        input=stdin,
        text=True,
        capture_output=True,
        check=True,
        env={**os.environ, "PATH": path},
    ).stdout


def mind_body(name: str, engine: str, class_name: str, context_tokens: int = 2048) -> Any:
    """A Mind as the benches create them."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Mind",
        "metadata": {"name": name},
        "spec": {"engine": engine, "className": class_name, "contextTokens": context_tokens},
    }
