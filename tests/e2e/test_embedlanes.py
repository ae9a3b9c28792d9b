"""EmbedLanes on the real control plane: `continuum operator` as a subprocess, a KWOK node with
its NodeBoard and the agent's Lease, an Engine and an EmbedLane applied with kubectl. The lane
is placed beside the engine and charged where it resides (docs/design.md rule 6); its bytes are in
the node's ledger, so an engine planned on that node afterwards accounts for them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support import waiting
from tests.support.builders import ROOT
from tests.support.cluster import Cluster
from tests.support.engine_status import facts_read_from_file
from tests.support.kwok_nodes import renew, write_board
from tests.support.operator_process import stop

pytestmark = pytest.mark.e2e

GiB = 2**30
RUN_LABEL = ("continuum.dev/e2e-run", uuid.uuid4().hex[:10])
HOST_CAPACITY = 256 * GiB


@pytest.fixture(scope="module")
def operator(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
    cluster.kubectl(
        "wait", "--for=condition=established", "--timeout=60s", "-f", str(ROOT / "crds")
    )
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    # Only this module's engines: other modules' operators may share the cluster.
    with running_operator(cluster, log, RUN_LABEL, tmp_path_factory.getbasetemp()):
        yield log


@contextmanager
def running_operator(
    cluster: Cluster, log: Path, selector: tuple[str, str], models: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """`continuum operator` of the Engines labelled `selector`, logging to `log`."""
    cmd = [
        sys.executable, "-m", "continuum_operator.cli", "operator",
        "--kubeconfig", str(cluster.kubeconfig), "--resync", "1",
        "--engine-image", "continuum-engine:e2e",
        "--engine-selector", "=".join(selector),
        # The tests' model files are written under pytest's temporary directory.
        "--allowed-host-path-prefix", str(models),
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=cluster.env)
    try:
        time.sleep(1)
        if proc.poll() is not None:
            pytest.fail(f"continuum operator exited at once:\n{log.read_text()}", pytrace=False)
        yield proc
    finally:
        stop(proc)


def node_with_board(cluster: Cluster) -> str:
    """A KWOK node with one GPU, its NodeBoard (nothing measured in use) and a fresh Lease."""
    name = f"lane-{uuid.uuid4().hex[:6]}"
    cluster.create_fake_node(name, capacity={"nvidia.com/gpu": "1", "memory": "256Gi"},
                             labels={"e2e-lane": name})  # fmt: skip
    status = {
        "memoryMode": "discrete",
        "memoryModeReason": "e2e",
        "pools": [
            {"kind": "host", "capacityBytes": HOST_CAPACITY, "usedBytes": 0},
            {"kind": "device", "device": 0, "capacityBytes": 80 * GiB, "usedBytes": 0},
        ],
        "gpus": [{"index": 0, "name": "e2e GPU"}],
    }
    write_board(cluster, name, status)
    renew(cluster, name)
    return name


def engine(name: str, node: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"facts": {"layers": 32, "layerBytes": 232783872, "inputBytes": 532676608,
                            "outputBytes": 532676608, "kvBytesPerTokenPerLayer": 4096,
                            "computeBytes": 268435456, "vocabSize": 32000,
                            "embeddingLength": 4096}},
        "contextTokensPerMind": 8192,
        "minds": {"min": 1, "max": 2},
        "offload": "none",
        "placement": {"nodeSelector": {"e2e-lane": node}},
        **spec,
    }  # fmt: skip
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "Engine",
            "metadata": {"name": name, "labels": dict([RUN_LABEL])}, "spec": body}  # fmt: skip


def wait_for(what: str, probe: Callable[[], Any], log: Path, timeout: float = 90) -> Any:
    """tests/support/waiting.py's poll, its operator log a must and its time a minute and a half."""
    return waiting.wait_for(what, probe, timeout, log)


