"""The local control plane that `tools/cluster` starts for the e2e tests (`cluster`, a session
fixture of tests/e2e/conftest.py): where its state and binaries are, and kubectl against it
(`Cluster`), including the KWOK nodes it runs pods on; and the pinned versions of its toolchain."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from continuum_operator import yaml_text
from tests.support.builders import ROOT

CLUSTER_SCRIPT = ROOT / "tools" / "cluster"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"


def read_versions() -> dict[str, str]:
    """The pinned versions in tools/versions (KEY=value lines)."""
    versions: dict[str, str] = {}
    for line in (ROOT / "tools" / "versions").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            versions[key.strip()] = value.strip()
    return versions


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl call whose message carries its stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


@dataclass(frozen=True)
class Cluster:
    state_dir: Path
    kubeconfig: Path
    bin_dir: Path  # kube-apiserver, kubectl, kwok, ...
    path: str  # PATH with the toolchain (k8s binaries, helm) in front

    @property
    def env(self) -> dict[str, str]:
        """An environment for subprocesses (an operator, helm) that talk to this cluster."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "PATH": self.path}

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args]
        proc = subprocess.run(
            cmd, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, cmd, proc.stdout, proc.stderr)
        return proc

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def ledger_status(self, ns: str, name: str) -> dict[str, Any]:
        """The status of an Engine's GrantLedger ({} before the operator's first step made it)."""
        out = self.kubectl(
            "get", "grantledger", name, "-n", ns, "-o", "json", "--ignore-not-found"
        ).stdout
        return dict(json.loads(out).get("status") or {}) if out.strip() else {}

    def apply(
        self, manifest: str | Mapping[str, Any] | Sequence[Mapping[str, Any]], *args: str
    ) -> str:
        """`kubectl apply -f -` of YAML text, one object or a list of objects."""
        if not isinstance(manifest, str):
            docs = [manifest] if isinstance(manifest, Mapping) else list(manifest)
            manifest = yaml_text.dump_all([dict(d) for d in docs])
        return self.kubectl("apply", "-f", "-", *args, input=manifest).stdout

    def create_fake_node(
        self,
        name: str,
        capacity: Mapping[str, str] | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        """A Node that KWOK manages (it reports Ready and runs the pods bound to it)."""
        cap = {"cpu": "32", "memory": "256Gi", "pods": "110", "nvidia.com/gpu": "8"}
        cap.update(capacity or {})
        self.apply(
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "annotations": {FAKE_NODE_ANNOTATION: "fake"},
                    "labels": {
                        "type": "kwok",
                        "kubernetes.io/hostname": name,
                        "kubernetes.io/os": "linux",
                        "kubernetes.io/arch": "amd64",
                        **(labels or {}),
                    },
                },
                "spec": {},
                "status": {"capacity": cap, "allocatable": cap},
            }
        )

    def log_tails(self, lines: int = 40) -> dict[str, str]:
        tails = {}
        for name in COMPONENTS:
            log = self.state_dir / "logs" / f"{name}.log"
            if log.exists():
                tails[name] = "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
        return tails
