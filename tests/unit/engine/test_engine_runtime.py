"""`continuum engine`'s runtime: llama-server kept running, its receipt and status.runtime.

llama-server is played by tests/support/fake_llama.py run as a program (it prints a load log and
serves the API); tests/e2e/test_gateway_llama.py runs the real one.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from continuum_operator.core.receipts import parse_llama_log
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.runtime import (
    LOG_LINE_BYTES,
    EngineRuntime,
    LaunchSettings,
    PlanFileError,
    RuntimePhase,
    estimate_errors,
    gateway_args,
    load_plan,
    log_lines,
    runtime_status,
)
from tests.support import fake_llama
from tests.support.engine_runtime import fake_server, run_runtime
from tests.support.waiting import until

MODEL_BYTES = b"GGUF"
SHA = hashlib.sha256(MODEL_BYTES).hexdigest()  # the model files' digest: checked before a launch
MiB = 1 << 20


def with_runtime(
    tmp_path: Path,
    body: Callable[[EngineRuntime, list[dict[str, Any]]], Awaitable[None]],
    backoff: float = 0.1,
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(MODEL_BYTES)
    plan = {"bytes": {"host": {"weights": 1 * MiB, "kv": 2 * MiB, "compute": 5 * MiB}}}
    launch = LaunchSettings(
        llama_server=fake_server(tmp_path),
        model=model,
        args=("--ctx-size", "1024", "--parallel", "2"),
        model_sha256=SHA,
        plan=plan,
        restart_backoff=(backoff,),
    )
    run_runtime(launch, body)


async def killed_serving(runtime: EngineRuntime) -> asyncio.subprocess.Process:
    """Once llama-server serves, kill it (a crash): the process killed."""
    await until(lambda: runtime.phase == "Serving", timeout=60.0)
    process = runtime.process
    assert process is not None
    process.kill()
    return process


def test_the_runtime_starts_llama_server_and_reports_its_load(tmp_path: Path) -> None:
    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        await until(lambda: bool(published) and published[-1]["phase"] == "Serving", timeout=60.0)
        doc = published[-1]
        assert doc["ready"] is True
        assert (doc["slots"], doc["slotTokens"]) == (2, 512)
        assert (doc["layersOffloaded"], doc["layersTotal"], doc["gpuOffload"]) == (0, 5, False)
        [receipt] = doc["receipts"]
        assert receipt["modelSha256"] == SHA and receipt["llamaBuild"] == "6869 (1a2b3c4d)"
        assert (receipt["contextTokens"], receipt["parallel"]) == (1024, 2)
        [err] = doc["estimateError"]
        # planned 8 MiB on the host; llama.cpp allocated 1.38 + 2 + 4.26 MiB
        assert err["pool"] == "host" and err["plannedBytes"] == 8 * MiB
        assert err["ratio"] == round((8 * MiB - err["allocatedBytes"]) / err["allocatedBytes"], 6)
        assert (
            'continuum_engine_estimate_error_ratio{pool="host"}'
            in runtime.gateway.metrics.exposition().decode()
        )

    with_runtime(tmp_path, body)


def test_a_model_of_many_metadata_keys_still_gets_a_whole_receipt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A line a key before the buffers: 5,000 of them (the GGUF reader takes up to 65,536)
    # pushed the buffers past the 4,000 lines kept, and a receipt of no buffers was filed.
    monkeypatch.setenv("FAKE_LLAMA_METADATA_KEYS", "5000")

    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        await until(lambda: bool(published) and published[-1]["phase"] == "Serving", timeout=60.0)
        [receipt] = published[-1]["receipts"]
        kinds = {b["kind"] for b in receipt["buffers"]}
        assert kinds == {"model", "kv", "compute", "output"}
        assert len(runtime.load_log) < 20  # the lines a receipt is read from, no more

    with_runtime(tmp_path, body)


def test_a_llama_server_that_dies_is_started_again_and_counted(tmp_path: Path) -> None:
    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        first = await killed_serving(runtime)
        await until(lambda: runtime.restarts == 1 and runtime.phase == "Serving", timeout=60.0)
        assert runtime.process is not first
        # Published after the phase changes (the next status write), not with it.
        await until(
            lambda: published[-1]["restarts"] == 1 and published[-1]["ready"] is True, timeout=60.0
        )
        assert published[-1]["phase"] == "Serving"

    with_runtime(tmp_path, body)


def test_a_llama_server_that_hangs_is_published_not_ready_and_ready_again(tmp_path: Path) -> None:
    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        await until(lambda: bool(published) and published[-1]["ready"] is True, timeout=60.0)
        proc = runtime.process
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)  # alive, answering nothing
        try:
            await until(lambda: published[-1]["ready"] is False, timeout=20.0)
        finally:
            proc.send_signal(signal.SIGCONT)
        await until(lambda: published[-1]["ready"] is True, timeout=20.0)

    with_runtime(tmp_path, body)


def test_a_model_replaced_while_it_ran_is_checked_again_before_a_restart(tmp_path: Path) -> None:
    # llama-server opens --model by path at each start: a file rewritten in place after the
    # first check was served, and receipted under the digest the Engine names.
    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        await killed_serving(runtime)  # restarted, the same file: a stat, not a hash
        await until(lambda: runtime.restarts == 1 and runtime.phase == "Serving", 60.0)
        assert (runtime.model_file or {})["verdict"] == "Skipped"
        runtime.launch.model.write_bytes(b"GGUF" + b"\1" * 100)  # replaced in place
        second = await killed_serving(runtime)
        await until(lambda: runtime.phase == "ModelMismatch", timeout=60.0)
        assert runtime.restarts == 2 and runtime.process is second  # never started on it
        assert (runtime.model_file or {})["verdict"] == "Mismatch"

    with_runtime(tmp_path, body)


def test_a_stop_during_the_restart_backoff_ends_the_runtime_at_once(tmp_path: Path) -> None:
    async def body(runtime: EngineRuntime, published: list[dict[str, Any]]) -> None:
        first = await killed_serving(runtime)
        await until(lambda: runtime.phase == "Restarting", timeout=20.0)
        started = time.monotonic()
        await runtime.stop()
        await until(lambda: runtime.phase == "Restarting" and runtime.process is first, 1.0)
        await asyncio.sleep(0.5)
        assert runtime.process is first  # not started again after the stop
        assert time.monotonic() - started < 5

    # The backoff is 30 s, the pod's grace period too: the run must end well before.
    started = time.monotonic()
    with_runtime(tmp_path, body, backoff=30.0)
    assert time.monotonic() - started < 25


def test_estimate_errors_compare_each_side_that_allocated_something() -> None:
    log = fake_llama.LOAD_LOG.format(ctx=1024, parallel=2, host="h", port=1)
    receipt = parse_llama_log(log).receipt(model_sha256=SHA, context_tokens=1024)
    plan = {
        "bytes": {
            "device": {"weights": 0, "kv": 0, "compute": 0},
            "host": {"weights": 2 * MiB, "kv": 2 * MiB, "compute": 4 * MiB},
        }
    }
    [host] = estimate_errors(plan, receipt)
    assert host["pool"] == "host" and host["allocatedBytes"] == receipt.total(host=True)
    assert estimate_errors({}, receipt) == []


def test_the_status_document_carries_the_releases_and_the_load() -> None:
    log = fake_llama.LOAD_LOG.format(ctx=1024, parallel=2, host="h", port=1)
    receipt = parse_llama_log(log).receipt(model_sha256=SHA, context_tokens=1024)
    release = {"mind": "minds/mira", "slot": 0, "reason": "Preempted"}
    doc = runtime_status(
        phase=RuntimePhase.SERVING,
        ready=True,
        restarts=0,
        receipt=receipt,
        log_text=log,
        plan={},
        slots=2,
        slot_tokens=512,
        releases=[release],
    )
    assert doc["slotReleases"] == [release]
    assert doc["llamaBuild"] == parse_llama_log(log).build
    json.dumps(doc)  # it goes to the API server as it is


def test_continuum_engine_serves_the_grant_file_and_writes_the_releases(tmp_path: Path) -> None:
    """The command as an engine pod runs it: grants from a file, status.runtime to a file."""
    import socket
    import subprocess
    import urllib.error
    import urllib.request

    model = tmp_path / "m.gguf"
    model.write_bytes(MODEL_BYTES)
    grants = tmp_path / "grants.yaml"
    grants.write_text(
        "slotTokens: 512\ngrants:\n- {mind: minds/mira, state: Granted, slot: 1, tokens: 512}\n"
    )
    status = tmp_path / "runtime.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "continuum_operator.cli", "engine",
        "--model", str(model), "--model-sha256", SHA, "--grants", str(grants),
        "--listen", f"127.0.0.1:{port}", "--llama-server", fake_server(tmp_path),
        "--status-file", str(status), "--unsafe-trust-mind-header",
        "--", "--ctx-size", "1024", "--parallel", "2",
    ]  # fmt: skip
    log = (tmp_path / "engine.log").open("wb")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log)

    def call(method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as err:
            with err:
                return err.code, json.loads(err.read() or b"null")

    try:
        deadline = time.monotonic() + 120  # generous: a loaded CI machine starts Python slowly
        while True:
            try:
                if call("GET", "/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            assert time.monotonic() < deadline, "continuum engine never became ready"
            time.sleep(0.1)
        mind = {"X-Continuum-Mind": "minds/mira", "Content-Type": "application/json"}
        code, opened = call("POST", "/v1/turns", {}, **mind)
        assert (code, opened["slot"]) == (201, 1)
        code, reply = call(
            "POST", "/completion", {"prompt": "hi", "n_predict": 2},
            **mind, **{"X-Continuum-Turn": opened["turn"]},
        )  # fmt: skip
        assert (code, reply["id_slot"]) == (200, 1)
        grants.write_text(
            "slotTokens: 512\ngrants:\n- {mind: minds/mira, state: Reclaiming, slot: 1, "
            "tokens: 512, reason: EngineShrunk, since: '2026-12-03T06:00:00Z'}\n"
        )
        deadline = time.monotonic() + 60
        while True:
            doc = json.loads(status.read_text()) if status.exists() else {}
            if doc.get("slotReleases"):
                break
            assert time.monotonic() < deadline, f"no release reported: {doc}"
            time.sleep(0.05)
        [release] = doc["slotReleases"]
        assert (release["mind"], release["slot"], release["reason"]) == (
            "minds/mira",
            1,
            "EngineShrunk",
        )
        assert release["grantSince"] == "2026-12-03T06:00:00Z" and release["erasedTokens"] == 4
        assert doc["phase"] == "Serving" and doc["receipts"][0]["modelSha256"] == SHA
        assert call("POST", "/v1/turns", {}, **mind)[0] == 409
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    assert proc.returncode == 0


def test_a_plan_comes_from_plan_output_or_an_engines_status_and_bad_files_are_named(
    tmp_path: Path,
) -> None:
    import pytest

    plan = {"engineArgs": ["--ctx-size", "1024"], "poolTokens": 1024}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    (tmp_path / "engine.yaml").write_text(json.dumps({"kind": "Engine", "status": {"plan": plan}}))
    assert load_plan(tmp_path / "plan.json") == plan
    assert load_plan(tmp_path / "engine.yaml") == plan
    assert load_plan(None) == {}
    (tmp_path / "bad.yaml").write_text("engineArgs: --ctx-size 1024\n")
    with pytest.raises(PlanFileError, match=r"bad\.yaml: not a plan"):
        load_plan(tmp_path / "bad.yaml")
    with pytest.raises(PlanFileError, match=r"none\.yaml: cannot read"):
        load_plan(tmp_path / "none.yaml")
    # Hostile files are refused by name, never a traceback (exit 2 through `main`).
    (tmp_path / "latin1.yaml").write_bytes(b"engineArgs: [\xe9]\n")
    with pytest.raises(PlanFileError, match=r"latin1\.yaml: not UTF-8"):
        load_plan(tmp_path / "latin1.yaml")
    (tmp_path / "deep.yaml").write_text("engineArgs: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(PlanFileError, match=r"deep\.yaml: "):
        load_plan(tmp_path / "deep.yaml")
    (tmp_path / "two.yaml").write_text("engineArgs: []\n---\nengineArgs: []\n")
    with pytest.raises(PlanFileError, match=r"two\.yaml: 2 YAML documents"):
        load_plan(tmp_path / "two.yaml")
    # llama-server's arguments: what the plan says, with what the gateway needs added
    args = gateway_args(cast(list[str], plan["engineArgs"]), tmp_path)
    assert args[:2] == ["--ctx-size", "1024"]
    for flag in ("-lv", "--slots", "--slot-save-path", "--cache-ram"):
        assert flag in args
    assert gateway_args(["-lv", "3", "--cache-ram", "512"], tmp_path).count("-lv") == 1


def test_log_lines_cuts_a_long_line_and_reads_every_line_after_it() -> None:
    async def main() -> list[bytes]:
        stream = asyncio.StreamReader()
        stream.feed_data(b"build: 6869\n" + b"x" * 200_000 + b"\nnext\n")
        stream.feed_data(b"y" * 10 + b"\n" + b"no newline at the end")
        stream.feed_eof()
        return [line async for line in log_lines(stream, keep=64)]

    assert asyncio.run(main()) == [b"build: 6869", b"x" * 64, b"next", b"y" * 10,
                                   b"no newline at the end"]  # fmt: skip


def long_line_server(tmp_path: Path, marker: Path) -> str:
    """A llama-server that prints a line of 70 KB (at `-lv 4` llama.cpp prints each
    end-of-generation token's text whole: the model file sets it), then 600 KB more, then
    waits: a reader that stopped at the long line leaves it blocked on a full pipe."""
    script = tmp_path / "llama-server"
    script.write_text(
        f"#!{sys.executable}\n"
        "import sys, time\n"
        "out = sys.stdout\n"
        "out.write('build: 6869 (1a2b3c4d) with cc\\n')\n"
        "out.write('print_info:   - 2 (\\'' + 'x' * 70000 + '\\')\\n')\n"
        "for i in range(4000):\n"
        "    out.write('srv  update_slots: all slots are idle ' + 'y' * 100 + '\\n')\n"
        "out.write('last line\\n')\n"
        "out.flush()\n"
        f"open({str(marker)!r}, 'w').write('done')\n"
        "time.sleep(120)\n"
    )
    script.chmod(0o755)
    return str(script)


def test_a_log_line_past_64_kib_neither_blocks_llama_server_nor_hides_its_death(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "wrote-everything"
    model = tmp_path / "m.gguf"
    model.write_bytes(MODEL_BYTES)
    launch = LaunchSettings(
        llama_server=long_line_server(tmp_path, marker), model=model, args=(),
        verify_model=False, restart_backoff=(0.05,),
    )  # fmt: skip

    async def main() -> None:
        gateway = Gateway(GatewaySettings(upstream="http://127.0.0.1:1", health_seconds=0.1))
        await gateway.start()
        runtime = EngineRuntime(launch, gateway, echo_log=False)
        running = asyncio.create_task(runtime.run())
        try:
            await until(marker.exists, timeout=20.0)  # it wrote all it had: not blocked
            await until(lambda: bool(runtime.tail) and runtime.tail[-1] == "last line", 5.0)
            assert max(len(line) for line in runtime.tail) <= LOG_LINE_BYTES
            first = runtime.process
            assert first is not None
            first.kill()  # and its death is seen: its output ended
            await until(lambda: runtime.restarts == 1 and runtime.last_exit is not None, 20.0)
        finally:
            await asyncio.wait_for(runtime.stop(), 20)  # a blocked reader never let it end
            await asyncio.wait_for(running, 20)
            await gateway.close()

    asyncio.run(main())
