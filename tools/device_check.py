"""The Python half of tools/device_check.sh: models, plans, llama-server runs, the comparison.

    python tools/device_check.py --work DIR --out DIR --server PATH --build-done FILE
                                 --deadline EPOCH [--probe CAPTURE.json] [--dry]

1. The board: the NodeBoard the node agent would write from --probe (tools/device_probe.py's
   capture on this machine); without one, examples/boards/h200-discrete.yaml.
2. Models: `continuum model tiny` and a larger random-weight llama (`testing.write_tiny_gguf`),
   their facts and sha256 by `continuum facts --sha256`.
3. For each run (model, layers on device, context, parallel), an Engine with those facts,
   `offload` fixed and minds min = max = parallel, planned by `continuum plan -o json`.
4. Once the build (tools/device_check.sh, in the background) has written --build-done, each run
   starts llama-server with the plan's engineArgs and what `continuum engine` adds
   (`engine.runtime.gateway_args`: -lv 4, --slots, --cache-ram 0), waits for /health, reads
   NVML's per-process bytes for the server's pid, decodes a few tokens, reads NVML again, stops
   it, and parses its log (`core.receipts.parse_llama_log`): the receipt.
5. Writes compare.json after every run and compare.txt (the table) at the end.

--dry runs the same paths with a fake llama-server (this file's `fake-server`), whose log is
FABRICATED from the estimate (each buffer a little off it) so the parser, the comparison and the
table run anywhere; its NVML columns are empty unless a GPU happens to be there.
Runs are made in priority order and stop when --deadline is near; a failed step is recorded and
the next one runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "operator") not in sys.path:
    sys.path.insert(0, str(ROOT / "operator"))

import yaml  # noqa: E402

MIB = 1 << 20
CLI = "import sys; from continuum_operator.cli import main; sys.exit(main())"

#: A llama of a few hundred MiB in f16 (head size 128, GQA 12/4), so device buffers stand out
#: in NVML against the CUDA context: about 470 MiB of weights, 16 KiB of KV per token.
BIG_SHAPE = {
    "n_layer": 8,
    "n_embd": 1536,
    "n_head": 12,
    "n_head_kv": 4,
    "n_ff": 4096,
    "vocab_size": 32_000,
    "context_length": 32_768,
}


@dataclass(frozen=True)
class RunSpec:
    model: str
    ngl: int  # llama.cpp --n-gpu-layers: layers + 1 puts the output layer on the device too
    ctx: int  # --ctx-size: all slots together
    parallel: int = 1

    @property
    def name(self) -> str:
        return f"{self.model}-ngl{self.ngl}-c{self.ctx}-np{self.parallel}"


# In priority order: the runs made first are the ones most worth having if time runs out.
# big has 8 layers (ngl 9: all and the output), tiny 4 (ngl 5).
RUNS = (
    RunSpec("big", 9, 4096),
    RunSpec("big", 4, 4096),
    RunSpec("big", 9, 32768),
    RunSpec("tiny", 5, 2048, 2),  # examples/engines/tiny-chat.yaml: two minds of 1,024
    RunSpec("big", 8, 4096),  # every repeating layer, the output layer on the host
    RunSpec("big", 0, 4096),  # nothing offloaded: what does a CUDA build hold anyway?
    RunSpec("tiny", 2, 2048, 2),
    RunSpec("big", 9, 16384, 4),
)

#: Seconds a run may take at most (load, NVML, a short decode, stop), and the least worth starting.
RUN_SECONDS = 60
RUN_MIN_SECONDS = 25


def log(msg: str) -> None:
    print(f"  [device_check.py {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`continuum ARGS` in this interpreter (the console script may not be installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "operator"), env.get("PYTHONPATH")) if p
    )
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        check=False,
    )


# --- board, models, plans ---------------------------------------------------------------------


def make_board(probe_file: Path | None, work: Path) -> tuple[Path, dict[str, Any]]:
    """A NodeBoard YAML for `continuum plan`: the agent's board of this machine, else the
    example H200's."""
    info: dict[str, Any] = {}
    if probe_file is not None and probe_file.is_file():
        try:
            from continuum_operator.agent import probe
            from continuum_operator.core.nodeboard import board_status
            from continuum_operator.model.base import ObjectMeta
            from continuum_operator.model.board import NodeBoard

            doc = json.loads(probe_file.read_text())
            status = board_status(probe.readings(doc))
            board = NodeBoard(metadata=ObjectMeta(name="lent-h200"), status=status)
            body = board.model_dump(mode="json", by_alias=True, exclude_none=True)
            path = work / "logs" / "board.yaml"
            path.write_text(yaml.safe_dump(body, sort_keys=False))
            info = {"source": str(probe_file.name), "status": body.get("status")}
            return path, info
        except Exception as err:
            log(f"board from the probe failed ({err!r}); planning on the example H200 board")
            info["probe_error"] = repr(err)
    path = ROOT / "examples" / "boards" / "h200-discrete.yaml"
    info["source"] = str(path.relative_to(ROOT))
    return path, info


