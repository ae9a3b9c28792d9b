"""What the grant gateway costs: added latency per request and throughput with every slot busy.

One run, one llama-server (the real one, `tools/llama build`) on a generated model, measured
twice with the same client: straight to llama-server (pinned to a slot with `id_slot`, as the
gateway would pin it) and through the gateway (`engine.gateway`, in its own process, with a
grant table that grants every slot). Both are measured in alternating rounds so that load from
elsewhere on the machine falls on both alike.

- Latency: one request at a time, `n_predict` 1 on a short prompt, on one slot: p50 and p90 of
  each, the gateway's added p50, and the ratio.
- Throughput: one client per slot, all slots busy, `n_predict` 32 per request (`--n-predict`),
  for a fixed time: generated tokens per second of each, and the ratio.

For llama-server's native `/completion` (inside an open turn), and for OpenAI's
`/v1/chat/completions` and `/v1/responses` and Anthropic's `/v1/messages` as an unmodified
client sends them (no turn: a turn of one request; the gateway translates Responses and
Messages to a chat, and asks llama-server for the templated prompt, `/apply-template`, where
the prompt's size alone does not show that it fits). Straight to llama-server, each goes to its
own endpoint of that name.

The throughput ratio printed is the median of the per-round ratios (each round runs both back to
back), with their range: on a machine shared with other work, single figures swing widely.

Run: `.venv/bin/python bench/gateway.py` (add `--slots 4 --seconds 10` to change the load).

`--calls N` measures instead what swings least with the machine's load: the Python calls the
gateway's process makes per one-token request of each endpoint (cProfile's count over `N`
requests in a row, after a warm-up; the gateway's process profiles itself between two SIGUSR1),
and the CPU time it spends per request, unprofiled (from /proc, over another `N`).

`--fronts` names what stands in front of llama-server, each in its own process, all measured side
by side in the same rounds: `gateway`, and `bare`, a bare aiohttp proxy (read the JSON body, post
it to the same endpoint of llama-server, answer its JSON; the client names the slot), the floor
of any gateway written with aiohttp. `--loops` names the event loops each front runs on:
`asyncio` (the standard library's) and `uvloop` (libuv's, in C). `--fronts gateway bare --loops
asyncio uvloop` runs four fronts beside llama-server alone. Within each round the order of the
paths turns by one, so that none always follows another. `--json PATH` writes the figures, with
the machine's load average at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import logging
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from continuum_operator.core.grants import EnginePhase
from continuum_operator.engine.admission import GrantTable, TableEntry
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER
from continuum_operator.model.mind import GrantState
from continuum_operator.testing import TinyModelShape, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
SHAPE = TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, vocab_size=512)
SLOT_TOKENS = 1024
PROMPT = "Once upon a time"
NATIVE, CHAT = "/completion", "/v1/chat/completions"
MESSAGES, RESPONSES = "/v1/messages", "/v1/responses"
ENDPOINTS = (NATIVE, CHAT, MESSAGES, RESPONSES)
FRONTS = ("gateway", "bare")
LOOPS = ("asyncio", "uvloop")
DIRECT = "llama-server"


def generating(endpoint: str, n_predict: int) -> dict[str, Any]:
    """The body an unmodified client of `endpoint` sends for `n_predict` tokens (ignore_eos:
    llama-server's sampling field, so each generation runs as long as asked)."""
    said = {"temperature": 0.0, "ignore_eos": True, "model": "tiny"}
    if endpoint == CHAT:
        return {**said, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n_predict}
    if endpoint == MESSAGES:
        return {**said, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": n_predict}
    return {**said, "input": PROMPT, "max_output_tokens": n_predict}


def generated(endpoint: str, reply: dict[str, Any]) -> int:
    usage = reply["usage"]
    return int(usage["completion_tokens"] if endpoint == CHAT else usage["output_tokens"])


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def minds(slots: int) -> list[str]:
    return [f"bench/mind-{i}" for i in range(slots)]


async def serve_gateway(
    upstream: str, port: int, slots: int, grant: int, calls_out: str | None
) -> None:
    """The gateway process: every bench mind granted its own slot, `grant` tokens of it (the
    whole slot unless `--grant-tokens` says less). With `calls_out`, each
    SIGUSR1 starts or stops a profile of the process, and the calls it counted are written
    there at each stop."""
    from continuum_operator.door.serving import serve_app
    from continuum_operator.engine.gateway import Gateway, GatewaySettings

    # Logged as the engine logs (INFO), to nowhere: what the logging costs is counted.
    logging.basicConfig(level=logging.INFO, filename=os.devnull)
    gateway = Gateway(GatewaySettings(upstream=upstream))
    await gateway.start()
    gateway.slot_ctx = SLOT_TOKENS  # as the runtime reads it from /slots
    entries = {
        m: TableEntry(m, GrantState.GRANTED, "SlotFree", slot=i, tokens=grant)
        for i, m in enumerate(minds(slots))
    }
    gateway.set_table(GrantTable(SLOT_TOKENS, EnginePhase.SERVING, entries))
    await serve_app(gateway.app(), "127.0.0.1", port)
    if calls_out is not None:
        _profile_on_signal(Path(calls_out))
    _say_loop("gateway")
    await asyncio.Event().wait()


async def serve_bare(upstream: str, port: int, calls_out: str | None) -> None:
    """A bare aiohttp proxy in the gateway's place: no grant, no count, no note."""
    logging.basicConfig(level=logging.INFO, filename=os.devnull)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def proxy(request: web.Request) -> web.Response:
        body = await request.json()
        async with session.post(f"{upstream}{request.path}", json=body) as resp:
            return web.json_response(await resp.json(), status=resp.status)

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"ready": True})

    app = web.Application(handler_args={"access_log": None})
    app.router.add_get("/readyz", ready)
    app.router.add_post("/{path:.*}", proxy)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    if calls_out is not None:
        _profile_on_signal(Path(calls_out))
    _say_loop("bare")
    await asyncio.Event().wait()


