"""The engine runtime's Kubernetes shell on the real API server: the grant table read from the
Engine's GrantLedger by a watch, and the Engine's `status.runtime` written by its one writer.
The test's admin stands in for the operator: it makes the GrantLedger and writes its status."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator import yaml_text
from continuum_operator.engine import grants_source
from continuum_operator.engine.admission import GrantTable
from continuum_operator.engine.gateway import SlotRelease
from continuum_operator.engine.grants_source import EngineStatusWriter, watch_ledger
from continuum_operator.kube.client.async_api import AsyncKubeApi
from continuum_operator.kube.ledger import cached
from continuum_operator.model.mind import GrantState
from tests.support.cluster import Cluster
from tests.support.waiting import until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def _engine(namespace: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "examples/engines/coder-8b.yaml").read_text())
    doc["metadata"]["namespace"] = namespace
    return doc


def _install_crds(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s",
        "crd/engines.continuum.dev", "crd/grantledgers.continuum.dev",
    )  # fmt: skip


def _make_ledger(cluster: Cluster, namespace: str) -> None:
    """The Engine's GrantLedger as the operator makes it at its first grant step: named as the
    Engine, owned by it, no status yet."""
    engine = cluster.get_json("engine", "coder-8b", "-n", namespace)
    cluster.apply(cached.new_ledger(engine))


def _write_ledger(
    cluster: Cluster, namespace: str, grants: list[dict[str, Any]], tokens_per_slot: int = 32768
) -> None:
    """The ledger's status, through its status subresource, with the pool it was made for."""
    capacity = {"phase": "Serving", "slots": 2, "tokensPerSlot": tokens_per_slot}
    cluster.kubectl(
        "patch", "grantledger", "coder-8b", "-n", namespace, "--subresource=status",
        "--type=merge", "-p", json.dumps({"status": {"grants": grants, "grantCapacity": capacity}}),
    )  # fmt: skip


def test_the_engine_shell_watches_its_ledger_and_writes_only_status_runtime(
    cluster: Cluster, namespace: str, caplog: pytest.LogCaptureFixture
) -> None:
    _install_crds(cluster)
    cluster.apply(_engine(namespace))
    granted = {"mind": f"{namespace}/mira", "state": "Granted", "slot": 0, "tokens": 16384}
    tables: list[GrantTable | None] = []

    def last() -> GrantTable:
        table = tables[-1]
        assert table is not None
        return table

    async def main() -> None:
        objects = await AsyncKubeApi.connect(str(cluster.kubeconfig))
        watcher = asyncio.create_task(
            watch_ledger(namespace, "coder-8b", tables.append, api=objects)
        )
        try:
            # Before the operator's first step there is no ledger, then one with no status:
            # the watch waits (no table: every turn refused) until the ledger is written.
            await asyncio.sleep(2.5)
            await asyncio.to_thread(_make_ledger, cluster, namespace)
            await asyncio.sleep(1.5)
            assert tables == []
            await asyncio.to_thread(_write_ledger, cluster, namespace, [granted], 16384)
            await until(lambda: bool(tables), timeout=30.0)
            # the slot size of the launch the ledger was made for, not the Engine's spec's
            assert last().slot_tokens == 16384
            entry = last().entry(f"{namespace}/mira")
            assert entry is not None and entry.state is GrantState.GRANTED
            reclaim = {
                **granted,
                "state": "Reclaiming",
                "reason": "Preempted",
                "by": f"{namespace}/vip",
                "deadline": "2026-12-03T07:00:00Z",
                "since": "2026-12-03T06:59:30Z",
            }
            await asyncio.to_thread(_write_ledger, cluster, namespace, [reclaim], 16384)
            await until(
                lambda: (
                    (e := last().entry(f"{namespace}/mira")) is not None
                    and e.state is GrantState.RECLAIMING
                ),
                timeout=30.0,
            )
            writer = EngineStatusWriter(namespace, "coder-8b", api=objects)
            runtime = {
                "phase": "Serving",
                "slotReleases": [
                    SlotRelease(
                        f"{namespace}/mira", 0, "Preempted", str(reclaim["since"]), 0.0, 0
                    ).to_status()
                ],
            }
            await writer.write(runtime)
            await writer.write(runtime)  # unchanged: no second write
            ledger = cluster.get_json("grantledger", "coder-8b", "-n", namespace)["status"]
            assert ledger["grants"][0]["state"] == "Reclaiming"  # the operator's, untouched
            # The ledger deleted by hand: its grants are withdrawn, not enforced as if held.
            await asyncio.to_thread(
                cluster.kubectl, "delete", "grantledger", "coder-8b", "-n", namespace
            )
            await until(lambda: tables[-1] is None, timeout=30.0)
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await objects.close()

    with caplog.at_level(logging.INFO, logger=grants_source.log.name):
        asyncio.run(main())
    # Each wait told once, at INFO: a pod started before its ledger is not an error each second.
    told = [r for r in caplog.records if r.name == grants_source.log.name]
    assert [r.levelno for r in told] == [logging.INFO] * 3, [r.getMessage() for r in told]
    assert told[0].getMessage().startswith(f"no GrantLedger {namespace}/coder-8b yet")
    assert told[2].getMessage().startswith(f"GrantLedger {namespace}/coder-8b deleted")
    status = cluster.get_json("engine", "coder-8b", "-n", namespace)["status"]
    assert status["runtime"]["slotReleases"][0]["mind"] == f"{namespace}/mira"
    assert "grants" not in status  # the ledger is an object of its own


