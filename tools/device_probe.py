"""Probe this machine's NVIDIA GPUs as the node agent does, and keep what they said.

    python tools/device_probe.py [--expect discrete] [--where "lab H200, rack 3"] [--out PATH]
                                 [--repeat 20] [--no-save]

Prints (1) the raw readings (pynvml's answers, psutil's, cgroup and NUMA files), (2) the
NodeBoard the agent would write, (3) the probe's timings per backend (median and max over
--repeat cycles), and saves the raw readings as a captured fixture under tests/fixtures/probes/
(labelled with where and when), so the board can be re-derived in unit tests on any machine.

Without an NVIDIA GPU (no library, no driver, or no GPU) it says "no NVIDIA: <why>" and exits 1
without saving anything: a capture is only worth keeping from a GPU machine. `--expect MODE`
exits 3 when the board's memory mode is not MODE (an H200 must read discrete).
`--replay-nvml FIXTURE` answers NVML from a recorded fixture instead of the driver, to check the
tool itself on a machine without a GPU; it never saves (what it would save was not captured).
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from continuum_operator.agent import nvml, probe  # noqa: E402
from continuum_operator.core.nodeboard import board_status  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "probes"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--where", default=socket.gethostname(), help="where the capture is from")
    parser.add_argument("--out", type=Path, default=None, help="fixture path (default: derived)")
    parser.add_argument("--no-save", action="store_true", help="print only")
    parser.add_argument("--repeat", type=int, default=10, help="probe cycles to time (>= 1)")
    parser.add_argument("--expect", choices=("discrete", "unified", "unknown"), default=None)
    parser.add_argument("--replay-nvml", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    nv = None
    if args.replay_nvml is not None:
        from continuum_operator.testing.fake_nvml import FakeNvml

        recorded = json.loads(args.replay_nvml.read_text())["nvml"]
        nv = FakeNvml(recorded)
        args.no_save = True

    def capture() -> tuple[dict[str, Any], dict[str, float]]:
        return probe.capture(nv=nv)

    doc, first = capture()
    reading = nvml.parse(doc["nvml"])
    if not reading.available or not reading.gpus:
        why = reading.reason if not reading.available else "NVML reported no GPUs"
        print(f"no NVIDIA: {why}", file=sys.stderr)
        print("nothing captured: run this on a machine with an NVIDIA GPU and its driver",
              file=sys.stderr)  # fmt: skip
        return 1

    timings = [first]
    for _ in range(max(0, args.repeat - 1)):
        timings.append(capture()[1])
    status = board_status(probe.readings(doc))

    print("## raw readings")
    print(json.dumps(doc, indent=1))
    print("## board")
    print(yaml.safe_dump(status.model_dump(mode="json", by_alias=True, exclude_none=True),
                         sort_keys=False), end="")  # fmt: skip
    print(f"## probe timings over {len(timings)} cycles (ms)")
    for backend in first:
        values = [t[backend] * 1000 for t in timings]
        print(f"{backend:<12} median {statistics.median(values):8.2f}   max {max(values):8.2f}")
    total = [sum(t.values()) * 1000 for t in timings]
    print(f"{'total':<12} median {statistics.median(total):8.2f}   max {max(total):8.2f}")

    if not args.no_save:
        now = datetime.now(UTC)
        names = sorted({g.name for g in reading.gpus})
        label = {
            "source": "captured",
            "where": args.where,
            "when": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "by": "tools/device_probe.py",
            "driver": reading.driver,
            "gpus": f"{len(reading.gpus)} x {', '.join(names)}",
        }
        slug = re.sub(r"[^a-z0-9]+", "-", names[0].lower()).strip("-")
        out = args.out or FIXTURES / f"captured-{slug}-{now:%Y%m%d}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"label": label, **doc}, indent=1) + "\n")
        print(f"## saved {out}")

    if args.expect is not None and str(status.memory_mode) != args.expect:
        print(f"expected {args.expect}, read {status.memory_mode}: {status.memory_mode_reason}",
              file=sys.stderr)  # fmt: skip
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
