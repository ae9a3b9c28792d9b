#!/usr/bin/env python3
"""What one write costs the API server, side by side in one run on a control plane of its own.

Usage: bench/write_cost.py [--writes 400] [--writers 8] [--rounds 2]

The operator's writes per granted mind are one replace of her Engine's GrantLedger's status (the
ledger, amortised over the minds a pass decides on that Engine) and one merge patch of her Mind's
status.
On a small machine the API server, not the operator, is what they wait on (docs/performance.md):
this bench measures the CPU kube-apiserver spends on each kind, read from /proc around `--writes`
writes made by `--writers` clients at once:

- `grant ledger status, as the grants loop writes it`: the GrantLedger of an Engine of
  `bench/scale.py`'s 100/s run with 16 grants (the ledger fields of
  `bench/data/engine_granted.json`, captured when the ledger was still in the Engine's status),
  its whole status replaced, the ledger changed;
- `grant ledger status, as a merge patch`: the same ledger sent as a merge patch conditioned on
  its resourceVersion instead of the whole status replaced;
- `mind status, as the operator patches it` (`bench/data/mind_granted.json`).

Each line: API server CPU per write, the mean answer time, and the object's size as stored
(managed fields included). Rounds alternate the kinds, so a drift of the machine shows.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `continuum_operator`

import psutil
from bench.kube_bench import (
    GROUP,
    ROOT,
    VERSION,
    cluster_down,
    cluster_up,
    control_plane,
    kubectl,
)
from kubernetes import client, config

from continuum_operator.kube.ledger.grant_ledger import LEDGER_FIELDS

DATA = ROOT / "bench/data"
Write = Callable[[str, dict[str, Any], int], dict[str, Any]]


def _changed_ledger(status: dict[str, Any], i: int) -> dict[str, Any]:
    """The status with a new step: every grant's tokens and the journal's seq moved on."""
    new = copy.deepcopy(status)
    for entry in new.get("grants") or []:
        entry["tokens"] = 4096 - (i % 64)
    new["grantStep"] = {**new["grantStep"], "seq": i + 1}
    return new


def _as_ledger(engine: Mapping[str, Any]) -> dict[str, Any]:
    """The GrantLedger of a captured Engine: the part of its status the grants loop writes
    (`kube.ledger.grant_ledger.LEDGER_FIELDS`), in an object of its own."""
    status = {k: v for k, v in (engine.get("status") or {}).items() if k in LEDGER_FIELDS}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "GrantLedger",
            "metadata": dict(engine["metadata"]), "status": status}  # fmt: skip


class Bench:
    def __init__(
        self, kubeconfig: str, path: str, apiserver: psutil.Process, writes: int, writers: int
    ) -> None:
        self.kc, self.path, self.apiserver = kubeconfig, path, apiserver
        self.writes, self.writers = writes, writers
        self.objects: Any = client.CustomObjectsApi(config.new_client_from_config(kubeconfig))
        self.made = 0

    def cpu(self) -> float:
        t = self.apiserver.cpu_times()
        return float(t.user + t.system)

    def measure(
        self,
        plural: str,
        fixture: str,
        write: Write,
        shape: Callable[[dict[str, Any]], dict[str, Any]] = dict,
    ) -> tuple[float, float, int]:
        """`writers` objects made from `fixture` (through `shape`), each written by `write` in a
        client of its own, `writes` times in all: the API server's CPU seconds and the wall
        seconds a write, and one object's size as stored."""
        body = shape(json.loads((DATA / fixture).read_text()))
        self.made += 1
        ns = f"write-cost-{self.made}"
        kubectl(self.kc, self.path, "create", "namespace", ns)
        made = [self._create(plural, ns, f"x{w}", body) for w in range(self.writers)]

        def writer(obj: dict[str, Any]) -> None:
            for i in range(self.writes // self.writers):
                obj = write(ns, obj, i)

        time.sleep(1)  # the creates' watch events and GC settle
        cpu, t = self.cpu(), time.monotonic()
        with ThreadPoolExecutor(self.writers) as pool:
            list(pool.map(writer, made))
        cpu, t = self.cpu() - cpu, time.monotonic() - t
        stored = json.loads(kubectl(self.kc, self.path, "get", plural, "-n", ns, "-o", "json",
                                    "--show-managed-fields"))["items"][0]  # fmt: skip
        return cpu / self.writes, t / self.writes, len(json.dumps(stored, separators=(",", ":")))

    def _create(self, plural: str, ns: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        doc = copy.deepcopy(body)
        doc["metadata"] = {**doc["metadata"], "name": name, "namespace": ns}
        status = doc.pop("status", None)
        made = self.objects.create_namespaced_custom_object(GROUP, VERSION, ns, plural, doc)
        made["status"] = status
        return dict(
            self.objects.replace_namespaced_custom_object_status(
                GROUP, VERSION, ns, plural, name, made
            )
        )

    def replace_ledger(self, ns: str, obj: dict[str, Any], i: int) -> dict[str, Any]:
        """The grants loop's write: the whole status replaced, on the object's version."""
        obj["status"] = _changed_ledger(obj["status"], i)
        return dict(self.objects.replace_namespaced_custom_object_status(
            GROUP, VERSION, ns, "grantledgers", obj["metadata"]["name"], obj))  # fmt: skip

    def patch_ledger(self, ns: str, obj: dict[str, Any], i: int) -> dict[str, Any]:
        """The ledger as a merge patch, conditioned on resourceVersion as the replace is."""
        patch = {
            "metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
            "status": _changed_ledger(obj["status"], i),
        }
        return dict(self.objects.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, "grantledgers", obj["metadata"]["name"], patch))  # fmt: skip

    def patch_mind(self, ns: str, obj: dict[str, Any], i: int) -> dict[str, Any]:
        """The operator's projection: the Mind's status as a merge patch."""
        status = copy.deepcopy(obj["status"])
        status["grant"]["slot"] = i % 16
        status["grant"]["message"] = f"slot {i % 16}, 4096 tokens"
        return dict(self.objects.patch_namespaced_custom_object_status(
            GROUP, VERSION, ns, "minds", obj["metadata"]["name"], {"status": status}))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writes", type=int, default=400)
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.writes < args.writers or args.writers < 1:
        parser.error("--writes must be at least --writers, and --writers at least 1")

    state = Path(tempfile.mkdtemp(prefix="bench-write-cost-"))
    print(f"starting a control plane in {state} ...", flush=True)
    kc, exports = cluster_up(state)
    path = exports.get("PATH", "")
    try:
        kubectl(kc, path, "apply", "--server-side", "--force-conflicts", "-f", str(ROOT / "crds"))
        kubectl(kc, path, "wait", "--for=condition=established", "--timeout=60s", "-f",
                str(ROOT / "crds"))  # fmt: skip
        bench = Bench(kc, path, control_plane(state)["kube-apiserver"], args.writes,
                      args.writers)  # fmt: skip
        engine, mind = "engine_granted.json", "mind_granted.json"
        kinds: list[tuple[str, Callable[[], tuple[float, float, int]]]] = [
            ("grant ledger status, as the grants loop writes it",
             lambda: bench.measure("grantledgers", engine, bench.replace_ledger, _as_ledger)),
            ("grant ledger status, as a merge patch",
             lambda: bench.measure("grantledgers", engine, bench.patch_ledger, _as_ledger)),
            ("mind status, as the operator patches it",
             lambda: bench.measure("minds", mind, bench.patch_mind)),
        ]  # fmt: skip
        print(f"{args.writes} writes a kind, {args.writers} writers at once; API server CPU per "
              f"write, mean answer, stored size")  # fmt: skip
        seen: dict[str, list[float]] = {}
        for r in range(args.rounds):
            for label, measure in kinds:
                cpu, answer, size = measure()
                seen.setdefault(label, []).append(cpu)
                answer_ms = 1000 * answer * args.writers
                print(f"  round {r + 1}: {label}: {1000 * cpu:.2f} ms CPU, "
                      f"{answer_ms:.0f} ms answer, {size} B", flush=True)  # fmt: skip
        whole = min(seen[kinds[0][0]])
        print("best of the rounds, as a share of the ledger's write as it is:")
        for label, cpus in seen.items():
            print(f"  {label}: {1000 * min(cpus):.2f} ms ({min(cpus) / whole:.2f})")
    finally:
        cluster_down(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
