"""A request's cost to the engine's shared loop, at the gateway: a shape over its bound is
refused with the field named before llama-server sees it (`engine.request_cost`), on the native
and OpenAI endpoints alike. The stall itself, against the real llama-server, is
tests/e2e/test_gateway_llama.py's."""

from __future__ import annotations

from continuum_operator.engine.request_cost import DEFAULT_BOUNDS
from tests.unit.test_gateway_openai import Rig, granted, run, table

STALL = "root ::= (" + "|".join(['"a"'] * 50) + ")*"


def test_a_grammar_that_would_stall_every_slot_is_refused_before_llama_server() -> None:
    async def body(rig: Rig) -> None:
        status, payload, _ = await rig.post(
            "/completion", {"prompt": "hi", "grammar": STALL, "ignore_eos": True}
        )
        assert status == 400
        assert "grammar" in payload["message"] and "alternatives" in payload["message"]
        chat = {"messages": [{"role": "user", "content": "hi"}], "grammar": STALL}
        status, payload, headers = await rig.post("/v1/chat/completions", chat)
        assert status == 400 and payload["error"]["param"] == "grammar"
        assert headers["x-should-retry"] == "false"
        schema = {"enum": [str(i) for i in range(DEFAULT_BOUNDS.fanout + 1)]}
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        status, payload, _ = await rig.post(
            "/v1/chat/completions", {**chat, "grammar": None, "response_format": fmt}
        )
        assert status == 400 and payload["error"]["param"] == "response_format"
        ok = {"prompt": "hi", "grammar": 'root ::= ("a"|"b")*', "n_predict": 4}
        status, _, _ = await rig.post("/completion", ok)
        assert status == 200
        assert [r.get("grammar") for r in rig.fake.requests] == [ok["grammar"]]

    run(table(granted()), body)
