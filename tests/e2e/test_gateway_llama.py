"""The grant gateway and the engine runtime with the real llama-server, on a generated model.

Each test runs `EngineRuntime` (llama-server started and watched, its load turned into a
receipt) with the gateway in front, serves a grant table as the operator would, and talks to
the gateway over HTTP as minds do: granted minds get completions on their slots; others get
the protocol's refusals; a reclaim cuts a long generation, erases the slot and reports the
release without the mind's help; and the seed deadlock, replayed through the real allocator,
the turn client and llama-server relaunches, does not hang.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from continuum_operator.core.grants import (
    Capacity,
    EnginePhase,
    Grant,
    MindDemand,
    allocate,
)
from continuum_operator.engine.admission import GrantTable, TableEntry
from continuum_operator.engine.turn import MIND_HEADER, TURN_HEADER, TurnCut, turn
from continuum_operator.gguf import file_sha256
from tests.support.gateway_llama import (
    CTX,
    SLOT_TOKENS,
    SLOTS,
    Engine,
    granted,
    model,
    queued,
    reclaiming,
    run_engine,
    table,
)
from tests.support.llama_server import TinyModel
from tests.support.local_http import free_port

pytestmark = pytest.mark.e2e

__all__ = ["model"]  # a fixture, used by name

MIRA, ANN, VIP = "minds/mira", "minds/ann", "minds/vip"
# Never stop at an end-of-sequence token: a generation runs as long as it is allowed.
LONG = {"n_predict": 6000, "ignore_eos": True, "temperature": 0.0}
# One turn of the seed replay: a generation of a second or two, long enough to be interrupted.
TURN = {**LONG, "n_predict": 1500}


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_a_granted_mind_gets_completions_on_her_slot_and_the_load_is_receipted(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    async def body(e: Engine) -> None:
        status, opened = await e.open(MIRA)
        assert (status, opened["slot"], opened["tokens"]) == (201, 1, SLOT_TOKENS)
        prompt = {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0.0, "id_slot": 0}
        status, reply = await e.complete(MIRA, opened["turn"], prompt)
        assert status == 200, reply
        assert reply["id_slot"] == 1  # her slot, whatever she asked for
        assert 1 <= reply["tokens_predicted"] <= 4
        slots = await e.slots()
        assert slots[1]["id_task"] >= 0 and slots[1]["n_prompt_tokens"] > 0
        assert "id_task" not in slots[0]  # nobody used slot 0
        # the same prompt again reuses her slot's cache: the cache is per slot, and hers
        status, again = await e.complete(MIRA, opened["turn"], prompt)
        assert again["timings"]["cache_n"] > 0

    doc = run_engine(llama_server_bin, model, tmp_path, table(granted(MIRA, 1)), body)
    assert doc["ready"] is True and (doc["slots"], doc["slotTokens"]) == (SLOTS, SLOT_TOKENS)
    [receipt] = doc["receipts"]
    assert receipt["contextTokens"] == CTX and receipt["parallel"] == SLOTS
    kv = [b for b in receipt["buffers"] if b["kind"] == "kv"]
    # 2 (K and V) x 4 layers x 2 KV heads x 32 head size x 2 bytes per cell
    assert sum(b["bytes"] for b in kv) == 2 * 4 * 2 * 32 * 2 * CTX
    assert doc["layersOffloaded"] == 0 and doc["gpuOffload"] in (False, None)


def test_minds_without_a_grant_are_told_why_and_never_reach_llama_server(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    async def body(e: Engine) -> None:
        status, answer = await e.open(ANN)
        assert (status, answer["error"], answer["reason"], answer["position"]) == (
            429,
            "queued",
            "PoolFull",
            1,
        )
        status, answer = await e.open("elsewhere/stranger")
        assert (status, answer["error"]) == (403, "forbidden")
        status, answer = await e.complete(ANN, "t-guessed", {"prompt": "let me in"})
        assert (status, answer["error"]) == (429, "queued")
        assert all("id_task" not in s for s in await e.slots())

    run_engine(llama_server_bin, model, tmp_path, table(granted(MIRA, 0), queued(ANN)), body)


def test_a_mind_over_her_tokens_is_cut_off_with_a_clear_answer(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    async def body(e: Engine) -> None:
        _, opened = await e.open(MIRA)
        status, reply = await e.complete(
            MIRA, opened["turn"], {"prompt": "Once upon a time", **LONG}
        )
        assert status == 200, reply
        note = reply["continuum"]
        assert note["capped"] is True and note["cutOff"] == "GrantTokens"
        assert note["nPredictAsked"] == LONG["n_predict"]
        assert reply["tokens_evaluated"] + reply["tokens_predicted"] == 64
        assert "64" in note["message"]
        status, reply = await e.complete(MIRA, opened["turn"], {"prompt": "word " * 80})
        assert (status, reply["error"], reply["grantTokens"]) == (413, "over_grant", 64)

    run_engine(llama_server_bin, model, tmp_path, table(granted(MIRA, 0, tokens=64)), body)


def test_a_reclaim_ends_a_long_generation_erases_the_slot_and_reports_the_release(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    async def body(e: Engine) -> None:
        _, opened = await e.open(MIRA)
        prompt = {"prompt": "The engine holds a pool of memory", **LONG}
        call = asyncio.create_task(e.complete(MIRA, opened["turn"], prompt))
        await until(lambda: e.processing(0))
        await asyncio.sleep(0.3)  # well into the generation
        reclaimed = time.monotonic()
        e.gateway.set_table(
            table(reclaiming(MIRA, 0, grace=10.0), queued(VIP, "WaitingForReclaim"))
        )
        status, reply = await call
        assert (status, reply["error"], reply["reason"], reply["by"]) == (
            409,
            "turn_cut",
            "Preempted",
            VIP,
        )
        # Ended at once: seconds on a loaded machine, and well inside the grace deadline.
        assert time.monotonic() - reclaimed < 5.0
        await until(lambda: _async(bool(e.gateway.releases())), timeout=10)
        assert time.monotonic() - reclaimed < 10.0  # released within the grace deadline
        [release] = e.gateway.releases()
        assert (release.mind, release.slot) == (MIRA, 0)
        # the slot held her prompt and part of the generation, not all of it: it was cut
        assert release.erased_tokens is not None and 8 < release.erased_tokens < 6000
        assert not await e.processing(0)  # llama-server dropped the generation
        # the operator hands the slot to the next mind: she starts with an empty cache
        e.gateway.set_table(table(queued(MIRA, "Requeued"), granted(VIP, 0)))
        _, vip = await e.open(VIP)
        status, reply = await e.complete(
            VIP, vip["turn"], {"prompt": prompt["prompt"], "n_predict": 2}
        )
        assert status == 200 and reply["timings"]["cache_n"] == 0
        assert reply["id_slot"] == 0

    doc = run_engine(llama_server_bin, model, tmp_path, table(granted(MIRA, 0)), body)
    assert doc["slotReleases"] == []  # recorded by the operator: it left the report


def test_a_mind_that_ignores_her_reclaim_is_cut_off_without_her(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    """She holds her stream open, reads nothing and keeps asking; the gateway ends it, erases
    her slot and reports it released before the grace deadline, whatever she does."""

    async def body(e: Engine) -> None:
        _, opened = await e.open(MIRA)
        resp = await e.http.post(
            f"{e.url}/completion",
            json={"prompt": "Never stop", **LONG, "stream": True},
            headers={MIND_HEADER: MIRA, TURN_HEADER: opened["turn"]},
        )
        try:
            assert resp.status == 200
            await until(lambda: e.processing(0))
            grace = 5.0
            e.gateway.set_table(table(reclaiming(MIRA, 0, grace=grace, reason="EngineShrunk")))
            started = time.monotonic()
            # she keeps asking, and is refused each time
            for _ in range(3):
                status, answer = await e.complete(MIRA, opened["turn"], {"prompt": "more"})
                assert (status, answer["error"]) == (409, "turn_cut")
                status, answer = await e.open(MIRA)
                assert (status, answer["error"]) == (409, "reclaiming")
            await until(lambda: _async(bool(e.gateway.releases())), timeout=grace)
            assert time.monotonic() - started < grace
            assert not await e.processing(0)
            # what she finds when she finally reads: her stream, ended with the cut
            raw = await asyncio.wait_for(resp.content.read(), 5)
        finally:
            resp.release()
        events = [json.loads(x[6:]) for x in raw.splitlines() if x.startswith(b"data: ")]
        assert events[-1] == {"error": {"type": "turn_cut", "reason": "EngineShrunk"}}

    run_engine(llama_server_bin, model, tmp_path, table(granted(MIRA, 0)), body)


async def _async(value: bool) -> bool:
    return value


def test_the_seed_deadlock_replayed_end_to_end_does_not_hang(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    """docs/design.md's measured failures: one mind, one slot, the engine relaunched in her turns.

    The operator is played by the real allocator (`core.grants.allocate`) fed with the
    releases the gateway reports; the relaunch really restarts llama-server; the mind uses the
    turn client with the seed's 1,500 s turn deadline. Her turns are cut at once, the reclaims
    proceed without her, and she is regranted after each relaunch: no wait reaches a deadline.
    """
    mira = MindDemand(MIRA, priority=0, arrival=0.0, context_tokens=SLOT_TOKENS)

    async def body(e: Engine) -> None:
        grants: dict[str, Grant] = {}
        phase = EnginePhase.SERVING
        relaunches_left = 2
        stop = asyncio.Event()
        cuts: list[float] = []
        drains: list[float] = []
        turns_done = 0

        def publish() -> None:
            entries = {
                g.mind: TableEntry(
                    g.mind, g.state, str(g.reason), g.slot, g.tokens, g.by, g.deadline, str(g.since)
                )
                for g in grants.values()
            }
            e.gateway.set_table(GrantTable(SLOT_TOKENS, phase, entries))

        async def operator() -> None:
            nonlocal grants, phase, relaunches_left
            while not stop.is_set():
                released = {r.mind for r in e.gateway.releases()}
                capacity = Capacity(phase, 1, SLOT_TOKENS)
                result = allocate(grants, [mira], capacity, time.time(), released=released)
                grants = result.grants
                holders = result.holders()
                if phase is EnginePhase.SERVING and relaunches_left and await e.processing(0):
                    await asyncio.sleep(0.3)  # mid-generation: the engine must relaunch
                    phase, relaunches_left = EnginePhase.DRAINING, relaunches_left - 1
                    drains.append(time.monotonic())
                elif phase is EnginePhase.DRAINING and not holders:
                    phase = EnginePhase.RELAUNCHING
                    assert e.runtime.process is not None
                    e.runtime.process.kill()  # the relaunch
                    await until(lambda: _async(not e.gateway.engine_ready), timeout=10)
                elif (
                    phase is EnginePhase.RELAUNCHING
                    and e.runtime.phase == "Serving"
                    and e.gateway.engine_ready
                ):
                    phase = EnginePhase.SERVING
                publish()
                await asyncio.sleep(0.05)

        async def mind() -> None:
            nonlocal turns_done
            while turns_done < 3:
                try:
                    async with turn(
                        e.url, MIRA, deadline_seconds=1500, poll_seconds=0.1, session=e.http
                    ) as t:
                        try:
                            await t.complete({"prompt": "Think about the next step", **TURN})
                        except TurnCut:
                            cuts.append(time.monotonic())  # cut mid-generation
                            raise
                        turns_done += 1
                except TurnCut:
                    # Her turn is over (cut, or her grant still being reclaimed when she came
                    # back): she thinks a moment, then asks for her next turn.
                    await asyncio.sleep(0.2)

        op = asyncio.create_task(operator())
        await until(lambda: _async(bool(e.gateway.table and e.gateway.table.entry(MIRA))))
        started = time.monotonic()
        try:
            await asyncio.wait_for(mind(), 240)
        finally:
            stop.set()
            await op
        assert len(cuts) == len(drains) == 2, "each relaunch should have cut her turn"
        # each turn ended at once, not at the end of its generation or of any deadline
        # (seconds on a loaded machine; the allocator's grace deadline is 30 s)
        assert all(0 <= c - d < 5.0 for d, c in zip(drains, cuts, strict=True)), (drains, cuts)
        assert relaunches_left == 0 and e.runtime.restarts == 2
        assert time.monotonic() - started < 240  # nowhere near the 1,500 s deadline

    run_engine(
        llama_server_bin, model, tmp_path, GrantTable(SLOT_TOKENS, EnginePhase.SERVING), body
    )


def test_continuum_engine_runs_the_plans_arguments_and_writes_its_status(
    llama_server_bin: Path, model: TinyModel, tmp_path: Path
) -> None:
    """The command an engine pod runs, with the arguments a plan gives (`engineArgs`)."""
    import subprocess
    import sys

    from tests.support.local_http import http_json

    grants = tmp_path / "grants.yaml"
    grants.write_text(
        f"slotTokens: {SLOT_TOKENS}\ngrants:\n"
        f"- {{mind: {MIRA}, state: Granted, slot: 1, tokens: {SLOT_TOKENS}}}\n"
    )
    status = tmp_path / "runtime.json"
    port = free_port()
    plan_args = [
        "--n-gpu-layers", "0", "--ctx-size", str(CTX), "--parallel", str(SLOTS),
        "--cache-type-k", "f16", "--cache-type-v", "f16", "--flash-attn", "on", "-t", "2",
    ]  # fmt: skip
    argv = [
        sys.executable, "-m", "continuum_operator.cli", "engine", "--model", str(model.path),
        "--grants", str(grants), "--port", str(port), "--llama-server", str(llama_server_bin),
        "--status-file", str(status), "--unsafe-trust-mind-header", "--", *plan_args,
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with (tmp_path / "engine.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    ready = http_json(f"{url}/readyz", timeout=2)[0] == 200
                except OSError:
                    ready = False
                written = json.loads(status.read_text()) if status.exists() else {}
                if ready and written.get("phase") == "Serving":
                    break
                assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "continuum engine never became ready"
                time.sleep(0.2)
            doc = json.loads(status.read_text())
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert proc.returncode == 0
    assert doc["phase"] == "Serving" and (doc["slots"], doc["slotTokens"]) == (SLOTS, SLOT_TOKENS)
    [receipt] = doc["receipts"]
    assert receipt["modelSha256"] == file_sha256(model.path)  # hashed from the file
    assert receipt["flashAttention"] is True and receipt["parallel"] == SLOTS
    assert receipt["placement"] == {"layersOnDevice": 0, "gpus": 0}
