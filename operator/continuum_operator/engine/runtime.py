"""`continuum engine`: the process of an engine pod, llama-server behind the grant gateway.

It starts `llama-server` with the plan's arguments (layers on device, context for all slots,
one slot per grantable mind, KV cache type) on a loopback port, captures its load log into a
receipt (`engine.receipts`), and serves the gateway (`engine.gateway`) on the pod's port, with
`/healthz`, `/readyz`, `/metrics` and `/v1/runtime`. It is the one writer of the Engine's
`status.runtime` (docs/design.md "One writer per status field"): the receipt of the load, the
layers llama.cpp actually offloaded, whether it could offload at all, the estimate error per
pool side, and the slot releases the gateway made. The document goes to a file, to the Engine
(through `grants_source.EngineStatusWriter`), or both, only when it changed.

Before the first launch the model file's sha256 is checked against the digest the Engine names
(`engine.digest`): a mismatch is never served and never receipted, and status.runtime says so
with both digests (phase `ModelMismatch`). The gateway answers `/healthz` while the file is
hashed, so a liveness probe does not kill a long hash.

If llama-server exits, every turn on it is cut (`EngineRelaunching`), its slots count as empty,
and it is started again after a backoff, at most `max_restarts` times in any
`restart_window_seconds`: the exit after that stops it (phase `Stopped`, with why and the last
error line it printed) rather than restart it forever. Each exit is in status.runtime
(`restarts`, `lastExit`), where the operator counts it (a `Degraded` condition, the relaunch
metric).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import socket
import sys
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from aiohttp import web

from continuum_operator import manifests
from continuum_operator.core import receipts, rfc3339
from continuum_operator.core.receipts import (
    Receipt,
    is_host_buffer,
    parse_llama_log,
    read_for_receipt,
)
from continuum_operator.door.serving import serve_app
from continuum_operator.door.token_review import TokenReviewer
from continuum_operator.engine import digest
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.grants_source import (
    EngineStatusWriter,
    read_engine_status,
    watch_file,
    watch_ledger,
)
from continuum_operator.engine.parking import ParkSettings, ParkStore
from continuum_operator.kube.client.async_api import AsyncKubeApi

__all__ = [
    "EngineProcessSettings",
    "EngineRuntime",
    "LaunchSettings",
    "PlanFileError",
    "RuntimePhase",
    "estimate_errors",
    "gateway_args",
    "launch_settings",
    "load_plan",
    "runtime_status",
    "serve",
]

log = logging.getLogger(__name__)

#: Lines of llama-server's log kept for the receipt: the load is logged long before this.
LOAD_LOG_LINES = 4000
#: Bytes kept of one line of llama-server's output; the rest of a longer line is read and
#: dropped. A load line is under 200; at `-lv 4` llama.cpp prints each end-of-generation
#: token's text whole, which the model file sets.
LOG_LINE_BYTES = 4096
VERBOSITY_FLAGS = frozenset(
    {"-lv", "--verbosity", "--log-verbosity", "-v", "--verbose", "--log-verbose"}
)
THREAD_FLAGS = frozenset({"-t", "--threads"})
BATCH_THREAD_FLAGS = frozenset({"-tb", "--threads-batch"})
#: Lines of llama-server's output kept from its last run, for the error line of an exit.
TAIL_LINES = 50
_ERROR_WORDS = ("error", "failed", "abort", "exception", "fatal", "terminate", "cannot", "unable")
# Lines that say only that llama-server gives up, not why.
_CONSEQUENCE = re.compile(r"exiting due to|failed to load model\b|^\S*\s*aborted", re.IGNORECASE)


def llama_build(log_text: str) -> str | None:
    """The llama.cpp build a llama-server log names, as receipts file it."""
    return receipts.llama_build_of(log_text)


class RuntimePhase(StrEnum):
    """`status.runtime.phase`: where llama-server is in its life."""

    VERIFYING = "VerifyingModel"  # hashing the model file before the first launch
    MODEL_MISMATCH = "ModelMismatch"  # the file is not the model named: never started
    STARTING = "Starting"  # started, not answering /health yet
    SERVING = "Serving"  # loaded, receipted, serving
    RESTARTING = "Restarting"  # exited; started again after a backoff
    STOPPED = "Stopped"  # exited too often in the restart window: not started again


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """What to run and how: llama-server's command line and what the receipt is keyed by."""

    llama_server: str
    model: Path
    args: tuple[str, ...]
    model_sha256: str | None = None
    """The digest the Engine names (`spec.model.sha256`): checked against the file before
    the first launch, and the receipts' key. None: the file's own digest is the key."""
    llama_build: str | None = None
    gpus: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    plan: dict[str, Any] = field(default_factory=dict)
    restart_backoff: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)
    verify_model: bool = True
    """Hash the file before the first launch (off: `model_sha256` is trusted as given)."""
    verified: digest.VerifiedModel | None = None
    """This Engine's previous runtime's record of the file (`status.runtime.modelFile`)."""
    rehash: bool = False
    """Hash the file even when `verified` vouches for it."""
    node: str | None = None
    threads: int | None = None
    """`--threads` and `--threads-batch` for llama-server: the pod's CPUs (None: its default)."""
    max_restarts: int = 5
    """Restarts of llama-server allowed in any `restart_window_seconds`; the exit after them
    stops it (count)."""
    restart_window_seconds: float = 600.0
    launch: str | None = None
    """The pod's launch (`kube.workloads.engine_objects.LAUNCH_ENV`), named in every report so the
    operator reads only the current pod's."""
    park_dir: Path | None = None
    """The park store's directory (llama-server's `--slot-save-path`): the Engine's park tier,
    host memory or disk (docs/gateway.md, "A turn cut off"). None: a temporary directory."""
    park_budget_bytes: int = 0
    """The Engine's park budget; 0: reclaimed slots are erased, never parked."""

    def argv(self, port: int, slot_dir: Path) -> list[str]:
        return [
            self.llama_server,
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(port),
            *thread_args(gateway_args(self.args, slot_dir), self.threads),
        ]

    def context_tokens(self) -> int:
        for flag in ("--ctx-size", "-c"):
            if flag in self.args:
                return int(self.args[self.args.index(flag) + 1])
        return int(self.plan.get("poolTokens") or 4096)