def get(cluster: Cluster, kind: str, ns: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = cluster.get_json(kind, name, "-n", ns)
    return found


def placed(cluster: Cluster, kind: str, ns: str, name: str) -> Callable[[], Any]:
    def probe() -> Any:
        body = get(cluster, kind, ns, name)
        status = body.get("status") or {}
        if kind == "embedlane":
            ok = (status.get("placement") or {}).get("verdict") == "Fits"
        else:
            ok = bool(status.get("placement")) and bool(status.get("plan"))
        return body if ok else None

    return probe


def pool_bytes(pools: list[dict[str, Any]], pool: str) -> int:
    return sum(int(p["bytes"]) for p in pools if p["pool"] == pool)


def test_an_embed_lane_beside_an_engine_is_placed_and_the_engines_plans_count_its_bytes(
    cluster: Cluster, operator: Path, namespace: str
) -> None:
    node = node_with_board(cluster)
    cluster.apply(engine("coder", node), "-n", namespace)
    coder = wait_for("the engine placed", placed(cluster, "engine", namespace, "coder"), operator)
    assert coder["status"]["placement"]["node"] == node
    assert coder["status"]["plan"]["layersOnDevice"] == 0  # offload none: the host serves it

    cluster.apply(
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
         "metadata": {"name": "notes"},
         "spec": {"engine": "coder", "maxContextTokens": 4096}},
        "-n", namespace,
    )  # fmt: skip
    lane = wait_for("the lane placed", placed(cluster, "embedlane", namespace, "notes"), operator)
    p = lane["status"]["placement"]
    assert p["node"] == node and p["residence"] == "host"
    assert p["residenceReason"] == "EngineOnHost"
    assert p["contextTokens"] == 4096 and p["bytesSource"] == "estimate"
    assert [x["pool"] for x in p["pools"]] == ["host"]  # never the device
    lane_host = pool_bytes(p["pools"], "host")
    assert lane_host > 0
    placed_c = next(c for c in lane["status"]["conditions"] if c["type"] == "Placed")
    assert placed_c["status"] == "True" and placed_c["reason"] == "AtMaxContext"
    wait_for(
        "the lane's Placed event",
        lambda: "AtMaxContext" in cluster.kubectl(
            "get", "events", "-n", namespace, "--field-selector",
            "involvedObject.kind=EmbedLane,involvedObject.name=notes",
        ).stdout,
        operator,
    )  # fmt: skip
    printed = cluster.kubectl("get", "embedlane", "notes", "-n", namespace).stdout
    assert node in printed and "host" in printed

    # The lane runtime reports a larger context than it was leased for: the floor rises with it.
    runtime = {"status": {"runtime": {"largestContextTokens": 3000}}}
    cluster.kubectl("patch", "embedlane", "notes", "-n", namespace, "--subresource=status",
                    "--type=merge", "-p", json.dumps(runtime))  # fmt: skip

    def floor_set() -> Any:
        pools = get(cluster, "embedlane", namespace, "notes")["status"]["placement"]["pools"]
        return pools if pools[0].get("floorBytes", 0) > 0 else None

    pools = wait_for("the lane's floor", floor_set, operator)
    assert 0 < pools[0]["floorBytes"] <= pools[0]["bytes"] == lane_host

    # An engine placed on that node afterwards is planned beside both leases: its host budget
    # is the pool less the first engine's lease, the lane's lease and its own reserve.
    cluster.apply(engine("second", node), "-n", namespace)
    second = wait_for("the second engine placed", placed(cluster, "engine", namespace, "second"),
                      operator)  # fmt: skip
    coder = get(cluster, "engine", namespace, "coder")
    coder_host = pool_bytes(coder["status"]["placement"]["pools"], "host")
    reserve = GiB  # spec.reserveBytes' default
    budget = second["status"]["plan"]["budget"]["host"]
    assert budget == HOST_CAPACITY - coder_host - lane_host - reserve
    assert second["status"]["placement"]["node"] == node


