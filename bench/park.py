"""What parking buys a reclaimed mind: her first token after a reclaim and a new grant, her
context parked and restored against erased and evaluated again; and what it costs the reclaim.

One run, one llama-server (the real one, `tools/llama build`) on a generated model large enough
that a long prompt takes it seconds on a CPU, the gateway in this process in front of it with a
park store (docs/gateway.md, "A turn cut off"). For each context length (`--lengths`, tokens)
and each way (parked, erased), in the same run:

1. she is granted slot 0 and sends her context (a prompt of that length, one token generated);
2. her grant is reclaimed: the time until the gateway reports the slot released is the
   reclaim's (with a park the save and then the erase run behind the release; without, the
   erase is before it);
3. at once, Ann is granted the slot released and sends a prompt of 8 tokens, one generated:
   the time of that request is the next holder's first token. Parked, it waits for what is
   left of Mira's save and erase (the worst case: in a cluster the operator records the release
   and writes the next grant first, which takes longer than the save did here);
4. she is granted slot 1 (clean) and sends her context again with a few new tokens, one token
   generated: the time of that request is her time to first token. Parked, the gateway
   restores her context first and llama-server evaluates only the new tokens; erased, it
   evaluates the whole prompt.

Printed: per length, each way's time to first token and the tokens llama-server evaluated
(`prompt_n`) and reused (`cache_n`), the ratio, the reclaim's time and the next holder's first
token each way.

Run: `.venv/bin/python bench/park.py` (`--lengths 256 1024` for a quick look).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from continuum_operator.door.serving import serve_app
from continuum_operator.engine.admission import GrantTable, TableEntry
from continuum_operator.engine.gateway import Gateway, GatewaySettings
from continuum_operator.engine.parking import ParkSettings, ParkStore
from continuum_operator.engine.turn import MIND_HEADER
from continuum_operator.model.mind import GrantState
from continuum_operator.testing import TinyModelShape, write_tiny_gguf

ROOT = Path(__file__).resolve().parents[1]
# About 9 MB of f16 weights: a 16k-token prompt takes this CPU seconds (the test suites' tiny
# model, 1.4 MiB, reads it in a fraction of one).
SHAPE = TinyModelShape(
    n_layer=6, n_embd=256, n_head=4, n_head_kv=2, n_ff=768, vocab_size=2048,
    context_length=65536,
)  # fmt: skip
MIRA = "minds/mira"
ANN = "minds/ann"
NEW_TOKENS = 8
# K and V of every layer, f16: the first estimate of a park's size before a save measures it.
KV_BYTES_PER_TOKEN = 2 * SHAPE.n_layer * SHAPE.n_head_kv * (SHAPE.n_embd // SHAPE.n_head) * 2


def context(length: int) -> list[int]:
    return [3 + (i * 7919) % (SHAPE.vocab_size - 3) for i in range(length)]


def granted(slot: int, slot_tokens: int, others: GrantTable | None = None) -> GrantTable:
    entry = TableEntry(MIRA, GrantState.GRANTED, "SlotFree", slot=slot, tokens=slot_tokens)
    return GrantTable(slot_tokens, entries={**(others.entries if others else {}), MIRA: entry})


def ann_granted(slot: int, slot_tokens: int) -> GrantTable:
    entry = TableEntry(ANN, GrantState.GRANTED, "SlotFree", slot=slot, tokens=slot_tokens)
    return GrantTable(slot_tokens, entries={ANN: entry})


def reclaiming(slot: int, slot_tokens: int, since: str) -> GrantTable:
    entry = TableEntry(
        MIRA,
        GrantState.RECLAIMING,
        "Preempted",
        slot=slot,
        tokens=slot_tokens,
        deadline=time.time() + 60,
        since=since,
    )
    return GrantTable(slot_tokens, entries={MIRA: entry})


@dataclass
class Trial:
    length: int
    parked: bool
    reclaim_seconds: float
    next_holder_seconds: float
    first_token_seconds: float
    evaluated: int
    reused: int
    restored: int
    #: The save's own time as llama-server reports it (`timings.save_ms`), 0 without a park.
    save_ms: float = 0.0
    #: From the release to the end of the save and erase behind it, as the gateway saw them.
    behind_seconds: float = 0.0
    #: The next holder's request as llama-server timed it (prompt and generation).
    next_holder_llama_ms: float = 0.0


async def ask(
    http: aiohttp.ClientSession, url: str, prompt: list[int], mind: str = MIRA
) -> tuple[float, Any]:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "cache_prompt": True}
    started = time.monotonic()
    async with http.post(f"{url}/completion", json=body, headers={MIND_HEADER: mind}) as resp:
        reply = await resp.json()
        assert resp.status == 200, reply
    return time.monotonic() - started, reply


async def trial(
    gateway: Gateway,
    store: ParkStore,
    http: aiohttp.ClientSession,
    url: str,
    length: int,
    parked: bool,
    slot_tokens: int,
) -> Trial:
    gateway.park = store if parked else None
    await gateway._erase(1)  # her next slot starts clean, as a freed slot is
    await gateway._erase(0)  # and so does her first (Ann held it last)
    gateway.set_table(granted(0, slot_tokens))
    await ask(http, url, context(length))
    since = f"r-{length}-{parked}-{time.time()}"
    started = time.monotonic()
    gateway.set_table(reclaiming(0, slot_tokens, since))
    while not any(r.grant_since == since for r in gateway.releases()):
        await asyncio.sleep(0.001)
    released_at = time.monotonic()
    reclaim = released_at - started

    async def behind() -> float:
        """How long the save and the erase ran behind the release, as the gateway saw them."""
        while gateway._parking:
            await asyncio.sleep(0.001)
        return time.monotonic() - released_at

    watching = asyncio.create_task(behind())
    reclaimed = reclaiming(0, slot_tokens, since)
    gateway.set_table(
        GrantTable(
            slot_tokens, entries={**reclaimed.entries, **ann_granted(0, slot_tokens).entries}
        )
    )
    next_holder, ann = await ask(http, url, context(NEW_TOKENS), ANN)
    ann_timings = ann.get("timings") or {}
    ann_ms = float(ann_timings.get("prompt_ms") or 0) + float(ann_timings.get("predicted_ms") or 0)
    behind_seconds = await watching  # the save and erase behind the release have ended
    gateway.set_table(granted(1, slot_tokens, ann_granted(0, slot_tokens)))
    seconds, reply = await ask(http, url, context(length) + context(NEW_TOKENS))
    timings = reply.get("timings") or {}
    resumed = (reply.get("continuum") or {}).get("resumed") or {}
    return Trial(
        length,
        parked,
        reclaim,
        next_holder,
        seconds,
        int(timings.get("prompt_n") or 0),
        int(timings.get("cache_n") or 0),
        int(resumed.get("restoredTokens") or 0),
        behind_seconds=behind_seconds,
        next_holder_llama_ms=ann_ms,
    )


async def run(upstream: str, park_dir: Path, lengths: list[int], slot_tokens: int) -> list[Trial]:
    gateway = Gateway(GatewaySettings(upstream=upstream, health_seconds=0.5))
    settings = ParkSettings(park_dir, 8 * 2**30, "bench", bytes_per_token=KV_BYTES_PER_TOKEN * 1.1)
    saves: list[float] = []

    async def post(path: str, body: Any) -> tuple[int, Any]:
        """llama-server's slot actions, the saves' own times noted."""
        status, payload = await gateway._post_json(path, body)
        if "action=save" in path and isinstance(payload, dict):
            saves.append(float((payload.get("timings") or {}).get("save_ms") or 0.0))
        return status, payload

    store = ParkStore(settings, post, gateway.metrics)
    store.load()
    await gateway.start()
    for _ in range(1200):
        if gateway.engine_ready:
            break
        await asyncio.sleep(0.1)
        await gateway.probe()
    runner, address = await serve_app(gateway.app(), "127.0.0.1", 0)
    url = f"http://{address}"
    trials = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            for length in lengths:
                for parked in (True, False):
                    saves.clear()
                    t = await trial(gateway, store, http, url, length, parked, slot_tokens)
                    t = replace(t, save_ms=sum(saves))
                    trials.append(t)
                    print(
                        f"  {length:>6} tokens {'parked' if parked else 'erased'}: first token "
                        f"{t.first_token_seconds:.3f} s, reclaim {t.reclaim_seconds * 1000:.1f} "
                        f"ms, next holder's first token {t.next_holder_seconds * 1000:.1f} ms "
                        f"({t.next_holder_llama_ms:.1f} ms in llama-server)",
                        flush=True,
                    )
    finally:
        await runner.cleanup()
        await gateway.close()
    return trials


def report(trials: list[Trial]) -> None:
    print()
    print("| context | parked: first token | evaluated / reused | erased: first token | "
          "evaluated / reused | erased / parked | reclaim parked | reclaim erased | "
          "save (llama-server) | save + erase (gateway) | next holder parked | "
          "next holder erased |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for length in sorted({t.length for t in trials}):
        p = next(t for t in trials if t.length == length and t.parked)
        e = next(t for t in trials if t.length == length and not t.parked)
        print(
            f"| {length} | {p.first_token_seconds:.3f} s | {p.evaluated} / {p.reused} "
            f"(restored {p.restored}) | {e.first_token_seconds:.3f} s | {e.evaluated} / "
            f"{e.reused} | {e.first_token_seconds / p.first_token_seconds:.1f}x | "
            f"{p.reclaim_seconds * 1000:.1f} ms | {e.reclaim_seconds * 1000:.1f} ms | "
            f"{p.save_ms:.1f} ms | {p.behind_seconds * 1000:.1f} ms | "
            f"{p.next_holder_seconds * 1000:.1f} ms | "
            f"{e.next_holder_seconds * 1000:.1f} ms |"
        )
    for what, key in (("reclaim to slot released", "reclaim_seconds"),
                      ("next holder's first token", "next_holder_seconds")):  # fmt: skip
        parked = [getattr(t, key) * 1000 for t in trials if t.parked]
        erased = [getattr(t, key) * 1000 for t in trials if not t.parked]
        print(
            f"{what}, median: parked {statistics.median(parked):.1f} ms, "
            f"erased {statistics.median(erased):.1f} ms"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    args = p.parse_args(argv)
    found = subprocess.run([str(ROOT / "tools" / "llama"), "path"], capture_output=True, text=True)
    if found.returncode != 0:
        print("llama-server is not built: run `make toolchain`", file=sys.stderr)
        return 2
    slot_tokens = max(args.lengths) + 4 * NEW_TOKENS + 64
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_gguf(Path(tmp) / "park-bench.gguf", SHAPE, seed=0)
        park_dir = Path(tmp) / "park"
        park_dir.mkdir()
        port = _free_port()
        llama = subprocess.Popen(
            [found.stdout.strip(), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
             "-c", str(2 * slot_tokens), "--parallel", "2", "-t", str(args.threads),
             "--slots", "--slot-save-path", str(park_dir), "--cache-ram", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        print(f"model {model.stat().st_size / 2**20:.1f} MiB, {SHAPE}", flush=True)
        try:
            trials = asyncio.run(
                run(f"http://127.0.0.1:{port}", park_dir, args.lengths, slot_tokens)
            )
        finally:
            llama.terminate()
            llama.wait(timeout=20)
    report(trials)
    return 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


if __name__ == "__main__":
    sys.exit(main())