def gateway_args(args: Sequence[str], slot_dir: Path) -> list[str]:
    """llama-server's arguments with what the gateway relies on added where absent.

    - `-lv 4`: llama-server logs the buffers of its load (the receipt) only at this verbosity.
    - `--slots`: the gateway reads the slots' sizes.
    - `--slot-save-path`: llama-server refuses slot actions, erase included, without one.
    - `--cache-ram 0`: llama-server otherwise keeps idle slots' prompts in a host-memory cache
      (8 GiB by default) shared by every slot, from which one mind's context could be restored
      into another's slot, and which no plan accounts for.
    """
    out = list(args)
    if not VERBOSITY_FLAGS.intersection(out):
        out += ["-lv", "4"]
    if "--slots" not in out and "--no-slots" not in out:
        out.append("--slots")
    if "--slot-save-path" not in out:
        out += ["--slot-save-path", str(slot_dir)]
    if "--cache-ram" not in out and "-cram" not in out:
        out += ["--cache-ram", "0"]
    return out


def thread_args(args: Sequence[str], threads: int | None) -> list[str]:
    """llama-server's arguments with `--threads`/`--threads-batch` set to the pod's CPUs
    where the arguments do not set them: llama.cpp otherwise starts one thread per core it
    sees, which is the node's, not the pod's, and a CPU limit below that throttles every
    thread (each waits for the slowest in a matrix product)."""
    out = list(args)
    if threads is None:
        return out
    if not THREAD_FLAGS.intersection(out):
        out += ["--threads", str(threads)]
    if not BATCH_THREAD_FLAGS.intersection(out):
        out += ["--threads-batch", str(threads)]
    return out