def make_models(work: Path) -> dict[str, dict[str, Any]]:
    """Write the models; their paths, facts and sha256 (None where a step failed)."""
    models: dict[str, dict[str, Any]] = {}
    mdir = work / "models"
    mdir.mkdir(parents=True, exist_ok=True)
    tiny = mdir / "tiny.gguf"
    r = cli("model", "tiny", str(tiny), "--force")
    log(f"continuum model tiny: exit {r.returncode}; {r.stdout.strip().splitlines()[:3]}")
    if r.returncode != 0:
        log(r.stderr[-2000:])
        try:  # what cmd_model_tiny writes, in this process
            from continuum_operator.cli.model import TINY_SHAPE
            from continuum_operator.testing import write_tiny_gguf

            write_tiny_gguf(tiny, TINY_SHAPE, seed=0)
        except Exception as err:
            log(f"tiny model by the library: {err!r}")
    big = mdir / "big.gguf"
    try:
        from continuum_operator.testing import TinyModelShape, write_tiny_gguf

        start = time.monotonic()
        write_tiny_gguf(big, TinyModelShape(**BIG_SHAPE), seed=0)  # type: ignore[arg-type]
        size = big.stat().st_size
        log(f"big model: {size / MIB:.1f} MiB in {time.monotonic() - start:.1f}s ({BIG_SHAPE})")
    except Exception as err:
        log(f"big model failed: {err!r}")
    for name, path in (("tiny", tiny), ("big", big)):
        entry: dict[str, Any] = {"path": str(path), "ok": path.is_file()}
        if path.is_file():
            entry["bytes"] = path.stat().st_size
            r = cli("facts", str(path), "--sha256", "-o", "json")
            if r.returncode == 0:
                doc = json.loads(r.stdout)
                entry["sha256"], entry["facts"] = doc["sha256"], doc["facts"]
            else:
                log(f"continuum facts {name}: exit {r.returncode}: {r.stderr[-1000:]}")
                try:  # what cmd_facts does, in this process
                    from continuum_operator.engine.digest import hash_file
                    from continuum_operator.gguf import read_facts

                    facts = read_facts(path)
                    entry["facts"] = facts.model_dump(
                        mode="json", by_alias=True, exclude_defaults=True
                    )
                    entry["sha256"] = hash_file(path)
                    entry["via"] = "library (the CLI failed)"
                except Exception as err:
                    log(f"facts {name} by the library: {err!r}")
                    entry["ok"] = False
        models[name] = entry
    return models


def engine_doc(run: RunSpec, model: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "continuum.dev/v1alpha1",
        "kind": "Engine",
        "metadata": {"name": run.name.replace("np", "p"), "namespace": "device-check"},
        "spec": {
            "model": {"sha256": model["sha256"], "facts": model["facts"]},
            "contextTokensPerMind": run.ctx // run.parallel,
            "minds": {"min": run.parallel, "max": run.parallel},
            "offload": run.ngl,
            "kvCacheType": "f16",
        },
    }


