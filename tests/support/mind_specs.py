"""What the grants tests apply: a small Engine of up to `minds` slots of SLOT_TOKENS, labelled for
one operator and placed on the nodes of a tag (`engine`), MindClasses (`mind_class`, three a test
from the `classes` fixture) and Minds (`mind`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.cluster import Cluster

SLOT_TOKENS = 512


def engine(name: str, tag: str, label: tuple[str, str], minds: int = 2) -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Engine",
        "metadata": {"name": name, "labels": dict([label])},
        "spec": {
            "model": {
                "facts": {
                    "layers": 4,
                    "layerBytes": 4 * 2**20,
                    "inputBytes": 2**20,
                    "outputBytes": 2**20,
                    "kvBytesPerTokenPerLayer": 1024,
                    "computeBytes": 64 * 2**20,
                }
            },
            "contextTokensPerMind": SLOT_TOKENS,
            "minds": {"min": 1, "max": minds},
            "placement": {"nodeSelector": {"e2e-tag": tag}},
        },
    }


def mind_class(name: str, priority: int) -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "MindClass",
        "metadata": {"name": name},
        "spec": {"priority": priority, "protectionWindowSeconds": 0},
    }


def mind(name: str, cls: str, tokens: int = 256, engine: str = "coder") -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Mind",
        "metadata": {"name": name},
        "spec": {"engine": engine, "className": cls, "contextTokens": tokens},
    }


@pytest.fixture
def classes(cluster: Cluster, crds: None) -> Iterator[dict[str, str]]:
    """Three MindClasses of this test (low 0, mid 5, high 10), deleted after it."""
    tag = uuid.uuid4().hex[:6]
    names = {"low": f"low-{tag}", "mid": f"mid-{tag}", "high": f"high-{tag}"}
    cluster.apply(
        [mind_class(names["low"], 0), mind_class(names["mid"], 5), mind_class(names["high"], 10)]
    )
    yield names
    cluster.kubectl("delete", "mindclass", *names.values(), "--wait=false", check=False)
