"""`continuum engine`: the process of an engine pod, llama-server behind the grant gateway.

It starts `llama-server` with the plan's arguments (layers on device, context for all slots,
one slot per grantable mind, KV cache type) on a loopback port, captures its load log into a
receipt (`engine.receipts`), and serves the gateway (`engine.gateway`) on the pod's port, with
`/healthz`, `/readyz`, `/metrics` and `/v1/runtime`. It is the one writer of the Engine's
`status.runtime` (docs/design.md "One writer per status field"): the receipt of the load, the
layers llama.cpp actually offloaded, whether it could offload at all, the estimate error per
pool side, and the slot releases the gateway made. The document goes to a file, to the Engine
(through `grants_source.EngineStatusWriter`), or both, only when it changed.

If llama-server exits, every turn on it is cut (`EngineRelaunching`), its slots count as empty,
and it is started again after a backoff.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import signal
import socket
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from continuum_operator.core import receipts
from continuum_operator.core.receipts import Receipt, is_host_buffer, parse_llama_log
from continuum_operator.engine.admission import GrantTableError, engine_audience
from continuum_operator.engine.gateway import Gateway, GatewaySettings, serve_app
from continuum_operator.engine.grants_source import (
    EngineStatusWriter,
    TokenReviewer,
    read_engine_plan,
    watch_engine,
    watch_file,
)
from continuum_operator.engine.receipts import receipt_from_log

__all__ = [
    "EngineRuntime",
    "LaunchSettings",
    "PlanFileError",
    "RuntimePhase",
    "add_parser",
    "estimate_errors",
    "gateway_args",
    "load_plan",
    "runtime_status",
]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_INVALID = 2
#: Lines of llama-server's log kept for the receipt: the load is logged long before this.
LOAD_LOG_LINES = 4000
VERBOSITY_FLAGS = frozenset(
    {"-lv", "--verbosity", "--log-verbosity", "-v", "--verbose", "--log-verbose"}
)


def llama_build(log_text: str) -> str | None:
    """The llama.cpp build a llama-server log names, as receipts file it."""
    return receipts.llama_build_of(log_text)


class RuntimePhase(StrEnum):
    """`status.runtime.phase`: where llama-server is in its life."""

    STARTING = "Starting"  # started, not answering /health yet
    SERVING = "Serving"  # loaded, receipted, serving
    RESTARTING = "Restarting"  # exited; started again after a backoff


@dataclass(frozen=True, slots=True)
class LaunchSettings:
    """What to run and how: llama-server's command line and what the receipt is keyed by."""

    llama_server: str
    model: Path
    args: tuple[str, ...]
    model_sha256: str | None = None
    llama_build: str | None = None
    gpus: int = 0
    host: str = "127.0.0.1"
    port: int = 0
    plan: dict[str, Any] = field(default_factory=dict)
    restart_backoff: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)

    def argv(self, port: int, slot_dir: Path) -> list[str]:
        return [
            self.llama_server,
            "-m",
            str(self.model),
            "--host",
            self.host,
            "--port",
            str(port),
            *gateway_args(self.args, slot_dir),
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


def gpu_offload(log_text: str, receipt: Receipt | None) -> bool | None:
    """Whether this llama.cpp could offload to a device: any device buffer says yes."""
    if receipt is not None and any(not is_host_buffer(b.device) for b in receipt.buffers):
        return True
    lowered = log_text.lower()
    if "no usable gpu" in lowered or "not compiled with gpu offload support" in lowered:
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
) -> dict[str, Any]:
    """The Engine's `status.runtime` document (docs/gateway.md, "What the runtime reports")."""
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
    }


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


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
        self._dirty = asyncio.Event()
        self._stopping = False
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
        )

    async def run(self) -> None:
        """Keep llama-server running until `stop`; publish the status as it changes."""
        publisher = asyncio.create_task(self._publish_loop())
        try:
            attempt = 0
            while not self._stopping:
                code = await self._run_once()
                if self._stopping:
                    break
                self.restarts += 1
                self.gateway.metrics.engine_restarted()
                self.gateway.engine_ready = False
                self.gateway.engine_restarted()
                self.phase = RuntimePhase.RESTARTING
                self._dirty.set()
                delay = self.launch.restart_backoff[
                    min(attempt, len(self.launch.restart_backoff) - 1)
                ]
                log.error("llama-server exited with %s; starting it again in %.0f s", code, delay)
                attempt += 1
                await asyncio.sleep(delay)
        finally:
            publisher.cancel()
            await asyncio.gather(publisher, return_exceptions=True)
            if self._slots_tmp is not None:
                self._slots_tmp.cleanup()
                self._slots_tmp = None

    async def stop(self) -> None:
        self._stopping = True
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
        if self._slots_tmp is None:
            self._slots_tmp = tempfile.TemporaryDirectory(prefix="continuum-slots-")
        return Path(self._slots_tmp.name)

    async def _read_log(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            text = line.decode("utf-8", "replace").rstrip("\n")
            if len(self.load_log) < LOAD_LOG_LINES:
                self.load_log.append(text)
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

    def _make_receipt(self) -> Receipt | None:
        sha = self.launch.model_sha256
        if sha is None:
            return None
        try:
            text = "\n".join(self.load_log)
            return receipt_from_log(
                text,
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


class PlanFileError(ValueError):
    """A `--plan` file that cannot be read, with the file named."""


def load_plan(path: Path | None) -> dict[str, Any]:
    """A serving plan (`continuum plan -o json|yaml`), or an Engine object's `status.plan`."""
    if path is None:
        return {}
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as err:
        raise PlanFileError(f"{path}: cannot read ({err.strerror})") from err
    except yaml.YAMLError as err:
        raise PlanFileError(f"{path}: not valid YAML or JSON: {err}") from err
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


async def serve(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    if not plan and args.engine is not None:
        namespace, _, name = args.engine.partition("/")
        try:
            plan = await read_engine_plan(namespace, name)
        except Exception as err:  # the receipt is still made; only the error is not
            log.warning("could not read Engine %s's status.plan: %s", args.engine, err)
    engine_args = parse_llama_args(args.llama_args) or tuple(plan.get("engineArgs") or ())
    sha = args.model_sha256
    if sha is None and not args.no_receipt:
        from continuum_operator.gguf import file_sha256

        sha = await asyncio.to_thread(file_sha256, args.model)
    launch = LaunchSettings(
        llama_server=args.llama_server,
        model=args.model,
        args=engine_args,
        model_sha256=sha,
        llama_build=args.llama_build,
        gpus=len(plan.get("gpus") or []),
        port=args.upstream_port,
        plan=plan,
    )
    gateway = Gateway(
        GatewaySettings(
            upstream="http://127.0.0.1:0",
            grace_seconds=args.grace,
            review_token=_reviewer(args),
        )
    )
    sinks: list[Callable[[dict[str, Any]], Awaitable[None]]] = []
    if args.status_file is not None:
        sinks.append(_file_publisher(args.status_file))
    engine_ns = engine_name = None
    if args.engine is not None:
        engine_ns, _, engine_name = args.engine.partition("/")
        sinks.append(EngineStatusWriter(engine_ns, engine_name).write)

    async def publish(doc: dict[str, Any]) -> None:
        for sink in sinks:
            await sink(doc)

    runtime = EngineRuntime(launch, gateway, publish=publish)
    # Minds' door and the cluster's: /metrics, /v1/releases and /v1/runtime are served on the
    # admin address only (docs/gateway.md, "Endpoints besides the protocol").
    admin = gateway.admin_app()

    async def runtime_doc(request: web.Request) -> web.Response:
        return web.json_response(runtime.status())

    admin.router.add_get("/v1/runtime", runtime_doc)
    await gateway.start()
    listen = f"0.0.0.0:{args.port}" if args.port is not None else args.listen
    admin_listen = args.admin_listen
    if args.admin_port is not None:
        admin_listen = f"0.0.0.0:{args.admin_port}"
    runners = []
    for served, address in ((gateway.app(), listen), (admin, admin_listen)):
        host, _, port = address.rpartition(":")
        runner, bound = await serve_app(served, host or "0.0.0.0", int(port))
        runners.append(runner)
        log.info("%s listening on %s", "gateway" if served is not admin else "admin", bound)

    if args.grants is not None:
        source = asyncio.create_task(watch_file(args.grants, gateway.set_table))
    else:
        assert engine_ns is not None and engine_name is not None
        source = asyncio.create_task(watch_engine(engine_ns, engine_name, gateway.set_table))
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
    return EXIT_OK


def _reviewer(args: argparse.Namespace) -> TokenReviewer | None:
    """Token review, on unless the unsafe local flag says to believe the mind header."""
    if args.unsafe_trust_mind_header:
        log.warning(
            "--unsafe-trust-mind-header: any client that reaches this port can spend any "
            "mind's grant by naming her; for a machine of one's own only"
        )
        return None
    audience = args.token_audience
    if audience is None and args.engine is not None:
        namespace, _, name = args.engine.partition("/")
        audience = engine_audience(namespace, name)
    assert audience is not None  # cmd_engine checked
    return TokenReviewer(audience)


def cmd_engine(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if (args.grants is None) == (args.engine is None):
        print("error: give --grants FILE or --engine NAMESPACE/NAME (one of them)", file=sys.stderr)
        return EXIT_INVALID
    if args.engine is not None and "/" not in args.engine:
        print(f"error: --engine {args.engine}: expected NAMESPACE/NAME", file=sys.stderr)
        return EXIT_INVALID
    if not args.model.is_file():
        print(f"error: --model {args.model}: no such file", file=sys.stderr)
        return EXIT_INVALID
    if not args.unsafe_trust_mind_header and args.engine is None and not args.token_audience:
        print(
            "error: --grants FILE: give --token-audience AUDIENCE (minds' tokens are reviewed "
            "with the API server) or, on a machine of your own, --unsafe-trust-mind-header",
            file=sys.stderr,
        )
        return EXIT_INVALID
    try:
        return asyncio.run(serve(args))
    except (GrantTableError, PlanFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID


def add_parser(sub: Any) -> None:
    """Register `engine` on the `continuum` command's subparsers."""
    p = sub.add_parser(
        "engine",
        help="run llama-server behind the grant gateway (an engine pod's process)",
        description="Start llama-server with the plan's arguments, capture its load receipt, "
        "and serve the grant gateway of docs/gateway.md in front of it. Arguments after `--` "
        "go to llama-server instead of the plan's engineArgs.",
    )
    p.add_argument("--model", type=Path, required=True, help="the GGUF model file")
    p.add_argument(
        "--model-sha256",
        "--sha256",
        dest="model_sha256",
        help="the model's digest (hashed from the file if absent)",
    )
    p.add_argument("--no-receipt", action="store_true", help="do not hash the model; no receipt")
    p.add_argument("--plan", type=Path, help="the serving plan (plan -o json, or an Engine)")
    p.add_argument("--grants", type=Path, help="a grant table file, watched for changes")
    p.add_argument("--engine", help="NAMESPACE/NAME: watch its status.grants, write status.runtime")
    p.add_argument("--listen", default="0.0.0.0:8080", help="the gateway's address (host:port)")
    p.add_argument("--port", type=int, help="the gateway's port on all addresses (for --listen)")
    p.add_argument("--llama-server", default="llama-server", help="the llama-server binary")
    p.add_argument("--upstream-port", type=int, default=0, help="llama-server's loopback port")
    p.add_argument("--llama-build", help="llama.cpp's build, when its log does not name it")
    p.add_argument("--status-file", type=Path, help="also write status.runtime here (JSON)")
    p.add_argument("--grace", type=float, default=30.0, help="reclaim grace without a deadline")
    p.add_argument(
        "--review-tokens",
        action="store_true",
        help="require each mind's service account token (Authorization: Bearer), reviewed "
        "with the API server (a TokenReview with the engine's audience); the default, said "
        "explicitly in the operator's pods",
    )
    p.add_argument(
        "--token-audience",
        help="the audience minds' tokens must carry (default with --engine NS/NAME: "
        "continuum.dev/engine/NS/NAME)",
    )
    p.add_argument(
        "--unsafe-trust-mind-header",
        action="store_true",
        help="believe the X-Continuum-Mind header without a token: anyone who reaches the "
        "port can spend any mind's grant (a machine of one's own only)",
    )
    p.add_argument(
        "--admin-listen",
        default="127.0.0.1:0",
        help="address of /metrics, /v1/releases, /v1/runtime (not served to minds)",
    )
    p.add_argument("--admin-port", type=int, help="the admin port on all addresses")
    p.add_argument("llama_args", nargs=argparse.REMAINDER, help="-- then llama-server arguments")
    p.set_defaults(func=cmd_engine)


def parse_llama_args(values: Sequence[str]) -> tuple[str, ...]:
    return tuple(values[1:] if values and values[0] == "--" else values)