def test_a_minds_token_is_reviewed_with_the_engines_audience_and_speaks_for_her_only(
    cluster: Cluster, namespace: str
) -> None:
    """Real TokenReviews: her projected token with the engine's audience is her; a token
    without that audience (a service account's ordinary token) is nobody (401); another
    service account's token of her namespace, a child's say, is not her (403). The official
    OpenAI client sends the token as its API key."""
    import openai
    from aiohttp import ClientSession

    from continuum_operator.core.grants import EnginePhase
    from continuum_operator.door.serving import serve_app
    from continuum_operator.door.token_review import TokenReviewer
    from continuum_operator.engine.admission import ServiceAccount, TableEntry, engine_audience
    from continuum_operator.engine.gateway import Gateway, GatewaySettings
    from continuum_operator.engine.turn import MIND_HEADER, turn
    from tests.support.fake_llama import FakeLlama, serve

    audience = engine_audience(namespace, "coder-8b")
    for account in ("mira", "mira-child"):
        cluster.kubectl("create", "serviceaccount", account, "-n", namespace)

    def token(account: str, *audiences: str) -> str:
        flags = [f"--audience={a}" for a in audiences]
        return str(cluster.kubectl("create", "token", account, "-n", namespace, *flags).stdout)

    mine = token("mira", audience).strip()
    plain = token("mira").strip()  # the API server's audience only
    other_engine = token("mira", engine_audience(namespace, "other")).strip()
    child = token("mira-child", audience).strip()
    reviewer = TokenReviewer(audience, kubeconfig=str(cluster.kubeconfig))
    mira, child_mind = f"{namespace}/mira", f"{namespace}/mira-child"
    entries = {
        m: TableEntry(m, GrantState.GRANTED, "SlotFree", slot=i, tokens=512)
        for i, m in enumerate((mira, "elsewhere/mind"))
    }

    async def main() -> None:
        assert await reviewer(mine) == ServiceAccount(namespace, "mira")
        assert await reviewer(plain) is None
        assert await reviewer(other_engine) is None
        assert await reviewer("not-a-token") is None
        upstream_runner, upstream = await serve(FakeLlama().app())
        gateway = Gateway(GatewaySettings(upstream=upstream, review_token=reviewer))
        await gateway.start()
        gateway.set_table(GrantTable(512, EnginePhase.SERVING, entries))
        runner, address = await serve_app(gateway.app(), "127.0.0.1", 0)
        url = f"http://{address}"
        try:
            async with ClientSession() as http:

                async def open_turn(mind: str, bearer: str | None) -> int:
                    headers = {MIND_HEADER: mind}
                    if bearer is not None:
                        headers["Authorization"] = f"Bearer {bearer}"
                    async with http.post(f"{url}/v1/turns", json={}, headers=headers) as resp:
                        return resp.status

                assert await open_turn(mira, mine) == 201
                assert await open_turn(mira, None) == 401
                assert await open_turn(mira, plain) == 401
                assert await open_turn(mira, "forged") == 401
                assert await open_turn("elsewhere/mind", mine) == 403  # her token, another's name
                assert await open_turn(mira, child) == 403  # her child's token
                # the turn client carries the token through the whole turn
                async with turn(url, mira, token=mine, session=http) as t:
                    reply = await t.complete({"prompt": "hi", "n_predict": 2})
                    assert reply["tokens_predicted"] == 2

            def agent(key: str, mind: str | None = None) -> openai.AsyncOpenAI:
                headers = {MIND_HEADER: mind} if mind else None
                return openai.AsyncOpenAI(
                    base_url=f"{url}/v1", api_key=key, default_headers=headers, max_retries=0
                )

            hello: Any = [{"role": "user", "content": "hi"}]
            async with agent(mine) as ok:
                done = await ok.chat.completions.create(model="m", messages=hello, max_tokens=1)
                assert done.model_extra is not None and done.model_extra["continuum"]["slot"] == 0
            async with agent(plain) as nobody:
                with pytest.raises(openai.AuthenticationError):
                    await nobody.chat.completions.create(model="m", messages=hello)
            async with agent(child, mira) as impostor:
                with pytest.raises(openai.PermissionDeniedError):
                    await impostor.chat.completions.create(model="m", messages=hello)
            async with agent(child) as herself:  # the child as herself: not in the table
                with pytest.raises(openai.PermissionDeniedError) as caught:
                    await herself.chat.completions.create(model="m", messages=hello)
                assert child_mind in caught.value.message
        finally:
            await runner.cleanup()
            await gateway.close()
            await upstream_runner.cleanup()
            await reviewer.close()

    asyncio.run(main())


