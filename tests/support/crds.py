"""The repository's CRDs (crds/) on the local control plane: installed and waited for until the
API server has established them, as a module's fixture (`crds`) or once in a test
(`install_repo_crds`, which also names them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.builders import ROOT
from tests.support.cluster import Cluster

CRDS = ROOT / "crds"


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def wait_established(cluster: Cluster, crd_names: list[str]) -> None:
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", *[f"crd/{n}" for n in crd_names]
    )


def repo_crds() -> list[Path]:
    return sorted(p for p in CRDS.glob("*.yaml") if yaml_docs(p))


def install_repo_crds(cluster: Cluster) -> list[str]:
    files = repo_crds()
    assert files, f"no CRD manifests in {CRDS} (make crds)"
    cluster.kubectl("apply", "--server-side", "-f", str(CRDS))
    names = [
        d["metadata"]["name"]
        for p in files
        for d in yaml_docs(p)
        if d.get("kind") == "CustomResourceDefinition"
    ]
    assert names
    wait_established(cluster, names)
    return names


def apply_crds(cluster: Cluster) -> None:
    """The CRDs applied (taking their fields from whoever wrote them before), and established."""
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=established", "--timeout=60s", "-f", str(ROOT / "crds")
    )


@pytest.fixture(scope="module")
def crds(cluster: Cluster) -> None:
    """The CRDs applied, and established, once for the module that asks."""
    apply_crds(cluster)