def lane(name: str, engine_name: str, max_context_tokens: int, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
            "metadata": {"name": name, "labels": labels},
            "spec": {"engine": engine_name, "maxContextTokens": max_context_tokens}}  # fmt: skip


def test_a_lane_beside_an_engine_is_decided_by_the_operator_of_that_engine_whatever_its_labels(
    cluster: Cluster,
    operator: Path,
    namespace: str,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Two operators of their own `--engine-selector`: a lane labelled for the second, beside
    an Engine the first serves, is left alone by the second (deciding it too, each wrote its
    status and its pod over the other's at every resync); once the Engine is relabelled to the
    second's selection, the second decides the lane and the first no longer does."""
    other = (RUN_LABEL[0], f"{RUN_LABEL[1]}-b")
    log_b = tmp_path / "b.log"
    node = node_with_board(cluster)
    with running_operator(cluster, log_b, other, tmp_path_factory.getbasetemp()):
        cluster.apply(engine("coder", node), "-n", namespace)
        wait_for("the engine placed", placed(cluster, "engine", namespace, "coder"), operator)
        # Its GrantLedger is how the second operator knows the Engine lives, served elsewhere.
        wait_for("coder's GrantLedger",
                 lambda: cluster.kubectl("get", "grantledger", "coder", "-n", namespace,
                                         "--ignore-not-found").stdout.strip(),
                 operator)  # fmt: skip
        cluster.apply(lane("notes", "coder", 4096, **dict([other])), "-n", namespace)
        first = wait_for("the lane placed", placed(cluster, "embedlane", namespace, "notes"),
                         operator)  # fmt: skip
        time.sleep(4)  # the second's resyncs (1 s): each saw the lane labelled as it selects
        now = get(cluster, "embedlane", namespace, "notes")
        assert now["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        assert f"{namespace}/notes" not in log_b.read_text()

        a_before = len(operator.read_text())
        cluster.kubectl("label", "engine", "coder", "-n", namespace, "=".join(other),
                        "--overwrite")  # fmt: skip
        # A context beyond the host pool: the lane is placed smaller, a new reason, an Event.
        cluster.apply(lane("notes", "coder", 16_000_000, **dict([other])), "-n", namespace)

        def limited() -> Any:
            status = get(cluster, "embedlane", namespace, "notes").get("status") or {}
            return (status.get("placement") or {}).get("reason") == "LimitedByPool"

        wait_for("the lane placed again, by the second", limited, log_b)
        assert f"EmbedLane {namespace}/notes: LimitedByPool" in log_b.read_text()
        assert f"{namespace}/notes" not in operator.read_text()[a_before:]


def test_the_lane_runtime_reports_receipts_that_the_operator_charges_instead_of_the_estimate(
    cluster: Cluster, operator: Path, namespace: str, tmp_path: Path
) -> None:
    from continuum_operator.engine.admission import lane_audience
    from continuum_operator.gguf import file_sha256, read_facts
    from continuum_operator.testing import TinyModelShape, write_tiny_gguf
    from tests.support.llama_server import import_llama_cpp
    from tests.support.local_http import free_port, http_json, post_embeddings

    import_llama_cpp()
    shape = TinyModelShape(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256,
                           vocab_size=512, context_length=4096, embedding=True)  # fmt: skip
    model = write_tiny_gguf(tmp_path / "tiny-embed.gguf", shape, seed=2)
    facts = read_facts(model).model_dump(mode="json", by_alias=True, exclude_none=True)
    node = node_with_board(cluster)
    sha = file_sha256(model)
    source = {"kind": "hostPath", "path": str(model)}
    cluster.apply(engine("embedder", node, model={"facts": facts, "source": source, "sha256": sha}),
                  "-n", namespace)  # fmt: skip
    facts_read_from_file(cluster, namespace, "embedder")
    wait_for("the engine placed", placed(cluster, "engine", namespace, "embedder"), operator)
    cluster.apply(
        {"apiVersion": "continuum.dev/v1alpha1", "kind": "EmbedLane",
         "metadata": {"name": "search"},
         "spec": {"engine": "embedder", "maxContextTokens": 2048}},
        "-n", namespace,
    )  # fmt: skip
    lane = wait_for("the lane placed", placed(cluster, "embedlane", namespace, "search"), operator)
    estimated = pool_bytes(lane["status"]["placement"]["pools"], "host")
    assert lane["status"]["placement"]["bytesSource"] == "estimate"

    # The operator runs the lane in a pod on its node, with an identity that may read the lane
    # and write its status.runtime, nothing more.
    dep = wait_for(
        "the lane's Deployment",
        lambda: cluster.get_json(
            "deployments", "-n", namespace, "-l", "continuum.dev/embedlane=search"
        )["items"],
        operator,
    )[0]
    assert dep["metadata"]["name"] == "embedlane-search"
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][:4] == ["continuum", "embed", "--lane",
                                                   f"{namespace}/search"]  # fmt: skip
    who = f"--as=system:serviceaccount:{namespace}:{pod['serviceAccountName']}"

    def can(*args: str) -> str:
        found = cluster.kubectl("auth", "can-i", *args, "-n", namespace, who, check=False)
        return found.stdout.strip()

    assert can("get", "embedlanes/search") == "yes"
    assert can("patch", "embedlanes/search", "--subresource=status") == "yes"
    assert can("patch", "embedlanes/search") == "no"
    assert can("patch", "embedlanes/other", "--subresource=status") == "no"

    # A caller of the lane's namespace, with a token for the lane's audience (docs/embedlanes.md,
    # "The door": `continuum embed --lane` reviews it with the API server).
    cluster.kubectl("create", "serviceaccount", "caller", "-n", namespace)
    token = cluster.kubectl(
        "create", "token", "caller", "-n", namespace,
        f"--audience={lane_audience(namespace, 'search')}",
    ).stdout.strip()  # fmt: skip
    port = free_port()
    log = (tmp_path / "embed.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "continuum_operator.cli", "embed", "--model", str(model),
         "--model-sha256", sha, "--lane", f"{namespace}/search",
         "--listen", f"127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, env=cluster.env,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"

        def ready() -> Any:
            assert proc.poll() is None, (tmp_path / "embed.log").read_text()
            try:
                return http_json(f"{url}/readyz", timeout=2)[0] == 200
            except OSError:
                return False

        wait_for("continuum embed ready", ready, operator, timeout=60)
        code, body = post_embeddings(url, {"input": " ".join(["memory"] * 1000)}, token)
        assert code == 200, body
        assert len(body["data"][0]["embedding"]) == shape.n_embd

        def charged_from_receipts() -> Any:
            status = get(cluster, "embedlane", namespace, "search")["status"]
            runtime, p = status.get("runtime") or {}, status.get("placement") or {}
            largest = runtime.get("largestContextTokens", 0)
            done = largest > 1000 and p.get("floorTokens") == largest
            return status if done and p.get("bytesSource") == "receipt" else None

        status = wait_for("the lane charged from its receipts", charged_from_receipts, operator)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    runtime, p = status["runtime"], status["placement"]
    assert runtime["gpuOffload"] is False and runtime["ready"] is True
    assert runtime["receipts"] and runtime["requests"]["served"] == 1
    assert p["residence"] == "host" and [x["pool"] for x in p["pools"]] == ["host"]
    # The floor is what llama.cpp allocated for the largest context embedded (1,000 tokens: a
    # context of 1,024 cells), read from the runtime's receipt, not the estimate.
    at_1024 = next(r for r in runtime["receipts"] if r["contextTokens"] == 1024)
    allocated = sum(b["bytes"] for b in at_1024["buffers"] if b["kind"] != "model")
    assert p["floorTokens"] > 1000 and p["pools"][0]["floorBytes"] == allocated
    # Above every receipt the lease is never taken below the estimate.
    assert pool_bytes(p["pools"], "host") == estimated
