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

`--bare` puts a bare aiohttp proxy where the gateway was (read the JSON body, post it to the same
endpoint of llama-server, answer its JSON; the client names the slot): the floor of any gateway
written with aiohttp, measured as the gateway is.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
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
    print("ready", flush=True)
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
    await asyncio.Event().wait()


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


async def calls_per_request(
    gated: str,
    gateway: subprocess.Popen[bytes],
    out: Path,
    n: int,
    endpoints: tuple[str, ...],
    bare: bool = False,
) -> None:
    """The gateway's Python calls per one-token request of each endpoint, `n` in a row, and
    the CPU time its process spends per request (unprofiled, another `n`): its own work,
    which the machine's load delays but does not add to, as it does to wall-clock latency."""
    async with aiohttp.ClientSession() as http:
        client = Client(http, gated, 0, None if bare else minds(1)[0])
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
                f"{endpoint}: {calls:,.0f} Python calls per one-token request, "
                f"{cpu * 1e6:,.0f} us of the gateway's CPU ({n} requests each)"
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


async def measure(
    direct: str,
    gated: str,
    slots: int,
    requests: int,
    seconds: float,
    rounds: int,
    n_predict: int,
    endpoints: tuple[str, ...] = ENDPOINTS,
    bare: bool = False,
) -> None:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        straight = [Client(http, direct, i, None) for i in range(slots)]
        through = [Client(http, gated, i, None if bare else m) for i, m in enumerate(minds(slots))]
        for c in through:
            await c.open()
        for endpoint in endpoints:
            await latency(straight[0], 5, endpoint)  # warm both paths
            await latency(through[0], 5, endpoint)
            lat: dict[str, list[float]] = {"llama-server": [], "gateway": []}
            tput: dict[str, list[float]] = {"llama-server": [], "gateway": []}
            for _ in range(rounds):
                lat["llama-server"] += await latency(straight[0], requests, endpoint)
                lat["gateway"] += await latency(through[0], requests, endpoint)
                tput["llama-server"].append(
                    await throughput(straight, seconds, n_predict, endpoint)
                )
                tput["gateway"].append(await throughput(through, seconds, n_predict, endpoint))
            report(endpoint, slots, requests, seconds, rounds, n_predict, lat, tput)


def report(
    endpoint: str,
    slots: int,
    requests: int,
    seconds: float,
    rounds: int,
    n_predict: int,
    lat: dict[str, list[float]],
    tput: dict[str, list[float]],
) -> None:
    ms = 1000.0
    print(
        f"{endpoint}: slots {slots}, {os.cpu_count()} CPUs shared by llama-server, the gateway "
        f"and the client; latency: {rounds} x {requests} requests of 1 token on one slot"
    )
    for name, xs in lat.items():
        print(f"  {name:<13} p50 {pct(xs, 0.5) * ms:7.2f} ms   p90 {pct(xs, 0.9) * ms:7.2f} ms")
    added = pct(lat["gateway"], 0.5) - pct(lat["llama-server"], 0.5)
    ratio = pct(lat["gateway"], 0.5) / pct(lat["llama-server"], 0.5)
    print(f"  gateway adds {added * ms:.2f} ms per request at p50 (ratio {ratio:.3f})")
    print(f"  throughput: all {slots} slots busy, {n_predict} tokens, {rounds} x {seconds:.0f} s")
    for name, xs in tput.items():
        print(f"  {name:<13} {statistics.median(xs):8.1f} tokens/s (median of {len(xs)})")
    # Each round measures both back to back: the ratio within a round is the least disturbed
    # by load that comes and goes on a shared machine.
    ratios = sorted(g / d for g, d in zip(tput["gateway"], tput["llama-server"], strict=True))
    print(
        f"  gateway / llama-server throughput ratio {statistics.median(ratios):.3f} "
        f"(median of per-round ratios; range {ratios[0]:.3f}..{ratios[-1]:.3f})"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--requests", type=int, default=50, help="latency requests per round")
    p.add_argument("--seconds", type=float, default=3.0, help="throughput seconds per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n-predict", type=int, default=32, help="tokens per throughput request")
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--endpoints", nargs="+", default=list(ENDPOINTS), choices=ENDPOINTS)
    p.add_argument(
        "--calls", type=int, metavar="N", help="count the gateway's calls per request instead"
    )
    p.add_argument(
        "--grant-tokens",
        type=int,
        default=SLOT_TOKENS,
        help="each mind's grant (less than the slot's tokens: the gateway counts each chat's "
        "templated prompt with /apply-template, where its size alone does not show it fits)",
    )
    p.add_argument(
        "--bare", action="store_true", help="a bare aiohttp proxy in the gateway's place"
    )
    p.add_argument("--serve-gateway", nargs=3, metavar=("UPSTREAM", "PORT", "SLOTS"))
    p.add_argument("--calls-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve_gateway:
        upstream, port, slots = args.serve_gateway
        grant = min(args.grant_tokens, SLOT_TOKENS)
        if args.bare:
            asyncio.run(serve_bare(upstream, int(port), args.calls_out))
            return 0
        asyncio.run(serve_gateway(upstream, int(port), int(slots), grant, args.calls_out))
        return 0

    found = subprocess.run([str(ROOT / "tools" / "llama"), "path"], capture_output=True, text=True)
    if found.returncode != 0:
        print("llama-server is not built: run `make toolchain`", file=sys.stderr)
        return 2
    server = found.stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_gguf(Path(tmp) / "tiny.gguf", SHAPE, seed=0)
        up_port, gw_port = _free_port(), _free_port()
        llama = subprocess.Popen(
            [server, "-m", str(model), "--host", "127.0.0.1", "--port", str(up_port),
             "-c", str(SLOT_TOKENS * args.slots), "--parallel", str(args.slots),
             "-t", str(args.threads), "--slots", "--slot-save-path", tmp, "--cache-ram", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        upstream = f"http://127.0.0.1:{up_port}"
        calls_out = Path(tmp) / "calls"
        gateway = subprocess.Popen(
            [sys.executable, __file__, "--serve-gateway", upstream, str(gw_port), str(args.slots),
             "--grant-tokens", str(args.grant_tokens), *(["--bare"] if args.bare else []),
             *(["--calls-out", str(calls_out)] if args.calls else [])],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        gated = f"http://127.0.0.1:{gw_port}"
        try:
            asyncio.run(wait_http(f"{upstream}/health"))
            asyncio.run(wait_http(f"{gated}/readyz"))
            if args.bare:
                print("--bare: what is called the gateway below is a bare aiohttp proxy")
            if args.calls:
                endpoints = tuple(args.endpoints)
                asyncio.run(
                    calls_per_request(gated, gateway, calls_out, args.calls, endpoints, args.bare)
                )
                return 0
            asyncio.run(
                measure(
                    upstream,
                    gated,
                    args.slots,
                    args.requests,
                    args.seconds,
                    args.rounds,
                    args.n_predict,
                    tuple(args.endpoints),
                    args.bare,
                )
            )
        finally:
            for proc in (gateway, llama):
                proc.terminate()
                proc.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