def _say_loop(front: str) -> None:
    loop = type(asyncio.get_running_loop())
    print(f"{front}: serving on {loop.__module__}.{loop.__qualname__}", file=sys.stderr)


def run_on(loop: str, main: Coroutine[Any, Any, None]) -> None:
    """Run `main` on a new event loop of the kind `loop` names."""
    factory = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


@dataclass(frozen=True)
class Front:
    """A process in front of llama-server: `kind` (FRONTS) on the event loop `loop` (LOOPS)."""

    kind: str
    loop: str
    url: str
    process: subprocess.Popen[bytes]

    @property
    def name(self) -> str:
        return f"{self.kind}/{self.loop}"

    @property
    def bare(self) -> bool:
        return self.kind == "bare"


def _profile_on_signal(out: Path) -> None:
    profile: list[cProfile.Profile] = []

    def toggle() -> None:
        if not profile:
            profile.append(cProfile.Profile())
            profile[0].enable()
            return
        profile[0].disable()
        out.write_text(str(pstats.Stats(profile.pop()).total_calls))  # type: ignore[attr-defined]

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, toggle)


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system) a process has used so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def calls_per_request(front: Front, out: Path, n: int, endpoints: tuple[str, ...]) -> None:
    """The front's Python calls per one-token request of each endpoint, `n` in a row, and
    the CPU time its process spends per request (unprofiled, another `n`): its own work,
    which the machine's load delays but does not add to, as it does to wall-clock latency.
    (On uvloop the loop's own work is C, which cProfile does not count: its CPU time does.)"""
    gateway = front.process
    async with aiohttp.ClientSession() as http:
        client = Client(http, front.url, 0, None if front.bare else minds(1)[0])
        await client.open()
        for endpoint in endpoints:
            await latency(client, 20, endpoint)  # warm: first calls import and cache
            gateway.send_signal(signal.SIGUSR1)
            await asyncio.sleep(0.2)
            await latency(client, n, endpoint)
            out.unlink(missing_ok=True)
            gateway.send_signal(signal.SIGUSR1)
            while not out.exists() or not out.read_text():
                await asyncio.sleep(0.05)
            calls = int(out.read_text()) / n
            before = cpu_seconds(gateway.pid)
            await latency(client, n, endpoint)
            cpu = (cpu_seconds(gateway.pid) - before) / n
            print(
                f"{front.name} {endpoint}: {calls:,.0f} Python calls per one-token request, "
                f"{cpu * 1e6:,.0f} us of its CPU ({n} requests each)"
            )


