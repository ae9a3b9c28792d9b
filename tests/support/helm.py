"""The chart under test and the helm binary that `tools/cluster build` caches (`make toolchain`).

Shared by the chart's unit tests (lint, template, schema) and its e2e test (install on the local
control plane). Helm is found the way the e2e `cluster` fixture finds kubectl: on the PATH that
`tools/cluster env` prints. A missing helm is a failure, never a skip: `make test` builds it first.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator import yaml_text
from tests.support.builders import ROOT
from tests.support.cluster import CLUSTER_SCRIPT

CHART = ROOT / "charts" / "continuum"


def find_helm() -> Path:
    """The cached helm binary, or a test failure that says how to build it."""
    out = subprocess.run(
        [str(CLUSTER_SCRIPT), "env"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    for line in out.splitlines():
        m = re.match(r"export PATH=(.*)$", line.strip())
        if m:
            for entry in m.group(1).split(":"):
                candidate = Path(entry) / "helm"
                if entry != "$PATH" and os.access(candidate, os.X_OK):
                    return candidate
    pytest.fail(
        "helm is not built: run `tools/cluster build` (or `make toolchain`); "
        f"`tools/cluster env` printed:\n{out}",
        pytrace=False,
    )


def helm(
    binary: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(binary), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(env) if env is not None else None,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"helm {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def template(
    binary: Path,
    values: Mapping[str, Any] | None = None,
    *,
    release: str = "r1",
    namespace: str = "continuum-system",
    check: bool = True,
    api_versions: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """`helm template` of the chart with `values` (given on stdin as YAML); `api_versions` as
    a cluster's discovery would list them (helm's offline set lacks the newest)."""
    args = ["template", release, str(CHART), "--namespace", namespace]
    args += [f"--api-versions={v}" for v in api_versions]
    cmd = [str(binary), *args, *(["-f", "-"] if values else [])]
    proc = subprocess.run(
        cmd,
        input=yaml_text.dump(dict(values)) if values else None,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"helm template exited {proc.returncode}\n{proc.stderr}")
    return proc


def documents(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def by_kind(docs: Sequence[Mapping[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [dict(d) for d in docs if d.get("kind") == kind]


def one(docs: Sequence[Mapping[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, found {len(found)}"
    return found[0]