def plan_run(
    board: Path, engine: Path, receipt: Path | None = None
) -> tuple[dict[str, Any] | None, str]:
    """`continuum plan -o json` of one Engine (exit 3, unschedulable, still prints the plan)."""
    args = ["plan", "--board", str(board), "--engine", str(engine), "-o", "json"]
    if receipt is not None:
        args += ["--receipt", str(receipt)]
    r = cli(*args)
    if r.returncode in (0, 3) and r.stdout.strip():
        return json.loads(r.stdout), r.stderr.strip()
    why = f"continuum plan: exit {r.returncode}: {r.stderr.strip()[-1500:]}"
    try:  # what cmd_plan does, in this process: the CLI's imports (kubernetes) not needed
        from continuum_operator.core.plan import plan
        from continuum_operator.core.pools import Board, BoardLeases
        from continuum_operator.engine.receipts import load_receipts
        from continuum_operator.manifests import load_one
        from continuum_operator.model.board import NodeBoard
        from continuum_operator.model.engine import Engine

        core_board = Board.from_resource(load_one(NodeBoard, board))
        spec = load_one(Engine, engine).spec
        assert spec.model.facts is not None
        receipts = load_receipts([receipt] if receipt is not None else [])
        got = plan(
            core_board, spec, spec.model.facts, BoardLeases.of(core_board, []), receipts=receipts
        )
        doc = got.to_dict()
        doc["via"] = "library (the CLI failed)"
        return doc, why
    except Exception as err:
        return None, f"{why}; library: {err!r}"


# --- NVML ---------------------------------------------------------------------------------------


def nvml_now(pid: int | None) -> dict[str, Any]:
    """GPU 0's used bytes and the processes NVML lists, as the node agent reads them."""
    try:
        from continuum_operator.agent import nvml

        reading = nvml.parse(nvml.read_raw())
    except Exception as err:
        return {"error": repr(err)}
    if not reading.available or not reading.gpus:
        return {"error": reading.reason or "no GPU"}
    gpu = reading.gpus[0]
    procs = {p.pid: p.used_bytes for p in gpu.processes}
    return {
        "t": round(time.time(), 3),
        "device_used": gpu.used_bytes,
        "processes": procs,
        "pid_bytes": procs.get(pid) if pid is not None else None,
    }


def nvml_samples(pid: int, n: int = 3, gap: float = 0.3) -> list[dict[str, Any]]:
    out = []
    for i in range(n):
        out.append(nvml_now(pid))
        if i + 1 < n:
            time.sleep(gap)
    return out


def process_bytes(samples: list[dict[str, Any]], pid: int) -> tuple[int | None, str]:
    """The server's bytes in NVML: by its pid, else the only process listed (a pid namespace
    may hide the real pid), else unknown."""
    by_pid = [s["pid_bytes"] for s in samples if s.get("pid_bytes") is not None]
    if by_pid:
        return max(by_pid), "pid"
    lone = [
        next(iter(s["processes"].values()))
        for s in samples
        if len(s.get("processes") or {}) == 1 and next(iter(s["processes"].values())) is not None
    ]
    if lone:
        return max(lone), "only process listed (pid not matched)"
    return None, "not listed"


