"""Runtime truth (issue 21) with the real llama-server: `continuum engine` as an engine pod runs
it (grants from a file, status.runtime to a file), on the generated tiny model.

- A file whose digest is not the one named is never started nor receipted; both digests said.
- The file named is hashed, receipted under its digest, and llama-server runs with the threads
  it was given (`--threads`, as the pod's CPUs): llama.cpp's own log line says so.
- A later start on the same file skips the hash (the record of the first vouches for it),
  unless `--rehash`.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.llama_server import TinyModel
from tests.support.local_http import free_port

pytestmark = pytest.mark.e2e


def run_engine(
    tmp_path: Path, server: Path, model: Path, sha: str, *extra: str
) -> tuple[subprocess.Popen[bytes], Path, Path]:
    grants = tmp_path / "grants.yaml"
    grants.write_text("slotTokens: 512\ngrants: []\n")
    status = tmp_path / "runtime.json"
    log = tmp_path / f"engine-{time.time_ns()}.log"  # named by when it started
    argv = [
        sys.executable, "-m", "continuum_operator.cli", "engine",
        "--model", str(model), "--sha256", sha, "--grants", str(grants),
        "--listen", f"127.0.0.1:{free_port()}", "--llama-server", str(server),
        "--status-file", str(status), "--unsafe-trust-mind-header", *extra,
        "--", "--ctx-size", "1024", "--parallel", "2",
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=out)
    return proc, status, log


def wait_status(proc: subprocess.Popen[bytes], status: Path, log: Path, phase: str) -> Any:
    """The first document in `phase` this process wrote (not the one a previous run left)."""
    started = int(log.name.split("-")[1].split(".")[0])  # run_engine's clock at the start
    deadline = time.monotonic() + 120
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        if status.exists() and status.stat().st_mtime_ns > started:
            try:
                doc = json.loads(status.read_text())
            except ValueError:
                doc = {}
            if doc.get("phase") == phase:
                return doc
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    pytest.fail(f"no phase {phase}: {doc}\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=30)


def test_a_replaced_model_is_refused_and_the_named_one_runs_with_the_pods_threads(
    tmp_path: Path, llama_server_bin: Path, tiny_model: TinyModel
) -> None:
    actual = hashlib.sha256(tiny_model.path.read_bytes()).hexdigest()
    named = "ab" * 32
    proc, status, log = run_engine(tmp_path, llama_server_bin, tiny_model.path, named)
    try:
        doc = wait_status(proc, status, log, "ModelMismatch")
        assert named in doc["message"] and actual in doc["message"]
        assert doc["receipts"] == [] and doc["ready"] is False
        assert "starting " not in log.read_text()  # llama-server never started
    finally:
        stop(proc)

    proc, status, log = run_engine(
        tmp_path, llama_server_bin, tiny_model.path, actual, "--threads", "3"
    )
    try:
        doc = wait_status(proc, status, log, "Serving")
        # The refused start hashed this very file (its record says so): not hashed again.
        assert doc["modelFile"]["verdict"] == "Skipped" and doc["threads"] == 3
        [receipt] = doc["receipts"]
        assert receipt["modelSha256"] == actual
        text = log.read_text()
        # llama.cpp's own account of its threads (common's system_info line).
        found = re.search(r"n_threads = (\d+) \(n_threads_batch = (\d+)\)", text)
        assert found is not None, text[-3000:]
        assert found.groups() == ("3", "3")
    finally:
        stop(proc)

    # --rehash: hashed whatever the record says.
    proc, status, log = run_engine(tmp_path, llama_server_bin, tiny_model.path, actual, "--rehash")
    try:
        doc = wait_status(proc, status, log, "Serving")
        assert doc["modelFile"]["verdict"] == "Hashed"
        assert doc["receipts"][0]["modelSha256"] == actual
    finally:
        stop(proc)
