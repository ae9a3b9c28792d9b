"""An embed lane's /metrics: requests served, inputs and tokens embedded, the largest context,
refusals by reason, scraped over HTTP from a lane runtime (a stand-in model: llama.cpp itself
is exercised by tests/e2e/test_embed_llama.py, which scrapes the real process too)."""

from __future__ import annotations

import asyncio
import urllib.request

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from continuum_operator.embed import runtime as lane_runtime
from continuum_operator.embed.runtime import LaneRuntime, LaneState
from tests.support.embed import WordModel


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_lane_serves_what_it_embedded_and_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lane_runtime, "gpu_offload_supported", lambda: False)
    monkeypatch.setattr(lane_runtime, "llama_build", lambda: "test")

    async def scenario() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        rt = LaneRuntime(
            WordModel(),  # type: ignore[arg-type]
            LaneState(max_context_tokens=1024, leased_context_tokens=512),
        )
        code, _ = await rt.embed(["too early"])
        assert code == 503  # calibrating
        await rt.calibrate()
        assert (await rt.embed(["a b c", "d e"]))[0] == 200  # 4 + 3 tokens
        assert (await rt.embed([" ".join(["w"] * 299)]))[0] == 200  # 300 tokens: 512 cells
        assert (await rt.embed([" ".join(["w"] * 600)]))[0] == 503  # above the lease
        assert (await rt.embed([" ".join(["w"] * 2000)]))[0] == 413  # above the maximum
        runner = web.AppRunner(rt.admin_app())  # /metrics: the admin port, never callers'
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            return await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
        finally:
            await runner.cleanup()

    got = asyncio.run(scenario())
    assert got[("continuum_lane_requests_served_total", ())] == 2
    assert got[("continuum_lane_inputs_embedded_total", ())] == 3
    assert got[("continuum_lane_tokens_embedded_total", ())] == 4 + 3 + 300
    assert got[("continuum_lane_largest_context_tokens", ())] == 300
    assert got[("continuum_lane_context_tokens", ())] == 512
    assert got[("continuum_lane_leased_context_tokens", ())] == 512
    assert got[("continuum_lane_requests_waited_total", ())] == 0
    refusals = {
        dict(k[1])["reason"]: v for k, v in got.items() if k[0] == "continuum_lane_refusals_total"
    }
    assert refusals == {"Calibrating": 1, "PoolBusy": 1, "ContextTooLarge": 1, "NotPlaced": 0}
