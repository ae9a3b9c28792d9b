"""Who held a process's memory at its high-water mark, from a memray capture.

    python bench/scale.py ... --memray /tmp/op.bin     # the operator, recorded
    python bench/memray_peak.py /tmp/op.bin [--top 25]

memray (`pip install memray`; not a dependency of the package) records every allocation and
free; at the moment the heap was largest, this sums what was still live three ways: by the
innermost frame (who called the allocator), by the first frame in `continuum_operator` (which
code of ours asked, even when a library allocated), and by the first package on the stack.
`memray tree FILE` shows the same high-water mark as an interactive tree.
"""

from __future__ import annotations

import argparse
import collections
import importlib
from typing import Any

MiB = 2**20


def _short(filename: str) -> str:
    for cut in ("site-packages/", "lib/python3.11/", "continuum_operator/"):
        filename = filename.split(cut)[-1]
    return filename


def summarize(path: str, top: int) -> str:
    # Imported by name: memray is not installed where the benches run without it (and mypy).
    reader: Any = importlib.import_module("memray").FileReader(path)
    inner: collections.Counter[str] = collections.Counter()
    ours: collections.Counter[str] = collections.Counter()
    package: collections.Counter[str] = collections.Counter()
    for record in reader.get_high_watermark_allocation_records(merge_threads=True):
        stack = record.stack_trace(max_stacks=40)
        size = record.size
        if stack:
            fn, filename, line = stack[0]
            inner[f"{fn} {_short(filename)}:{line}"] += size
        first = next(((fn, f, ln) for fn, f, ln in stack if "continuum_operator" in f), None)
        ours["(no frame of ours)" if first is None else
             f"{first[0]} {_short(first[1])}:{first[2]}"] += size  # fmt: skip
        libs = (f.split("site-packages/")[-1].split("/")[0] for _, f, _ in stack
                if "site-packages" in f)  # fmt: skip
        lib = next(libs, "(standard library)")
        package[lib] += size
    lines = [f"peak heap {reader.metadata.peak_memory / MiB:.1f} MiB ({path})"]
    for title, counter in (("innermost frame", inner), ("first frame of ours", ours),
                           ("first package on the stack", package)):  # fmt: skip
        lines.append(f"\nby {title}")
        lines.extend(f"{size / MiB:8.1f} MiB  {name}" for name, size in counter.most_common(top))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("capture", help="a memray capture (bench/scale.py --memray FILE)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    print(summarize(args.capture, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
