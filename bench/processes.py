#!/usr/bin/env python3
"""What the engine's and the lane's processes cost: their memory and their API requests a
minute, before and after a change, side by side in one run on a control plane of its own.

Usage: bench/processes.py [--base 5e39a0e] [--seconds 60] [--warmup 25] [--change-every 10]

Four processes run at once against one `tools/cluster` control plane: `continuum engine
--engine NS/NAME` (a tiny model behind the cached llama-server) and `continuum embed --lane
NS/NAME` (a tiny embedding model), each once from `--base` (its `operator/` taken with `git
archive`, put first on PYTHONPATH) and once from this tree, each with an Engine, a GrantLedger
and an EmbedLane of its own. Each process reaches the API server through a counting proxy of
its own (its kubeconfig names the proxy; the proxy forwards with the cluster's credentials),
which counts every request as it opens: a watch is one request however long it stays open.

After `--warmup` seconds (llama-server loaded, the lane calibrated), for `--seconds` the bench
changes each GrantLedger's grants and each EmbedLane's lease every `--change-every` seconds (as
the operator would), and samples each process's resident memory (the Python process, not
llama-server) every second. Printed per process: requests a minute, by verb and resource, and
RSS (at the end and the largest seen) and its threads (the most seen; a lane's include
llama.cpp's); then how soon each process acted on each change: an
engine answers the turn of a mind (her token reviewed, as in a cluster) as its ledger now says,
a lane reports its new lease (its `/v1/runtime`, live).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `continuum_operator`

import aiohttp
import psutil
import yaml
from aiohttp import web
from bench.kube_bench import ROOT, cluster_down, cluster_up

from continuum_operator.kube.client.api import crd_path, resource_of
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.client.login import login
from continuum_operator.kube.ledger import cached
from continuum_operator.model.json_body import at
from continuum_operator.testing import TinyModelShape, write_tiny_gguf

NS = "bench-processes"
ENGINE_SHAPE = TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                              vocab_size=512)  # fmt: skip
LANE_SHAPE = TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                            vocab_size=512, context_length=4096, embedding=True)  # fmt: skip
#: Hop-by-hop and length headers the proxy does not pass on (aiohttp frames its own).
DROPPED = {"host", "content-length", "transfer-encoding", "connection", "authorization"}


class CountingProxy:
    """An HTTP front of the API server for one process: each request counted (`counts`, by
    "VERB resource", a watch as WATCH) and forwarded with the cluster's credentials, its answer
    streamed back as it comes (a watch stays open)."""

    def __init__(self, kubeconfig: str) -> None:
        self.login = login(kubeconfig)
        self.counts: Counter[str] = Counter()
        self.session: aiohttp.ClientSession | None = None
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(ssl=self.login.tls or False)
        self.session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout())
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
        if self.session is not None:
            await self.session.close()

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        watching = request.query.get("watch") in ("1", "true")
        self.counts[f"{'WATCH' if watching else request.method} {resource_of(request.path)}"] += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
        headers.update(self.login.headers())
        async with self.session.request(
            request.method, self.login.server + request.path_qs,
            data=await request.read() or None, headers=headers,
            server_hostname=self.login.tls_server_name,
            # As sent: the kubernetes client sends a body with no Content-Type, which the API
            # server takes as JSON, where aiohttp's default (octet-stream) is a 415.
            skip_auto_headers=["Content-Type"],
        ) as upstream:  # fmt: skip
            response = web.StreamResponse(status=upstream.status)
            response.content_type = upstream.content_type
            await response.prepare(request)
            with contextlib.suppress(ConnectionError):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            return response

    def kubeconfig(self, path: Path) -> str:
        doc = {
            "apiVersion": "v1", "kind": "Config", "current-context": "p",
            "clusters": [{"name": "p", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "p", "user": {}}],
            "contexts": [{"name": "p", "context": {"cluster": "p", "user": "p"}}],
        }  # fmt: skip
        path.write_text(json.dumps(doc))
        return str(path)


@dataclass
class Runner:
    """One process under measure: which tree, which command, its proxy, its memory."""

    tree: str  # "before" or "after"
    what: str  # "engine" or "lane"
    name: str  # its Engine's or EmbedLane's name
    proxy: CountingProxy
    port: int = field(default_factory=lambda: free_port())  # the gateway's; the lane's admin
    token: str = ""  # the mind m1's token for this engine's audience
    proc: asyncio.subprocess.Process | None = None
    rss: list[int] = field(default_factory=list)
    threads: list[int] = field(default_factory=list)
    #: Seconds from each change to the process acting on it; changes it never acted on.
    latencies: list[float] = field(default_factory=list)
    missed: int = 0

    def sample(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(self.proc.pid)
                self.rss.append(proc.memory_info().rss)
                self.threads.append(proc.num_threads())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_tree(commit: str, into: Path) -> Path:
    """The `operator/` of `commit`, unpacked into `into` (no worktree made)."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "operator"], check=True, capture_output=True
    ).stdout
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(into, filter="data")
    return into / "operator"