def test_an_engine_runtime_serves_the_engines_grants_and_reports_into_its_status(
    cluster: Cluster, namespace: str, llama_server_bin: Path, tiny_model: Any, tmp_path: Path
) -> None:
    """`continuum engine --engine NS/NAME` with the real llama-server and the real API server:
    the operator's grants (its GrantLedger's, written here by hand) decide who is served, and
    the reclaim's release lands in the Engine's status.runtime, beside the receipt of the
    load."""
    import subprocess
    import sys

    from tests.support.local_http import free_port, http_json

    _install_crds(cluster)
    cluster.apply(_engine(namespace))
    from continuum_operator.engine.admission import engine_audience

    mira = f"{namespace}/mira"
    granted = {"mind": mira, "state": "Granted", "slot": 0, "tokens": 32768, "since": "t0"}
    _make_ledger(cluster, namespace)
    _write_ledger(cluster, namespace, [granted])
    # Review is on by default: her projected token, with this engine's audience.
    cluster.kubectl("create", "serviceaccount", "mira", "-n", namespace)
    token = cluster.kubectl(
        "create", "token", "mira", "-n", namespace,
        f"--audience={engine_audience(namespace, 'coder-8b')}",
    ).stdout.strip()  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable, "-m", "continuum_operator.cli", "engine",
        "--engine", f"{namespace}/coder-8b", "--model", str(tiny_model.path),
        "--listen", f"127.0.0.1:{port}", "--llama-server", str(llama_server_bin),
        "--", "-c", "2048", "--parallel", "2", "-t", "2",
    ]  # fmt: skip

    def runtime_status() -> dict[str, Any]:
        engine = cluster.get_json("engine", "coder-8b", "-n", namespace)
        return dict(engine.get("status", {}).get("runtime") or {})

    def wait(check: Any, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            assert time.monotonic() < deadline, what
            time.sleep(0.2)

    def post(path: str, body: dict[str, Any], **headers: str) -> tuple[int, Any]:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(
            url + path, data=json.dumps(body).encode(), method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            with err:
                return err.code, json.loads(err.read())

    with (tmp_path / "engine.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, env=cluster.env)
        try:
            wait(lambda: runtime_status().get("phase") == "Serving", "status.runtime never Serving")
            assert http_json(f"{url}/readyz")[0] == 200
            assert post("/v1/turns", {}, **{"X-Continuum-Mind": mira})[0] == 401  # no token
            mind = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
            code, opened = post("/v1/turns", {}, **mind)
            assert (code, opened["slot"]) == (201, 0)
            code, reply = post(
                "/completion",
                {"prompt": "Once upon a time", "n_predict": 4},
                **mind,
                **{"X-Continuum-Turn": opened["turn"]},
            )
            assert (code, reply["id_slot"]) == (200, 0)
            reclaim = {**granted, "state": "Reclaiming", "reason": "Preempted", "since": "t1"}
            _write_ledger(cluster, namespace, [reclaim])
            wait(lambda: bool(runtime_status().get("slotReleases")), "no release reported")
            assert post("/v1/turns", {}, **mind)[0] == 409
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    runtime = runtime_status()
    [release] = runtime["slotReleases"]
    assert (release["mind"], release["slot"], release["reason"], release["grantSince"]) == (
        mira,
        0,
        "Preempted",
        "t1",
    )
    assert release["erasedTokens"] > 0
    [receipt] = runtime["receipts"]
    assert receipt["contextTokens"] == 2048 and receipt["parallel"] == 2
    assert runtime["slots"] == 2 and runtime["layersOffloaded"] == 0
    grants = cluster.get_json("grantledger", "coder-8b", "-n", namespace)["status"]["grants"]
    assert grants[0]["state"] == "Reclaiming"  # the operator's, untouched


def test_the_engines_identity_and_network_policy_are_accepted_and_let_it_review_tokens(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """What the operator applies for an engine, applied to the real API server: its
    ServiceAccount may create TokenReviews (through system:auth-delegator) and nothing of the
    kind before; it may read its own GrantLedger and write no ledger (RBAC is the ledger's
    guard: the operator writes it alone); the NetworkPolicy is a valid one admitting the
    namespaces it names."""
    from continuum_operator.kube.base.settings import PodSettings
    from continuum_operator.kube.workloads import engine_identity, engine_objects
    from continuum_operator.model.engine import Engine

    doc = _engine(namespace)
    doc["spec"]["allowedNamespaces"] = ["team-b"]
    engine = Engine.model_validate(doc)
    account = engine_objects.service_account_name(engine)
    who = f"--as=system:serviceaccount:{namespace}:{account}"

    def can_review() -> str:
        found = cluster.kubectl("auth", "can-i", "create", "tokenreviews", who, check=False)
        return str(found.stdout).strip()

    def can(verb: str, what: str, *flags: str) -> str:
        found = cluster.kubectl(
            "auth", "can-i", verb, what, who, "-n", namespace, *flags, check=False
        )
        return str(found.stdout).strip()

    own = f"grantledgers.continuum.dev/{engine.metadata.name}"

    assert can_review() == "no"
    built = [
        *engine_identity.engine_rbac(engine, "uid"),
        engine_identity.network_policy(engine, "uid", PodSettings()),
    ]
    for obj in built:  # no Engine here to own them: the garbage collector would take them
        obj["metadata"].pop("ownerReferences", None)
    path = tmp_path / "identity.yaml"
    path.write_text(yaml_text.dump_all(built))
    cluster.kubectl("apply", "--server-side", "--field-manager=e2e", "-f", str(path))
    try:
        assert can_review() == "yes"
        for verb in ("get", "list", "watch"):
            assert can(verb, own) == "yes", verb
        assert can("get", "grantledgers.continuum.dev/other") == "no"
        for verb in ("create", "update", "patch", "delete"):
            assert can(verb, own) == "no", verb
        for verb in ("update", "patch"):
            assert can(verb, own, "--subresource=status") == "no", verb
        policy = cluster.get_json("networkpolicy", engine.metadata.name, "-n", namespace)
        [expr] = policy["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchExpressions"]
        assert expr["values"] == sorted([namespace, "team-b"])
    finally:
        binding = engine_identity.token_review_binding_name(engine)
        cluster.kubectl("delete", "clusterrolebinding", binding, "--ignore-not-found")