async def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while True:
            try:
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} did not answer in {timeout:.0f} s")
            await asyncio.sleep(0.1)


class Client:
    """Requests to one slot, straight or through the gateway as one mind in one turn."""

    def __init__(self, http: aiohttp.ClientSession, base: str, slot: int, mind: str | None):
        self.http, self.base, self.slot, self.mind = http, base, slot, mind
        self.headers: dict[str, str] = {}

    async def open(self) -> None:
        if self.mind is None:
            return
        async with self.http.post(
            f"{self.base}/v1/turns", json={}, headers={MIND_HEADER: self.mind}
        ) as resp:
            turn = await resp.json()
            assert resp.status == 201, turn
        self.headers = {MIND_HEADER: self.mind, TURN_HEADER: turn["turn"]}

    async def complete(self, n_predict: int) -> int:
        """One native completion inside her turn: the tokens generated."""
        body: dict[str, Any] = {"prompt": PROMPT, "n_predict": n_predict, "temperature": 0.0}
        body["ignore_eos"] = True
        if self.mind is None:
            body["id_slot"] = self.slot
        async with self.http.post(f"{self.base}/completion", json=body, headers=self.headers) as r:
            reply: dict[str, Any] = await r.json()
            assert r.status == 200, reply
            return int(reply["tokens_predicted"])

    async def generate(self, endpoint: str, n_predict: int) -> int:
        """One request of an OpenAI or Anthropic client as it sends it: the tokens generated.
        Straight to llama-server it names the slot (`id_slot`: its /v1/messages drops it)."""
        body = generating(endpoint, n_predict)
        headers = {}
        if self.mind is None:
            body["id_slot"] = self.slot
        else:
            headers = {MIND_HEADER: self.mind}  # no turn named: a turn of one request
        async with self.http.post(f"{self.base}{endpoint}", json=body, headers=headers) as r:
            reply: dict[str, Any] = await r.json()
            assert r.status == 200, reply
            return generated(endpoint, reply)

    def call(self, endpoint: str) -> Any:
        if endpoint == NATIVE:
            return self.complete
        return lambda n_predict: self.generate(endpoint, n_predict)


async def latency(client: Client, n: int, endpoint: str = NATIVE) -> list[float]:
    out = []
    call = client.call(endpoint)
    for _ in range(n):
        t0 = time.perf_counter()
        await call(1)
        out.append(time.perf_counter() - t0)
    return out


async def throughput(
    clients: list[Client], seconds: float, n_predict: int, endpoint: str = NATIVE
) -> float:
    tokens = 0
    end = time.perf_counter() + seconds

    async def one(c: Client) -> None:
        nonlocal tokens
        call = c.call(endpoint)
        while time.perf_counter() < end:
            tokens += await call(n_predict)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in clients))
    return tokens / (time.perf_counter() - t0)


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


Figures = dict[str, dict[str, Any]]


