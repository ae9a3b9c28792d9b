"""kubectl reads the YAML this project writes as it was written (`continuum_operator.yaml_text`).

Found in CI: a test's random hex label came out `85979e45`, PyYAML wrote it plain, and kubectl
refused every manifest of the module ("cannot unmarshal number into ... labels of type string").
"""

from __future__ import annotations

import json

import pytest
import yaml

from continuum_operator import yaml_text
from tests.support.cluster import Cluster

pytestmark = pytest.mark.e2e

VALUES = ["85979e45", "1e5", "1.0e5", "y", "N"]


def config_map(values: list[str]) -> dict[str, object]:
    labels = {f"v{i}": v for i, v in enumerate(values)}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "yaml-text", "namespace": "default", "labels": labels},
            "data": {f"d{i}": v for i, v in enumerate(values)}}  # fmt: skip


def dry_run(cluster: Cluster, text: str) -> tuple[int, str, str]:
    done = cluster.kubectl("create", "--dry-run=server", "-o", "json", "-f", "-",
                           input=text, check=False)  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def test_kubectl_reads_back_the_strings_go_would_take_for_numbers(cluster: Cluster) -> None:
    doc = config_map(VALUES)
    # PyYAML alone: kubectl refuses it (so this test can fail).
    code, _, err = dry_run(cluster, yaml.safe_dump(doc))
    assert code != 0 and "cannot unmarshal" in err, err
    code, out, err = dry_run(cluster, yaml_text.dump(doc))
    assert code == 0, err
    made = json.loads(out)
    assert made["metadata"]["labels"] == doc["metadata"]["labels"]  # type: ignore[index]
    assert made["data"] == doc["data"]