def error_line(lines: Sequence[str]) -> str:
    """The line of llama-server's last output that most likely says why it exited: the last
    that reads as an error and gives a cause, else the last that reads as an error, else the
    last non-empty one. llama.cpp ends a failed load with its consequence ("exiting due to
    model loading error") after the cause ("unknown tokenizer: 'x'"): the cause is the line to
    show."""
    kept = [line.strip() for line in lines if line.strip()]
    errors = [line for line in kept if any(w in line.lower() for w in _ERROR_WORDS)]
    causes = [line for line in errors if not _CONSEQUENCE.search(line)]
    for found in (causes, errors, kept):
        if found:
            return found[-1][:500]
    return ""


def estimate_errors(plan: dict[str, Any], receipt: Receipt) -> list[dict[str, Any]]:
    """The plan's bytes per side against what llama.cpp allocated: (planned - allocated) /
    allocated, per side that allocated anything (docs/design.md rule 5)."""
    sides = (plan.get("bytes") or {}) if isinstance(plan, dict) else {}
    out = []
    for side, host in (("device", False), ("host", True)):
        part = sides.get(side) or {}
        planned = sum(int(part.get(k) or 0) for k in ("weights", "kv", "compute"))
        allocated = receipt.total(host=host)
        if allocated <= 0 or not part:
            continue
        out.append(
            {
                "pool": side,
                "plannedBytes": planned,
                "allocatedBytes": allocated,
                "ratio": round((planned - allocated) / allocated, 6),
            }
        )
    return out


#: llama.cpp's words for a build or machine that cannot offload (lowercased).
NO_OFFLOAD = ("no usable gpu", "not compiled with gpu offload support")


def kept_of_load(line: str) -> bool:
    """Whether the runtime keeps a line of llama-server's load: those the receipt is read from
    and llama.cpp's word that it cannot offload. Only those: a model of many metadata keys (a
    line each, before the buffers) would push the buffers past the lines kept."""
    lowered = line.lower()
    return read_for_receipt(line) or any(words in lowered for words in NO_OFFLOAD)


def gpu_offload(log_text: str, receipt: Receipt | None) -> bool | None:
    """Whether this llama.cpp could offload to a device: any device buffer says yes."""
    if receipt is not None and any(not is_host_buffer(b.device) for b in receipt.buffers):
        return True
    lowered = log_text.lower()
    if any(words in lowered for words in NO_OFFLOAD):
        return False
    if receipt is not None:
        return False  # it loaded with host buffers only
    return None