async def measure(
    direct: str,
    fronts: list[Front],
    slots: int,
    requests: int,
    seconds: float,
    rounds: int,
    n_predict: int,
    endpoints: tuple[str, ...] = ENDPOINTS,
) -> dict[str, Figures]:
    """Each endpoint straight to llama-server and through each front, in the same rounds: the
    figures of each (`report`), by endpoint."""
    figures: dict[str, Figures] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        paths = {DIRECT: [Client(http, direct, i, None) for i in range(slots)]}
        for front in fronts:
            paths[front.name] = [
                Client(http, front.url, i, None if front.bare else m)
                for i, m in enumerate(minds(slots))
            ]
            for c in paths[front.name]:
                await c.open()
        for endpoint in endpoints:
            lat: dict[str, list[float]] = {name: [] for name in paths}
            tput: dict[str, list[float]] = {name: [] for name in paths}
            for clients in paths.values():
                await latency(clients[0], 5, endpoint)  # warm each path
            names = list(paths)
            for turn in range(rounds):
                order = names[turn % len(names) :] + names[: turn % len(names)]
                for name in order:
                    lat[name] += await latency(paths[name][0], requests, endpoint)
                for name in order:
                    tput[name].append(await throughput(paths[name], seconds, n_predict, endpoint))
            print(
                f"{endpoint}: slots {slots}, {os.cpu_count()} CPUs shared by llama-server, the "
                f"fronts and the client; latency: {rounds} x {requests} requests of 1 token on "
                f"one slot; throughput: all {slots} slots busy, {n_predict} tokens, "
                f"{rounds} x {seconds:g} s"
            )
            figures[endpoint] = report(lat, tput)
    return figures


def report(lat: dict[str, list[float]], tput: dict[str, list[float]]) -> Figures:
    """Print and return each path's p50, p90 and throughput, and for each front what it adds
    at p50 and its throughput over llama-server's, round by round."""
    ms = 1000.0
    figures: Figures = {}
    for name, xs in lat.items():
        figures[name] = {
            "p50_ms": pct(xs, 0.5) * ms,
            "p90_ms": pct(xs, 0.9) * ms,
            "tokens_per_s": statistics.median(tput[name]),
        }
        print(
            f"  {name:<16} p50 {pct(xs, 0.5) * ms:7.2f} ms   p90 {pct(xs, 0.9) * ms:7.2f} ms"
            f"   {statistics.median(tput[name]):8.1f} tokens/s (median of {len(tput[name])})"
        )
    base = figures[DIRECT]
    for name, fig in figures.items():
        if name == DIRECT:
            continue
        # Each round measures every path back to back: the ratio within a round is the least
        # disturbed by load that comes and goes on a shared machine.
        ratios = sorted(f / d for f, d in zip(tput[name], tput[DIRECT], strict=True))
        fig["added_p50_ms"] = fig["p50_ms"] - base["p50_ms"]
        fig["throughput_ratio"] = statistics.median(ratios)
        fig["throughput_ratio_range"] = [ratios[0], ratios[-1]]
        print(
            f"  {name:<16} adds {fig['added_p50_ms']:.2f} ms at p50 (ratio "
            f"{fig['p50_ms'] / base['p50_ms']:.3f}); throughput ratio "
            f"{fig['throughput_ratio']:.3f} (median of per-round ratios; range "
            f"{ratios[0]:.3f}..{ratios[-1]:.3f})"
        )
    return figures


