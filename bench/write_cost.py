#!/usr/bin/env python3
"""What one write costs the API server, side by side in one run on a control plane of its own.

Usage: bench/write_cost.py [--writes 400] [--writers 8] [--rounds 2]

The operator's writes per granted mind are one replace of her Engine's status (the ledger,
amortised over the minds a pass decides on that Engine) and one merge patch of her Mind's status.
On a small machine the API server, not the operator, is what they wait on (docs/performance.md):
this bench measures the CPU kube-apiserver spends on each kind, read from /proc around `--writes`
writes made by `--writers` clients at once:

- `engine status, as the grants loop writes it`: an Engine of `bench/scale.py`'s 100/s run with
  16 grants (`bench/data/engine_granted.json`), its whole status replaced, the ledger changed;
- `engine status, the ledger alone`: the same replace of an Engine whose status holds only the
  ledger and its companions (grants, grantCapacity, grantStep): what the ledger's write would cost
  in an object without the plan, placement and conditions;
- `engine status, the ledger as a merge patch`: the first Engine, its ledger sent as a merge
  patch conditioned on its resourceVersion instead of the whole status replaced;
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` and `continuum_operator`

import psutil
from bench.kube_bench import GROUP, ROOT, VERSION, cluster_down, cluster_up, kubectl
from kubernetes import client, config

DATA = ROOT / "bench/data"
LEDGER_ONLY = ("grants", "grantCapacity", "grantStep")


def _changed_engine(status: dict[str, Any], i: int) -> dict[str, Any]:
    """The status with a new step: every grant's tokens and the journal's seq moved on."""
    new = copy.deepcopy(status)
    for entry in new.get("grants") or []:
        entry["tokens"] = 4096 - (i % 64)
    new["grantStep"] = {**new["grantStep"], "seq": i + 1}
    return new


class Bench:
    def __init__(self, kubeconfig: str, path: str, apiserver: psutil.Process) -> None:
        self.kc, self.path, self.apiserver = kubeconfig, path, apiserver
        self.objects: Any = client.CustomObjectsApi(config.new_client_from_config(kubeconfig))
        self.made = 0

    def cpu(self) -> float:
        t = self.apiserver.cpu_times()
        return float(t.user + t.system)

    def _namespace(self) -> str:
        self.made += 1
        ns = f"write-cost-{self.made}"
        kubectl(self.kc, self.path, "create", "namespace", ns)
        return ns

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

    def engines(self, status_of: Callable[[dict[str, Any]], dict[str, Any]], writes: int,
                writers: int) -> tuple[float, float, int]:  # fmt: skip
        """Replace the status of `writers` Engines, `writes` times in all."""
        body = json.loads((DATA / "engine_granted.json").read_text())
        body["status"] = status_of(body["status"])
        ns = self._namespace()
        made = [self._create("engines", ns, f"e{w}", body) for w in range(writers)]

        def writer(obj: dict[str, Any]) -> None:
            for i in range(writes // writers):
                obj["status"] = _changed_engine(obj["status"], i)
                obj = self.objects.replace_namespaced_custom_object_status(
                    GROUP, VERSION, ns, "engines", obj["metadata"]["name"], obj
                )

        return self._timed(lambda: self._run(writer, made, writers), writes, "engines", ns)

    def ledger_patches(self, writes: int, writers: int) -> tuple[float, float, int]:
        """Merge-patch the ledger of `writers` Engines (conditioned on resourceVersion, as the
        replace is), `writes` times in all."""
        body = json.loads((DATA / "engine_granted.json").read_text())
        ns = self._namespace()
        made = [self._create("engines", ns, f"e{w}", body) for w in range(writers)]

        def writer(obj: dict[str, Any]) -> None:
            for i in range(writes // writers):
                status = _changed_engine(obj["status"], i)
                patch = {
                    "metadata": {"resourceVersion": obj["metadata"]["resourceVersion"]},
                    "status": {k: status[k] for k in LEDGER_ONLY},
                }
                obj = self.objects.patch_namespaced_custom_object_status(
                    GROUP, VERSION, ns, "engines", obj["metadata"]["name"], patch
                )

        return self._timed(lambda: self._run(writer, made, writers), writes, "engines", ns)

    def minds(self, writes: int, writers: int) -> tuple[float, float, int]:
        """Merge-patch the status of `writers` Minds, `writes` times in all."""
        body = json.loads((DATA / "mind_granted.json").read_text())
        ns = self._namespace()
        made = [self._create("minds", ns, f"m{w}", body) for w in range(writers)]

        def writer(obj: dict[str, Any]) -> None:
            status = copy.deepcopy(obj["status"])
            for i in range(writes // writers):
                status["grant"]["slot"] = i % 16
                status["grant"]["message"] = f"slot {i % 16}, 4096 tokens"
                self.objects.patch_namespaced_custom_object_status(
                    GROUP, VERSION, ns, "minds", obj["metadata"]["name"], {"status": status}
                )

        return self._timed(lambda: self._run(writer, made, writers), writes, "minds", ns)

    @staticmethod
    def _run(writer: Callable[[dict[str, Any]], None], made: list[dict[str, Any]],
             writers: int) -> None:  # fmt: skip
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(writer, made))

    def _timed(self, run: Callable[[], None], writes: int, plural: str,
               ns: str) -> tuple[float, float, int]:  # fmt: skip
        time.sleep(1)  # the creates' watch events and GC settle
        cpu, t = self.cpu(), time.monotonic()
        run()
        cpu, t = self.cpu() - cpu, time.monotonic() - t
        stored = json.loads(kubectl(self.kc, self.path, "get", plural, "-n", ns, "-o", "json",
                                    "--show-managed-fields"))["items"][0]  # fmt: skip
        return cpu / writes, t / writes, len(json.dumps(stored, separators=(",", ":")))


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
        apiserver = psutil.Process(int((state / "pids/kube-apiserver.pid").read_text()))
        bench = Bench(kc, path, apiserver)
        kinds: list[tuple[str, Callable[[], tuple[float, float, int]]]] = [
            ("engine status, as the grants loop writes it",
             lambda: bench.engines(lambda s: s, args.writes, args.writers)),
            ("engine status, the ledger alone",
             lambda: bench.engines(lambda s: {k: s[k] for k in LEDGER_ONLY},
                                   args.writes, args.writers)),
            ("engine status, the ledger as a merge patch",
             lambda: bench.ledger_patches(args.writes, args.writers)),
            ("mind status, as the operator patches it",
             lambda: bench.minds(args.writes, args.writers)),
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
        print("best of the rounds, as a share of the Engine's write as it is:")
        for label, cpus in seen.items():
            print(f"  {label}: {1000 * min(cpus):.2f} ms ({min(cpus) / whole:.2f})")
    finally:
        cluster_down(state)
    return 0


if __name__ == "__main__":
    sys.exit(main())