def runtime_status(
    *,
    phase: RuntimePhase,
    ready: bool,
    restarts: int,
    receipt: Receipt | None,
    log_text: str,
    plan: dict[str, Any],
    slots: int | None,
    slot_tokens: int | None,
    releases: list[dict[str, Any]],
    threads: int | None = None,
    last_exit: dict[str, Any] | None = None,
    message: str | None = None,
    model_file: dict[str, Any] | None = None,
    launch: str | None = None,
    park: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Engine's `status.runtime` document (docs/gateway.md, "What the runtime reports").

    Every key is always present (None where unknown): the document is written as a merge
    patch, where a key left out would keep its old value.
    """
    parsed = parse_llama_log(log_text) if log_text else None
    offload = gpu_offload(log_text, receipt)
    layers = parsed.layers_offloaded if parsed else None
    if layers is None and offload is False:
        layers = 0  # a llama.cpp that cannot offload logs no count
    return {
        "phase": phase.value,
        "ready": ready,
        "restarts": restarts,
        "llamaBuild": receipt.llama_build if receipt else llama_build(log_text),
        "slots": slots,
        "slotTokens": slot_tokens,
        "layersOffloaded": layers,
        "layersTotal": parsed.layers_total if parsed else None,
        "gpuOffload": offload,
        "receipts": [receipt.model_dump(mode="json", by_alias=True)] if receipt else [],
        "estimateError": estimate_errors(plan, receipt) if receipt else [],
        "slotReleases": releases,
        "threads": threads,
        "lastExit": last_exit,
        "message": message,
        "modelFile": model_file,
        "launch": launch,
        "park": park,
    }


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


async def log_lines(
    stream: asyncio.StreamReader, keep: int = LOG_LINE_BYTES
) -> AsyncIterator[bytes]:
    """A process's output a line at a time (without its newline), each cut to `keep` bytes,
    until the end. A line of any length is read to its end: the pipe is always drained, for
    llama-server blocks on a full one (every thread that logs waits, so it stops serving) and
    its exit is seen only once its output ends. (`readline` raised on a line past 64 KiB.)"""
    head = b""
    while chunk := await stream.read(1 << 16):
        *ended, rest = chunk.split(b"\n")
        for part in ended:
            yield (head + part[: keep - len(head)]) if len(head) < keep else head
            head = b""
        if len(head) < keep:
            head += rest[: keep - len(head)]
    if head:
        yield head


class EngineRuntime:
    """llama-server kept running, its load turned into a receipt, its status published."""

    def __init__(
        self,
        launch: LaunchSettings,
        gateway: Gateway,
        *,
        publish: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
        echo_log: bool = True,
    ) -> None:
        self.launch = launch
        self.gateway = gateway
        self.publish_to = publish
        self.echo_log = echo_log
        self.phase = RuntimePhase.STARTING
        self.restarts = 0
        self.receipt: Receipt | None = None
        self.load_log: list[str] = []
        self.slots: int | None = None
        self.slot_tokens: int | None = None
        self.process: asyncio.subprocess.Process | None = None
        self.model_sha256 = launch.model_sha256
        self.model_file: dict[str, Any] | None = None
        self.message: str | None = None  # why it does not serve (a mismatch, a stop)
        self.last_exit: dict[str, Any] | None = None
        self.exits: list[float] = []  # monotonic times of the exits in the restart window
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._dirty = asyncio.Event()
        self._stopping = False
        self._stopped = asyncio.Event()
        # The last record of the file verified (the previous runtime's, then this one's).
        self._verified: digest.VerifiedModel | None = launch.verified
        self._slots_tmp: tempfile.TemporaryDirectory[str] | None = None
        gateway.on_change(self._dirty.set)

    def status(self) -> dict[str, Any]:
        return runtime_status(
            phase=self.phase,
            ready=self.gateway.engine_ready and self.phase is RuntimePhase.SERVING,
            restarts=self.restarts,
            receipt=self.receipt,
            log_text="\n".join(self.load_log),
            plan=self.launch.plan,
            slots=self.slots,
            slot_tokens=self.slot_tokens,
            releases=[r.to_status() for r in self.gateway.releases()],
            threads=self.launch.threads,
            last_exit=self.last_exit,
            message=self.message,
            model_file=self.model_file,
            launch=self.launch.launch,
            park=self.gateway.park.to_status() if self.gateway.park is not None else None,
        )

    async def run(self) -> None:
        """Keep llama-server running until `stop`; publish the status as it changes."""
        publisher = asyncio.create_task(self._publish_loop())
        try:
            attempt = 0
            while not self._stopping:
                # Before every start, not the first only: llama-server opens the file by path
                # again at each, and it may have been replaced meanwhile (a stat when its stamp
                # is unchanged, a hash when not).
                if not await self._verify_model():
                    await self._stopped.wait()  # not served; reported until the pod is stopped
                    return
                code = await self._run_once()
                if self._stopping:
                    break
                self.gateway.engine_ready = False
                self.gateway.engine_restarted()
                if self._exited(code):
                    await self._stopped.wait()
                    break
                self.restarts += 1
                self.gateway.metrics.engine_restarted()
                self.phase = RuntimePhase.RESTARTING
                self._dirty.set()
                delay = self.launch.restart_backoff[
                    min(attempt, len(self.launch.restart_backoff) - 1)
                ]
                log.error("llama-server exited with %s; starting it again in %.0f s", code, delay)
                attempt += 1
                # A stop ends the wait: the pod's grace period is no longer than the backoff.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopped.wait(), delay)
        finally:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
            if self._slots_tmp is not None:
                self._slots_tmp.cleanup()
                self._slots_tmp = None

    async def _verify_model(self) -> bool:
        """Check the file against the digest named; False (and reported) on a mismatch."""
        launch = self.launch
        if not launch.verify_model:
            return True
        self.phase = RuntimePhase.VERIFYING
        self._dirty.set()
        path = launch.model

        def progress(done: int, total: int, seconds: float) -> None:
            rate = done / seconds / 2**20 if seconds > 0 else 0.0
            log.info(
                "hashing %s: %.2f of %.2f GiB (%.0f%%), %.0f MiB/s",
                path, done / 2**30, total / 2**30, 100 * done / max(total, 1), rate,
            )  # fmt: skip

        check = await asyncio.to_thread(
            digest.verify,
            path,
            launch.model_sha256,
            self._verified,
            node=launch.node,
            rehash=launch.rehash and self._verified is launch.verified,  # the first check only
            progress=progress,
        )
        if check.verdict is digest.DigestOutcome.SKIPPED:
            log.info("model %s: same file as verified before (sha256 %s); not hashed", path,
                     check.actual)  # fmt: skip
        if not check.matches(launch.model_sha256):
            assert launch.model_sha256 is not None
            self.message = digest.mismatch_message(path, check.actual, launch.model_sha256)
            log.error("%s", self.message)
            self.model_file = {**check.record.to_status(), "verdict": "Mismatch"}
            self.phase = RuntimePhase.MODEL_MISMATCH
            self._dirty.set()
            return False
        self.model_sha256 = check.actual
        self._verified = check.record
        self.model_file = {**check.record.to_status(), "verdict": str(check.verdict)}
        self.phase = RuntimePhase.STARTING
        self._dirty.set()
        return True

    def _exited(self, code: int) -> bool:
        """Record an exit of llama-server; True when it is one too many to restart after."""
        now = time.monotonic()
        window = self.launch.restart_window_seconds
        self.exits = [t for t in self.exits if now - t < window] + [now]
        line = error_line(self.tail)
        self.last_exit = {
            "code": code,
            "at": rfc3339.format_seconds(time.time()),
            "line": line,
        }
        if len(self.exits) <= self.launch.max_restarts:
            return False
        self.message = (
            f"llama-server exited {len(self.exits)} times in {window:.0f} s (exit code {code}"
            + (f": {line}" if line else "")
            + f"); stopped after {self.launch.max_restarts} restarts. Fix the cause, then "
            "delete the engine's pod to start again"
        )
        log.error("%s", self.message)
        self.phase = RuntimePhase.STOPPED
        self._dirty.set()
        return True

    async def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        proc = self.process
        if proc is not None and proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    async def _run_once(self) -> int:
        port = self.launch.port or _free_port(self.launch.host)
        argv = self.launch.argv(port, self._slot_dir())
        upstream = f"http://{self.launch.host}:{port}"
        self.gateway.settings = _with_upstream(self.gateway.settings, upstream)
        log.info("starting %s", shlex.join(argv))
        self.load_log = []
        self.tail.clear()
        self.receipt = None
        self.process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        assert self.process.stdout is not None
        reader = asyncio.create_task(self._read_log(self.process.stdout))
        loaded = asyncio.create_task(self._when_loaded())
        code = await self.process.wait()
        loaded.cancel()
        await asyncio.gather(reader, loaded, return_exceptions=True)
        return code

    def _slot_dir(self) -> Path:
        if self.launch.park_dir is not None:
            self.launch.park_dir.mkdir(parents=True, exist_ok=True)
            return self.launch.park_dir
        if self._slots_tmp is None:
            self._slots_tmp = tempfile.TemporaryDirectory(prefix="continuum-slots-")
        return Path(self._slots_tmp.name)

    async def _read_log(self, stream: asyncio.StreamReader) -> None:
        async for line in log_lines(stream):
            text = line.decode("utf-8", "replace")
            # The load's lines, until it serves: no line after it is read, and each line a
            # server logs at -lv 4 need not be matched against the receipt's patterns.
            loading = self.phase is not RuntimePhase.SERVING
            if loading and len(self.load_log) < LOAD_LOG_LINES and kept_of_load(text):
                self.load_log.append(text)
            self.tail.append(text)
            if self.echo_log:
                print(text, file=sys.stderr)

    async def _when_loaded(self) -> None:
        while True:
            await self.gateway.probe()
            if self.gateway.engine_ready:
                break
            await asyncio.sleep(0.1)
        await self._read_slots()
        self.receipt = self._make_receipt()
        self._open_park_store()
        if self.receipt is not None:
            errors = {
                e["pool"]: e["ratio"] for e in estimate_errors(self.launch.plan, self.receipt)
            }
            self.gateway.metrics.load_reported(self.status()["layersOffloaded"], errors)
        self.phase = RuntimePhase.SERVING
        self._dirty.set()

    async def _read_slots(self) -> None:
        try:
            async with self.gateway.session.get(f"{self.gateway.settings.upstream}/slots") as resp:
                slots = await resp.json(content_type=None)
        except Exception as err:  # the status says unknown; serving goes on
            log.warning("could not read llama-server's /slots: %s", err)
            return
        if isinstance(slots, list) and slots:
            self.slots = len(slots)
            self.slot_tokens = int(slots[0].get("n_ctx") or 0) or None
            self.gateway.slot_ctx = self.slot_tokens

    def _open_park_store(self) -> None:
        """The park store, once llama-server has loaded: keyed by the model's digest and the
        slot's context (a park of another shape is dropped), its first size estimate the KV
        cache's bytes per cell from the receipt."""
        budget = self.launch.park_budget_bytes
        if budget <= 0 or self.gateway.park is not None:
            return
        kv = sum(b.bytes for b in self.receipt.buffers if b.kind == "kv") if self.receipt else 0
        per_token = kv / self.launch.context_tokens() if kv else 0.0
        shape = f"{self.model_sha256 or self.launch.model.name}/{self.slot_tokens}"
        settings = ParkSettings(self._slot_dir(), budget, shape, bytes_per_token=per_token)
        store = ParkStore(
            settings, self.gateway._post_json, self.gateway.metrics, changed=self._dirty.set
        )
        store.load()
        self.gateway.park = store

    def _make_receipt(self) -> Receipt | None:
        sha = self.model_sha256  # the file's digest, checked (or as given, unchecked)
        if sha is None:
            return None
        try:
            text = "\n".join(self.load_log)
            return parse_llama_log(text).receipt(
                model_sha256=sha,
                context_tokens=self.launch.context_tokens(),
                llama_build=self.launch.llama_build or llama_build(text),
                gpus=self.launch.gpus,
                source=f"continuum engine: {self.launch.model.name}",
            )
        except ValueError as err:
            log.warning("no receipt from llama-server's log: %s", err)
            return None

    async def _publish_loop(self) -> None:
        last: dict[str, Any] | None = None
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            doc = self.status()
            if doc != last and self.publish_to is not None:
                try:
                    await self.publish_to(doc)
                    last = doc
                except Exception as err:  # retried on the next change or in a second
                    log.warning("could not write status.runtime: %s", err)
                    await asyncio.sleep(1.0)
                    self._dirty.set()


def _with_upstream(settings: GatewaySettings, upstream: str) -> GatewaySettings:
    return replace(settings, upstream=upstream)


# --- the command -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EngineProcessSettings:
    """What one `continuum engine` process runs, read from its command line by `cli.engine`
    (which says each flag's default): the model, where its grants come from, where its runtime
    document goes, who may call, and the addresses it serves."""

    model: Path
    grants: Path | None
    """A grant table file, watched for changes; None: the Engine's GrantLedger (`engine`)."""
    engine: tuple[str, str] | None
    """(namespace, name) of the Engine whose GrantLedger it enforces and whose status.runtime
    it writes; None: a machine of one's own, with `grants`."""
    plan: Path | None
    status_file: Path | None
    model_sha256: str | None
    verify_model: bool
    """Hash the file before the first launch (off: no receipt, with no digest named)."""
    rehash: bool
    threads: int | None
    max_restarts: int
    restart_window_seconds: float
    llama_server: str
    upstream_port: int
    llama_build: str | None
    llama_args: tuple[str, ...]
    """llama-server's arguments given after `--`; empty: the plan's engineArgs."""
    park_dir: Path | None
    park_budget_bytes: int
    grace_seconds: float
    token_audience: str | None
    """The audience minds' tokens are reviewed for; None: the X-Continuum-Mind header is
    believed (`--unsafe-trust-mind-header`, a machine of one's own only)."""
    listen: str
    """The gateway's address, host:port."""
    admin_listen: str
    """The admin address (/metrics, /v1/releases, /v1/runtime), host:port."""
    launch: str | None
    """The pod's launch (`kube.workloads.engine_objects.LAUNCH_ENV`)."""
    access_log: bool = False
    """A line per request served to minds (`--access-log`)."""


class PlanFileError(ValueError):
    """A `--plan` file that cannot be read, with the file named."""


def load_plan(path: Path | None) -> dict[str, Any]:
    """A serving plan (`continuum plan -o json|yaml`), or an Engine object's `status.plan`."""
    if path is None:
        return {}
    # The bounded reader: a non-UTF-8 file, aliases or deep nesting are refused by name, never
    # a traceback (docs/security.md, hostile files).
    try:
        docs = manifests.yaml_documents(path)
    except manifests.ManifestError as err:
        raise PlanFileError(str(err)) from err
    if len(docs) != 1:
        raise PlanFileError(f"{path}: {len(docs)} YAML documents; a plan file holds one")
    doc = docs[0]
    if isinstance(doc, dict) and isinstance(doc.get("status"), dict):
        doc = doc["status"].get("plan") or {}  # an Engine object: its status.plan
    if not isinstance(doc, dict) or not isinstance(doc.get("engineArgs", []), list):
        raise PlanFileError(f"{path}: not a plan (a mapping with an engineArgs list)")
    return doc


def _file_publisher(path: Path) -> Callable[[dict[str, Any]], Awaitable[None]]:
    async def publish(doc: dict[str, Any]) -> None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
        os.replace(tmp, path)

    return publish


def _previous_runtime(path: Path | None) -> dict[str, Any]:
    """The runtime document a previous run wrote to `--status-file`, if any."""
    if path is None or not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


async def serve(settings: EngineProcessSettings) -> None:
    """Run the engine until SIGTERM or SIGINT. Raises `GrantTableError` or `PlanFileError` for a
    file it cannot use, `ConnectionError` when there is no API server to log in to."""
    # One adapter for every API call of the process, on its loop (the ledger's watch, the
    # Engine's status, the minds' TokenReviews); with a grants file the reviewer connects its
    # own at its first review, so a machine with no cluster runs without one.
    if settings.engine is None:
        await _serve(settings, None)
        return
    async with await AsyncKubeApi.connect() as api:
        await _serve(settings, api)


async def _serve(settings: EngineProcessSettings, api: AsyncKubeApi | None) -> None:
    plan, previous = await _plan_and_previous_runtime(settings, api)
    launch = launch_settings(settings, plan, previous)
    gateway = Gateway(
        GatewaySettings(
            upstream="http://127.0.0.1:0",
            grace_seconds=settings.grace_seconds,
            review_token=(reviewer := _reviewer(settings, api)),
            context_shift="--context-shift" in launch.args,
            access_log=settings.access_log,
        )
    )
    runtime = EngineRuntime(launch, gateway, publish=_publisher(settings, api))
    # Minds' door and the cluster's: /metrics, /v1/releases and /v1/runtime are served on the
    # admin address only (docs/gateway.md, "Endpoints besides the protocol").
    admin = gateway.admin_app()

    async def runtime_doc(request: web.Request) -> web.Response:
        return web.json_response(runtime.status())

    admin.router.add_get("/v1/runtime", runtime_doc)
    await gateway.start()
    runners = await _serve_gateway_and_admin(settings, gateway, admin)

    if settings.engine is None:
        assert settings.grants is not None
        source = asyncio.create_task(watch_file(settings.grants, gateway.set_table))
    else:
        assert api is not None
        engine_ns, engine_name = settings.engine
        source = asyncio.create_task(
            watch_ledger(engine_ns, engine_name, gateway.set_table, api=api)
        )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(runtime.stop()))
    try:
        await runtime.run()
    finally:
        source.cancel()
        await asyncio.gather(source, return_exceptions=True)
        for runner in runners:
            await runner.cleanup()
        await gateway.close()
        if reviewer is not None:
            await reviewer.close()


