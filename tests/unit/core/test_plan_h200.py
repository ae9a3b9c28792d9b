"""The plan's bytes against what llama.cpp allocated on a real GPU: eight loads of two
generated models on an NVIDIA H200 (CUDA build of the llama.cpp that tools/llama vendors,
0c1e57098), each Engine as `tools/device_check.sh` planned it and the receipt parsed from that
load's log (tests/fixtures/h200/; the board is the one the agent's probe made there).

Two findings came from these loads and are pinned here: llama.cpp offloads the output layer
first (`-ngl 4` of 8 layers put the output layer and 3 repeating layers on the device; the plan
had the output layer last, 45.8 MiB short on the device), and a fully offloaded engine's host
compute buffer holds the attention mask (38.13 MiB at a 32,768-token context; the plan had 6).
"""

from __future__ import annotations

import pytest
import yaml

from continuum_operator.core.plan import PartBytes, plan
from continuum_operator.core.receipts import LOG_RESOLUTION_BYTES, Receipt, is_host_buffer
from tests.support.builders import ROOT, board, engine

H200 = ROOT / "tests" / "fixtures" / "h200"
RUNS = sorted(p.name[len("engine-") : -len(".yaml")] for p in H200.glob("engine-*.yaml"))
MiB = 2**20


def load(run: str) -> tuple[PartBytes, PartBytes, Receipt]:
    e = engine(yaml.safe_load((H200 / f"engine-{run}.yaml").read_text()))
    receipt = Receipt.model_validate(yaml.safe_load((H200 / f"receipt-{run}.yaml").read_text()))
    facts = e.spec.model.facts
    assert facts is not None  # the device check planned from the file's facts, inline
    p = plan(board(yaml.safe_load((H200 / "board.yaml").read_text())), e.spec, facts)
    assert p.layers_on_device == receipt.placement.layers_on_device, run
    return p.device, p.host, receipt


def measured(receipt: Receipt, host: bool, *kinds: str) -> int:
    return sum(
        b.bytes
        for b in receipt.buffers
        if str(b.kind) in kinds and is_host_buffer(b.device) == host
    )


def test_the_fixture_holds_eight_loads_at_every_offload_level() -> None:
    assert len(RUNS) == 8
    levels = {Receipt.model_validate(yaml.safe_load(p.read_text())).placement.layers_on_device
              for p in H200.glob("receipt-*.yaml")}  # fmt: skip
    assert {0, 4, 8, 9} <= levels  # none, part without and with the output layer, all


@pytest.mark.parametrize("run", RUNS)
def test_weights_and_kv_on_each_side_are_what_llama_cpp_allocated(run: str) -> None:
    device, host, receipt = load(run)
    slack = 2 * LOG_RESOLUTION_BYTES  # the log prints MiB to two decimals, per buffer
    for side, is_host in ((device, False), (host, True)):
        assert abs(side.weights - measured(receipt, is_host, "model")) <= slack, (run, is_host)
        assert abs(side.kv - measured(receipt, is_host, "kv")) <= slack, (run, is_host)


@pytest.mark.parametrize("run", [r for r in RUNS if "-ngl0-" not in r])
def test_the_device_compute_estimate_covers_what_llama_cpp_reserved(run: str) -> None:
    device, _, receipt = load(run)
    assert device.compute >= measured(receipt, False, "compute", "output"), run


@pytest.mark.parametrize("run", [r for r in RUNS if r.startswith("big-")])
def test_the_host_compute_estimate_covers_what_llama_cpp_reserved(run: str) -> None:
    _, host, receipt = load(run)
    got = measured(receipt, True, "compute", "output")
    slack = 4 * LOG_RESOLUTION_BYTES  # two buffers, each printed to two decimals of a MiB
    assert host.compute >= got - slack, (run, host.compute / MiB, got / MiB)


def test_with_no_layers_on_the_device_a_cuda_build_still_reserves_a_device_graph() -> None:
    """What the engine's pod must prevent (kube.workloads.engine_objects hides the GPUs from an
    engine planned with none): llama.cpp offloads large host ops to a GPU it can see."""
    device, _, receipt = load("big-ngl0-c4096-np1")
    assert device.weights == device.kv == device.compute == 0
    assert measured(receipt, False, "compute") > 40 * MiB