def summary(figures: dict[str, Figures]) -> None:
    """One line per endpoint and front: added p50 and throughput ratio."""
    print("summary: endpoint, front, added p50, throughput ratio (per-round median)")
    for endpoint, by_path in figures.items():
        for name, fig in by_path.items():
            if name != DIRECT:
                print(
                    f"  {endpoint:<22} {name:<16} {fig['added_p50_ms']:6.2f} ms  "
                    f"{fig['throughput_ratio']:.3f}"
                )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--requests", type=int, default=50, help="latency requests per round")
    p.add_argument("--seconds", type=float, default=3.0, help="throughput seconds per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n-predict", type=int, default=32, help="tokens per throughput request")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--endpoints", nargs="+", default=list(ENDPOINTS), choices=ENDPOINTS)
    p.add_argument(
        "--calls", type=int, metavar="N", help="count each front's calls per request instead"
    )
    p.add_argument(
        "--grant-tokens",
        type=int,
        default=SLOT_TOKENS,
        help="each mind's grant (less than the slot's tokens: the gateway counts each chat's "
        "templated prompt with /apply-template, where its size alone does not show it fits)",
    )
    p.add_argument(
        "--fronts",
        nargs="+",
        default=["gateway"],
        choices=FRONTS,
        help="what stands in front of llama-server: the gateway, a bare aiohttp proxy, or both",
    )
    p.add_argument(
        "--loops", nargs="+", default=["asyncio"], choices=LOOPS, help="each front's event loop"
    )
    p.add_argument("--json", metavar="PATH", help="write the figures there too")
    p.add_argument(
        "--serve",
        nargs=5,
        metavar=("FRONT", "LOOP", "UPSTREAM", "PORT", "SLOTS"),
        help=argparse.SUPPRESS,
    )
    p.add_argument("--calls-out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def serve(args: argparse.Namespace) -> int:
    """This process as one front (`--serve`), until it is stopped."""
    front, loop, upstream, port, slots = args.serve
    calls_out = args.calls_out
    if front == "bare":
        run_on(loop, serve_bare(upstream, int(port), calls_out))
        return 0
    grant = min(args.grant_tokens, SLOT_TOKENS)
    run_on(loop, serve_gateway(upstream, int(port), int(slots), grant, calls_out))
    return 0


def start_fronts(args: argparse.Namespace, upstream: str, tmp: str) -> list[Front]:
    fronts = []
    for kind in args.fronts:
        for loop in args.loops:
            port = _free_port()
            calls_out = Path(tmp) / f"calls-{kind}-{loop}"
            process = subprocess.Popen(
                [sys.executable, __file__, "--serve", kind, loop, upstream, str(port),
                 str(args.slots), "--grant-tokens", str(args.grant_tokens),
                 *(["--calls-out", str(calls_out)] if args.calls else [])],
                stdout=subprocess.DEVNULL,
            )  # fmt: skip
            fronts.append(Front(kind, loop, f"http://127.0.0.1:{port}", process))
    return fronts


def bench(args: argparse.Namespace, upstream: str, fronts: list[Front], tmp: str) -> None:
    asyncio.run(wait_http(f"{upstream}/health"))
    for front in fronts:
        asyncio.run(wait_http(f"{front.url}/readyz"))
    endpoints = tuple(args.endpoints)
    if args.calls:
        for front in fronts:
            out = Path(tmp) / f"calls-{front.kind}-{front.loop}"
            asyncio.run(calls_per_request(front, out, args.calls, endpoints))
        return
    load = [os.getloadavg()]
    print(f"load average at the start: {load[0][0]:.2f} {load[0][1]:.2f} {load[0][2]:.2f}")
    figures = asyncio.run(
        measure(
            upstream,
            fronts,
            args.slots,
            args.requests,
            args.seconds,
            args.rounds,
            args.n_predict,
            endpoints,
        )
    )
    load.append(os.getloadavg())
    print(f"load average at the end: {load[1][0]:.2f} {load[1][1]:.2f} {load[1][2]:.2f}")
    summary(figures)
    if args.json:
        Path(args.json).write_text(json.dumps({"load": load, "figures": figures}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.serve:
        return serve(args)
    found = subprocess.run([str(ROOT / "tools" / "llama"), "path"], capture_output=True, text=True)
    if found.returncode != 0:
        print("llama-server is not built: run `make toolchain`", file=sys.stderr)
        return 2
    server = found.stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_gguf(Path(tmp) / "tiny.gguf", SHAPE, seed=0)
        up_port = _free_port()
        llama = subprocess.Popen(
            [server, "-m", str(model), "--host", "127.0.0.1", "--port", str(up_port),
             "-c", str(SLOT_TOKENS * args.slots), "--parallel", str(args.slots),
             "-t", str(args.threads), "--slots", "--slot-save-path", tmp, "--cache-ram", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        upstream = f"http://127.0.0.1:{up_port}"
        fronts = start_fronts(args, upstream, tmp)
        try:
            bench(args, upstream, fronts, tmp)
        finally:
            for proc in [f.process for f in fronts] + [llama]:
                proc.terminate()
                proc.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