async def _plan_and_previous_runtime(
    settings: EngineProcessSettings, api: AsyncKubeApi | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The plan to launch and the runtime document of the run before: from the files named,
    else from the Engine's status."""
    plan = load_plan(settings.plan)
    previous = _previous_runtime(settings.status_file)
    if settings.engine is not None and api is not None:
        namespace, name = settings.engine
        try:
            status = await read_engine_status(namespace, name, api=api)
        except Exception as err:  # the receipt is still made; only the error is not
            log.warning("could not read Engine %s/%s's status: %s", namespace, name, err)
        else:
            if not plan and isinstance(status.get("plan"), dict):
                plan = status["plan"]
            if isinstance(status.get("runtime"), dict):
                previous = status["runtime"]
    return plan, previous


def launch_settings(
    settings: EngineProcessSettings, plan: dict[str, Any], previous: dict[str, Any]
) -> LaunchSettings:
    """What llama-server is started with: the command line's, the plan's arguments (unless
    the command line gave its own after `--`), the previous runtime's record of the file."""
    engine_args = settings.llama_args or tuple(plan.get("engineArgs") or ())
    return LaunchSettings(
        llama_server=settings.llama_server,
        model=settings.model,
        args=engine_args,
        model_sha256=settings.model_sha256,
        llama_build=settings.llama_build,
        gpus=len(plan.get("gpus") or []),
        port=settings.upstream_port,
        plan=plan,
        verify_model=settings.verify_model,
        verified=digest.VerifiedModel.from_status(previous.get("modelFile")),
        rehash=settings.rehash,
        node=str(plan["node"]) if plan.get("node") else None,
        threads=settings.threads,
        max_restarts=settings.max_restarts,
        restart_window_seconds=settings.restart_window_seconds,
        launch=settings.launch,
        park_dir=settings.park_dir,
        park_budget_bytes=settings.park_budget_bytes,
    )


def _publisher(
    settings: EngineProcessSettings, api: AsyncKubeApi | None
) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """Where the runtime document goes: the status file, the Engine's status, or both."""
    sinks: list[Callable[[dict[str, Any]], Awaitable[None]]] = []
    if settings.status_file is not None:
        sinks.append(_file_publisher(settings.status_file))
    if settings.engine is not None and api is not None:
        engine_ns, engine_name = settings.engine
        sinks.append(EngineStatusWriter(engine_ns, engine_name, api=api).write)

    async def publish(doc: dict[str, Any]) -> None:
        for sink in sinks:
            await sink(doc)

    return publish


async def _serve_gateway_and_admin(
    settings: EngineProcessSettings, gateway: Gateway, admin: web.Application
) -> list[web.AppRunner]:
    runners = []
    for served, address in ((gateway.app(), settings.listen), (admin, settings.admin_listen)):
        host, _, port = address.rpartition(":")
        runner, bound = await serve_app(served, host or "0.0.0.0", int(port))
        runners.append(runner)
        log.info("%s listening on %s", "gateway" if served is not admin else "admin", bound)
    return runners


def _reviewer(settings: EngineProcessSettings, api: AsyncKubeApi | None) -> TokenReviewer | None:
    """Token review, on unless the settings name no audience: the mind header is believed."""
    if settings.token_audience is None:
        log.warning(
            "--unsafe-trust-mind-header: any client that reaches this port can spend any "
            "mind's grant by naming her; for a machine of one's own only"
        )
        return None
    return TokenReviewer(settings.token_audience, api=api)