def torch_context_baseline(deadline: float) -> dict[str, Any]:
    """NVML's bytes for a bare CUDA process (torch, one small tensor): the floor any process
    pays before its own buffers. Measured while the build runs, in a child process."""
    if time.time() > deadline - 120:
        return {"skipped": "no time"}
    code = (
        "import torch, time, sys; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); "
        "print('ready', flush=True); sys.stdin.readline()"
    )
    try:
        proc = subprocess.Popen(
            [os.environ.get("DC_TORCH_PYTHON", "python3"), "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    except OSError as err:
        return {"error": repr(err)}
    try:
        assert proc.stdout is not None
        fd, said, start = proc.stdout.fileno(), b"", time.monotonic()
        while b"ready" not in said and (wait := 60 - (time.monotonic() - start)) > 0:
            if not select.select([fd], [], [], wait)[0]:
                break  # silent for the rest of the minute: give up on it
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            said += chunk
        if b"ready" not in said:
            return {"error": f"torch did not start: {said.decode(errors='replace')[-300:]}"}
        samples = nvml_samples(proc.pid)
        got, how = process_bytes(samples, proc.pid)
        return {"process_bytes": got, "matched_by": how, "samples": samples}
    finally:
        with contextlib.suppress(Exception):
            proc.kill()
            proc.wait(5)


# --- llama-server runs --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 2.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, ""
    except Exception as err:
        return 0, repr(err)


def server_argv(
    server: list[str], model: str, port: int, plan: dict[str, Any], slots: Path
) -> list[str]:
    args = list(plan.get("engineArgs") or [])
    try:
        from continuum_operator.engine.runtime import gateway_args

        args = gateway_args(args, slots)
    except Exception as err:  # the same additions by hand
        log(f"engine.runtime.gateway_args not importable ({err!r}); adding them by hand")
        args += ["-lv", "4", "--slots", "--slot-save-path", str(slots), "--cache-ram", "0"]
    return [*server, "-m", model, "--host", "127.0.0.1", "--port", str(port), *args]


def stop(proc: subprocess.Popen[bytes]) -> int | None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
    return proc.returncode


def one_run(
    run: RunSpec,
    server: list[str],
    model: dict[str, Any],
    plan: dict[str, Any],
    logs: Path,
    deadline: float,
) -> dict[str, Any]:
    """Start llama-server for `run`, read NVML while it serves, stop it, keep its log."""
    port = free_port()
    slots = logs.parent / "slots" / run.name
    slots.mkdir(parents=True, exist_ok=True)
    argv = server_argv(server, model["path"], port, plan, slots)
    log_path = logs / f"{run.name}.log"
    out: dict[str, Any] = {"argv": argv, "log": f"logs/{log_path.name}"}
    before = nvml_now(None)
    out["nvml_before"] = {k: before.get(k) for k in ("device_used", "processes", "error")}
    start = time.monotonic()
    with log_path.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT)
    out["pid"] = proc.pid
    base = f"http://127.0.0.1:{port}"
    limit = min(start + RUN_SECONDS - 15, deadline - 12)
    ready = False
    try:
        while time.monotonic() < limit and time.time() < deadline - 12:
            if proc.poll() is not None:
                break
            if http(base + "/health", timeout=1.0)[0] == 200:
                ready = True
                break
            time.sleep(0.2)
        out["ready"] = ready
        out["ready_seconds"] = round(time.monotonic() - start, 2)
        if ready:
            out["nvml_loaded"] = nvml_samples(proc.pid)
            with contextlib.suppress(Exception):
                smi = subprocess.run(
                    ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                    capture_output=True, text=True, timeout=10, check=False,
                )  # fmt: skip
                out["nvidia_smi_apps"] = (smi.stdout + smi.stderr).strip()[-1000:]
            t = time.monotonic()
            status, text = http(
                base + "/completion",
                {"prompt": "hello world once upon a time", "n_predict": 8, "temperature": 0},
                timeout=20,
            )
            out["completion"] = {
                "status": status,
                "seconds": round(time.monotonic() - t, 2),
                "tokens_predicted": _tokens_predicted(text),
            }
            out["nvml_decoded"] = nvml_samples(proc.pid)
    finally:
        out["exit"] = stop(proc)
        out["exited_early"] = not ready and out["exit"] is not None
        out["seconds"] = round(time.monotonic() - start, 2)
    return out


def _tokens_predicted(text: str) -> int | None:
    with contextlib.suppress(Exception):
        return int(json.loads(text).get("tokens_predicted"))
    return None


def receipt_of(log_text: str, run: RunSpec, model: dict[str, Any]) -> dict[str, Any]:
    """The receipt of one load's log, per side and kind, and the settings the log names."""
    from continuum_operator.core.receipts import BufferKind, parse_llama_log

    parsed = parse_llama_log(log_text)
    receipt = parsed.receipt(
        model_sha256=model["sha256"],
        context_tokens=run.ctx,
        llama_build=parsed.build or "unknown",
        gpus=1 if run.ngl > 0 else 0,
        source=f"tools/device_check.py {run.name}",
    )

    def side(host: bool) -> dict[str, int]:
        kinds = {k.value: receipt.total(k, host=host) for k in BufferKind}
        kinds["total"] = receipt.total(host=host)
        return kinds

    return {
        "device": side(False),
        "host": side(True),
        "buffers": [b.model_dump(mode="json") for b in receipt.buffers],
        "layers_offloaded": parsed.layers_offloaded,
        "layers_total": parsed.layers_total,
        "n_ctx": parsed.n_ctx,
        "n_ctx_seq": parsed.n_ctx_seq,
        "n_seq_max": parsed.n_seq_max,
        "n_ubatch": parsed.n_ubatch,
        "flash_attention": parsed.flash_attention,
        "kv_type": parsed.kv_type_k,
        "build": parsed.build,
        "receipt": receipt.model_dump(mode="json", by_alias=True),
    }


def estimate_of(plan: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for side in ("device", "host"):
        part = plan["bytes"][side]
        out[side] = {k: part[k] for k in ("weights", "kv", "compute", "reserve")}
        out[side]["in_use"] = part["weights"] + part["kv"] + part["compute"]
    return out


def ratio(a: int | None, b: int | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


# --- the fake llama-server (--dry) --------------------------------------------------------------


def fake_server(argv: list[str]) -> int:
    """A stand-in llama-server for --dry: a FABRICATED log of CUDA0 buffers derived from the
    estimate (each off by a few percent), then /health and /completion until SIGTERM."""
    p = argparse.ArgumentParser()
    p.add_argument("-m")
    p.add_argument("--port", type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--n-gpu-layers", type=int, default=0)
    p.add_argument("--ctx-size", type=int, default=4096)
    p.add_argument("--parallel", type=int, default=1)
    args, _ = p.parse_known_args(argv)

    from continuum_operator.core.compute import ComputeEstimate, kv_cells_per_sequence
    from continuum_operator.gguf import read_facts

    facts = read_facts(args.m)
    layers = facts.layers
    on = min(args.n_gpu_layers, layers)
    per_seq = args.ctx_size // args.parallel
    cells = kv_cells_per_sequence(per_seq) * args.parallel
    kv = facts.kv_f16_list()
    lw = facts.layer_bytes_list()
    dev_w = sum(lw[layers - on :]) + (facts.output_bytes if args.n_gpu_layers > layers else 0)
    host_w = facts.input_bytes + sum(lw[: layers - on])
    if args.n_gpu_layers <= layers:
        host_w += facts.output_host
    graph = ComputeEstimate(facts).graph_bytes(per_seq, args.parallel)

    def size(where: str, n: float) -> str:
        return f"{where} buffer size = {n / MIB:10.2f} MiB"

    t = "0.00.100.000 I "  # llama-server's timestamp and level, which the parser skips
    lines = [
        "FABRICATED LOG (tools/device_check.py fake-server, --dry): not llama.cpp's numbers",
        f"{t}build: 1 (0c1e57098) with fake for x86_64-linux-gnu",
        f"{t}load_tensors: offloaded {args.n_gpu_layers}/{layers + 1} layers to GPU",
        f"{t}load_tensors:   " + size("CPU_Mapped model", host_w * 1.001),
        f"{t}llama_context: n_seq_max             = {args.parallel}",
        f"{t}llama_context: n_ctx                 = {args.ctx_size}",
        f"{t}llama_context: n_ubatch              = 512",
        f"{t}llama_context: flash_attn            = enabled",
        f"{t}llama_context:  " + size("CUDA_Host  output", 0.12 * MIB),
    ]
    if on:
        lines.append(f"{t}load_tensors:        " + size("CUDA0 model", dev_w * 0.99))
        lines.append(f"{t}llama_kv_cache:      " + size("CUDA0 KV", sum(kv[layers - on :]) * cells))
        lines.append(f"{t}sched_reserve:      " + size("CUDA0 compute", graph * 0.97))
    if on < layers:
        lines.append(f"{t}llama_kv_cache:        " + size("CPU KV", sum(kv[: layers - on]) * cells))
    lines.append(
        f"{t}llama_kv_cache: size = 1.00 MiB (  256 cells,   1 layers,  1/1 seqs), "
        "K (f16):    0.50 MiB, V (f16):    0.50 MiB"
    )
    lines.append(f"{t}sched_reserve:  " + size("CUDA_Host compute", graph / 8))
    print("\n".join(lines), flush=True)

    class Handler(BaseHTTPRequestHandler):
        def _json(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._json(200, {"status": "ok"})

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._json(200, {"content": " tok" * 8, "tokens_predicted": 8})

        def log_message(self, *a: Any) -> None:
            pass

    httpd = HTTPServer((args.host, args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    httpd.serve_forever()
    return 0


# --- the table ----------------------------------------------------------------------------------


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def rat(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(results: list[dict[str, Any]]) -> str:
    head = (
        f"{'run':<22} {'ok':<4} {'est dev':>9} {'rcpt dev':>9} {'NVML proc':>9} "
        f"{'est/rcpt':>8} {'est/NVML':>8} {'rcpt/NVML':>9} {'NVML-rcpt':>9} "
        f"{'dev used+':>9} {'est host':>9} {'rcpt host':>9} {'est/rcpt h':>10} {'w/ rcpt':>8}"
    )
    rows = [head, "-" * len(head)]
    for r in results:
        est = (r.get("estimate") or {}).get("device", {}).get("in_use")
        got = (r.get("receipt") or {}).get("device", {}).get("total")
        nv = (r.get("nvml") or {}).get("process_bytes")
        est_h = (r.get("estimate") or {}).get("host", {}).get("in_use")
        got_h = (r.get("receipt") or {}).get("host", {}).get("total")
        used = (r.get("nvml") or {}).get("device_used_delta")
        ok = "yes" if r.get("receipt") else ("plan" if r.get("estimate") else "no")
        rows.append(
            f"{r['run']:<22} {ok:<4} {mib(est):>9} {mib(got):>9} {mib(nv):>9} "
            f"{rat(ratio(est, got)):>8} {rat(ratio(est, nv)):>8} {rat(ratio(got, nv)):>9} "
            f"{mib(None if nv is None or got is None else nv - got):>9} "
            f"{mib(used):>9} {mib(est_h):>9} {mib(got_h):>9} {rat(ratio(est_h, got_h)):>10} "
            f"{(r.get('plan_with_receipt') or {}).get('source', '-'):>8}"
        )
    rows.append("")
    rows.append(
        "MiB. est: `continuum plan` bytes in use (weights + KV + compute, no reserve); rcpt: the "
        "buffers llama-server logged (CUDA0 = device; CPU*, CUDA_Host = host); NVML proc: the "
        "server's usedGpuMemory (max over samples after load and after a short decode), which "
        "also holds the CUDA context, kernels and cuBLAS workspace; dev used+: the GPU's used "
        "bytes (NVML memory info) while it ran less before it started; w/ rcpt: the plan's "
        "bytes source when given the run's receipt (receipt = its key matched)."
    )
    for r in results:
        bits = []
        if r.get("error"):
            bits.append(f"error: {r['error']}")
        if (r.get("receipt") or {}).get("device"):
            e = (r.get("estimate") or {}).get("device", {})
            g = r["receipt"]["device"]
            bits.append(
                "device est/rcpt by kind: "
                + ", ".join(
                    f"{k} {mib(e.get(ek))}/{mib(g.get(k))}"
                    for k, ek in (("model", "weights"), ("kv", "kv"), ("compute", "compute"))
                )
                + f", output -/{mib(g.get('output'))}"
            )
        if bits:
            rows.append(f"  {r['run']}: " + "; ".join(bits))
    return "\n".join(rows)


# --- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["fake-server"]:
        return fake_server(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--server", default="")
    ap.add_argument("--build-done", type=Path, required=True)
    ap.add_argument("--deadline", type=float, required=True, help="epoch seconds")
    ap.add_argument("--probe", type=Path, default=None)
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args(argv)
    logs = args.work / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"dry": args.dry, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    results: list[dict[str, Any]] = []
    doc["runs"] = results

    def save() -> None:
        (args.out / "compare.json").write_text(json.dumps(doc, indent=1, default=str) + "\n")

    board, doc["board"] = make_board(args.probe, args.work)
    log(f"board: {doc['board'].get('source')}")
    models = make_models(args.work)
    doc["models"] = {k: {kk: v[kk] for kk in v if kk != "facts"} for k, v in models.items()}
    doc["models_facts"] = {k: v.get("facts") for k, v in models.items()}
    plans: dict[str, dict[str, Any]] = {}
    for run in RUNS:
        entry: dict[str, Any] = {"run": run.name, "spec": run.__dict__}
        results.append(entry)
        model = models.get(run.model) or {}
        if not model.get("ok"):
            entry["error"] = f"no model {run.model}"
            continue
        engine = logs / f"engine-{run.name}.yaml"
        engine.write_text(yaml.safe_dump(engine_doc(run, model), sort_keys=False))
        plan, err = plan_run(board, engine)
        if plan is None:
            entry["error"] = f"plan: {err}"
            continue
        plans[run.name] = plan
        entry["plan"] = {
            k: plan.get(k)
            for k in ("schedulable", "layersOnDevice", "totalLayers", "poolTokens", "engineArgs",
                      "source", "reasons", "via")
        }  # fmt: skip
        entry["estimate"] = estimate_of(plan)
        if not plan.get("schedulable"):
            entry["error"] = f"unschedulable: {err}"
    save()
    log(f"planned {len(plans)} of {len(RUNS)} runs")

    if args.dry:
        server = [sys.executable, str(Path(__file__).resolve()), "fake-server"]
        doc["build"] = {"status": "dry: fake llama-server"}
    else:
        doc["cuda_context_baseline"] = torch_context_baseline(args.deadline)
        bare = doc["cuda_context_baseline"]
        log(f"bare CUDA process (torch) in NVML: {bare.get('process_bytes')} bytes")
        save()
        server = [args.server]
        log("waiting for the llama-server build")
        while not args.build_done.exists() and time.time() < args.deadline - RUN_MIN_SECONDS:
            time.sleep(2)
        rc = args.build_done.read_text().strip() if args.build_done.exists() else None
        doc["build"] = {"exit": rc, "waited_until": time.strftime("%H:%M:%S")}
        if rc != "0" or not Path(args.server).is_file():
            log(f"no llama-server (build exit {rc}); no runs")
            save()
            (args.out / "compare.txt").write_text(table(results) + "\n")
            print(table(results))
            return 1
        with contextlib.suppress(Exception):
            v = subprocess.run(
                [args.server, "--version"], capture_output=True, text=True, timeout=30
            )
            doc["build"]["version"] = (v.stdout + v.stderr).strip()[-500:]
        log(f"llama-server built; {args.deadline - time.time():.0f}s left for runs")

    for entry, run in zip(results, RUNS, strict=True):
        if run.name not in plans or not entry["plan"].get("schedulable"):
            continue
        if time.time() > args.deadline - RUN_MIN_SECONDS:
            entry["error"] = "skipped: out of time"
            continue
        model = models[run.model]
        try:
            entry["server"] = one_run(run, server, model, plans[run.name], logs, args.deadline)
            text = (logs / f"{run.name}.log").read_text(errors="replace")
            entry["receipt"] = receipt_of(text, run, model)
            pid = entry["server"]["pid"]
            samples = entry["server"].get("nvml_loaded", []) + entry["server"].get(
                "nvml_decoded", []
            )
            got, how = process_bytes(samples, pid)
            loaded, _ = process_bytes(entry["server"].get("nvml_loaded", []), pid)
            used = [s.get("device_used") for s in samples if s.get("device_used") is not None]
            base = entry["server"]["nvml_before"].get("device_used")
            entry["nvml"] = {
                "process_bytes": got,
                "process_bytes_after_load": loaded,
                "matched_by": how,
                "device_used_delta": (max(used) - base) if used and base is not None else None,
            }
            est = entry["estimate"]["device"]["in_use"]
            rdev = entry["receipt"]["device"]["total"]
            entry["ratios"] = {
                "estimate_over_receipt_device": ratio(est, rdev),
                "estimate_over_nvml_process": ratio(est, got),
                "receipt_over_nvml_process": ratio(rdev, got),
                "estimate_over_receipt_host": ratio(
                    entry["estimate"]["host"]["in_use"], entry["receipt"]["host"]["total"]
                ),
            }
            # The plan again, given this receipt: does its key match what the plan looks up?
            rfile = logs / f"receipt-{run.name}.yaml"
            rfile.write_text(yaml.safe_dump(entry["receipt"]["receipt"], sort_keys=False))
            again, err = plan_run(board, logs / f"engine-{run.name}.yaml", rfile)
            entry["plan_with_receipt"] = (
                {"source": again.get("source"), "device": again["bytes"]["device"],
                 "host": again["bytes"]["host"]}
                if again else {"error": err}
            )  # fmt: skip
            r = entry["ratios"]
            log(
                f"{run.name}: ready {entry['server'].get('ready')} in "
                f"{entry['server'].get('ready_seconds')}s; device est {mib(est)} rcpt {mib(rdev)} "
                f"NVML {mib(got)} ({how}); est/rcpt {rat(r['estimate_over_receipt_device'])}"
            )
        except Exception as err:
            entry["error"] = f"run: {err!r}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            log(f"{run.name}: {err!r}")
        save()

    text = table(results)
    (args.out / "compare.txt").write_text(text + "\n")
    print(text)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