def llama_server() -> str:
    out = subprocess.run([str(ROOT / "tools/llama"), "path"], capture_output=True, text=True)
    path = out.stdout.strip()
    if out.returncode != 0 or not os.access(path, os.X_OK):
        sys.exit("llama-server is not built: run `make toolchain` (or `tools/llama build`)")
    return path


async def objects(api: AsyncKubeApi, kubectl: list[str], names: list[str]) -> None:
    """CRDs, the namespace, and per name an Engine, its GrantLedger and an EmbedLane with a
    lease."""
    subprocess.run([*kubectl, "apply", "--server-side", "-f", str(ROOT / "crds")], check=True,
                   capture_output=True)  # fmt: skip
    subprocess.run([*kubectl, "wait", "--for=condition=Established", "--timeout=60s", "crd",
                    "--all"], check=True, capture_output=True)  # fmt: skip
    subprocess.run([*kubectl, "create", "namespace", NS], check=True, capture_output=True)
    example = yaml.safe_load((ROOT / "examples/engines/coder-8b.yaml").read_text())
    for name in names:
        engine = {**example, "metadata": {"name": name, "namespace": NS}}
        engine = await api.request("POST", crd_path("engines", NS), engine)
        await api.create(cached.new_ledger(engine))
        await grant(api, name, 0)
        lane = {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
                "metadata": {"name": name, "namespace": NS},
                "spec": {"engine": "none-such", "maxContextTokens": 1024}}  # fmt: skip
        await api.request("POST", crd_path("embedlanes", NS), lane)
        await lease(api, name, 0)


async def grant(api: AsyncKubeApi, name: str, step: int) -> None:
    """The ledger's grants as the operator would write them, one more mind each step."""
    minds = [{"mind": f"{NS}/m{i}", "state": "Granted", "slot": i % 2, "tokens": 512,
              "since": "t0"} for i in range(1 + step % 2)]  # fmt: skip
    capacity = {"phase": "Serving", "slots": 2, "tokensPerSlot": 1024}
    path = crd_path("grantledgers", NS, name, sub="status")
    await api.merge_patch(path, {"status": {"grants": minds, "grantCapacity": capacity}})


async def lease(api: AsyncKubeApi, name: str, step: int) -> None:
    placement = {"node": "n", "verdict": "Fits", "residence": "host",
                 "contextTokens": 512 if step % 2 else 1024}  # fmt: skip
    path = crd_path("embedlanes", NS, name, sub="status")
    await api.merge_patch(path, {"status": {"placement": placement}})


async def start(r: Runner, work: Path, base: Path, models: dict[str, Path], llama: str) -> None:
    env = {**os.environ, "KUBECONFIG": r.proxy.kubeconfig(work / f"{r.name}-{r.what}.kubeconfig")}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    if r.tree == "before":
        env["PYTHONPATH"] = str(base)
    if r.what == "engine":
        argv = ["engine", "--engine", f"{NS}/{r.name}", "--model", str(models["engine"]),
                "--no-receipt", "--listen", f"127.0.0.1:{r.port}", "--llama-server", llama,
                "--", "-c", "2048", "--parallel", "2", "-t", "1"]  # fmt: skip
    else:
        argv = ["embed", "--model", str(models["lane"]), "--lane", f"{NS}/{r.name}",
                "--listen", "127.0.0.1:0", "--admin-listen", f"127.0.0.1:{r.port}",
                "--threads", "1"]  # fmt: skip
    log = (work / f"{r.name}-{r.what}.log").open("wb")
    r.proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "continuum_operator.cli", *argv, stdout=log, stderr=log, env=env
    )


def report(runners: list[Runner], seconds: float) -> None:
    print(f"\nrequests a minute over {seconds:.0f} s, and resident memory (MiB)")
    head = f"{'process':<16} {'req/min':>8} {'RSS end':>8} {'RSS max':>8} {'threads':>7}"
    print(f"{head}  requests a minute by kind")
    for r in runners:
        total = sum(r.proxy.counts.values()) * 60 / seconds
        kinds = ", ".join(f"{k} {v * 60 / seconds:.1f}" for k, v in sorted(r.proxy.counts.items()))
        end = r.rss[-1] / 2**20 if r.rss else float("nan")
        top = max(r.rss) / 2**20 if r.rss else float("nan")
        threads = max(r.threads) if r.threads else 0
        row = f"{r.tree + ' ' + r.what:<16} {total:>8.1f} {end:>8.1f} {top:>8.1f} {threads:>7}"
        print(f"{row}  {kinds}")


async def run(args: argparse.Namespace, work: Path) -> int:
    kubeconfig, exports = cluster_up(work / "cluster")
    kubectl = [str(Path(exports["PATH"].split(":")[0]) / "kubectl"), "--kubeconfig", kubeconfig]
    models = {"engine": work / "engine.gguf", "lane": work / "lane.gguf"}
    write_tiny_gguf(models["engine"], ENGINE_SHAPE, seed=0)
    write_tiny_gguf(models["lane"], LANE_SHAPE, seed=3)
    base = base_tree(args.base, work / "base")
    llama = llama_server()
    runners = [Runner(tree, what, f"{tree}-{what}", CountingProxy(kubeconfig))
               for tree in ("before", "after") for what in ("engine", "lane")]  # fmt: skip
    async with await AsyncKubeApi.connect(kubeconfig) as api:
        await objects(api, kubectl, [r.name for r in runners])
        subprocess.run([*kubectl, "create", "serviceaccount", "m1", "-n", NS], check=True,
                       capture_output=True)  # fmt: skip
        for r in runners:
            audience = f"continuum.dev/engine/{NS}/{r.name}"
            r.token = subprocess.run(
                [*kubectl, "create", "token", "m1", "-n", NS, f"--audience={audience}",
                 "--duration=2h"], check=True, capture_output=True, text=True,
            ).stdout.strip()  # fmt: skip
        for r in runners:
            await r.proxy.start()
            await start(r, work, base, models, llama)
        try:
            await asyncio.sleep(args.warmup)
            for r in runners:
                r.proxy.counts.clear()
                r.rss.clear()
            async with aiohttp.ClientSession() as session:
                seconds, steps = await measure(args, api, runners, session)
            report(runners, seconds)
            await tell_reached(api, runners, steps)
        finally:
            for r in runners:
                if r.proc is not None and r.proc.returncode is None:
                    r.proc.terminate()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(r.proc.wait(), 20)
                await r.proxy.stop()
    return 0


async def measure(
    args: argparse.Namespace,
    api: AsyncKubeApi,
    runners: list[Runner],
    session: aiohttp.ClientSession,
) -> tuple[float, int]:
    """Every `--change-every` seconds for `--seconds`, each ledger's grants and each lane's lease
    changed, and how long until each process acts on it: memory sampled each second meanwhile.
    The seconds measured and the changes made."""
    loop = asyncio.get_running_loop()

    async def sample() -> None:
        while True:
            for r in runners:
                r.sample()
            await asyncio.sleep(1.0)

    sampler = asyncio.create_task(sample())
    began, step = loop.time(), 0
    try:
        while loop.time() - began < args.seconds:
            step += 1
            changed = loop.time()
            for r in runners:
                await (grant if r.what == "engine" else lease)(api, r.name, step)
            until = changed + args.change_every
            await asyncio.gather(*(reach(r, api, session, step, changed, until) for r in runners))
            await asyncio.sleep(max(0.0, until - loop.time()))
    finally:
        sampler.cancel()
    return loop.time() - began, step


async def reach(
    r: Runner,
    api: AsyncKubeApi,
    session: aiohttp.ClientSession,
    step: int,
    changed: float,
    until: float,
) -> None:
    """Wait for `r` to act on change `step`: an engine answers m1's turn as its ledger now
    says (201: granted on odd steps; 403: not in its table), a lane reports the lease."""
    loop = asyncio.get_running_loop()
    while loop.time() < until - 0.2:
        if await (engine_acts if r.what == "engine" else lane_acts)(r, api, session, step):
            r.latencies.append(loop.time() - changed)
            return
        await asyncio.sleep(0.1)
    r.missed += 1


async def engine_acts(
    r: Runner, api: AsyncKubeApi, session: aiohttp.ClientSession, step: int
) -> bool:
    url = f"http://127.0.0.1:{r.port}/v1/turns"
    headers = {"Authorization": f"Bearer {r.token}"}
    with contextlib.suppress(aiohttp.ClientError):
        async with session.post(url, headers=headers) as answer:
            return answer.status == (201 if step % 2 else 403)
    return False


async def lane_acts(
    r: Runner, api: AsyncKubeApi, session: aiohttp.ClientSession, step: int
) -> bool:
    """The lane's own report, live (`/v1/runtime` on its admin address), holds the lease."""
    with contextlib.suppress(aiohttp.ClientError):
        async with session.get(f"http://127.0.0.1:{r.port}/v1/runtime") as answer:
            runtime = await answer.json()
            return bool(runtime.get("leasedContextTokens") == (512 if step % 2 else 1024))
    return False


async def tell_reached(api: AsyncKubeApi, runners: list[Runner], steps: int) -> None:
    """Whether each process was alive and doing its job at the end."""
    print(f"\n{steps} changes of each ledger and lease, and how soon each process acted on them")
    for r in runners:
        alive = "running" if r.proc is not None and r.proc.returncode is None else "EXITED"
        plural = "engines" if r.what == "engine" else "embedlanes"
        got = await api.request("GET", crd_path(plural, NS, r.name))
        said = at(got, "status", "runtime", "phase" if r.what == "engine" else "contextTokens")
        took = (f"median {statistics.median(r.latencies):.2f} s, most {max(r.latencies):.2f} s"
                if r.latencies else "never")  # fmt: skip
        acted = f"acted on {len(r.latencies)} of {len(r.latencies) + r.missed} changes"
        print(f"{r.tree + ' ' + r.what:<16} {alive}; {acted} ({took}); status.runtime: {said}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="5e39a0e", help="the commit measured as before")
    parser.add_argument("--seconds", type=float, default=60.0, help="the measured window")
    parser.add_argument("--warmup", type=float, default=25.0, help="seconds before measuring")
    parser.add_argument("--change-every", type=float, default=10.0, help="seconds per change")
    parser.add_argument("--keep", type=Path, help="run in this directory and keep it (logs)")
    args = parser.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-processes-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        return asyncio.run(run(args, work))
    finally:
        cluster_down(work / "cluster")
        print(f"\nlogs: {work}")


if __name__ == "__main__":
    sys.exit(main())
