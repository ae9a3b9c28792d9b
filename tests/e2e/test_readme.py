"""The README's first hour, line by line, as a newcomer runs it: the demo, its look-around lines,
a queue that moves when a Mind is deleted, the chart installed on the demo's control plane,
offline planning and the tiny model, and the demo stopped.

The commands are read from the README's own blocks (its "Quick start" section), never copied
here, so a line that stops working fails this test. Each runs in bash from the repository root
with the environment the lines before it left (`eval "$(... tools/cluster env)"` carries on),
and must exit 0. What the test changes, and why:
- `make demo` runs `tools/demo`, the command it ends in: its prerequisites (`make toolchain`,
  `make install`) are what this suite already runs on.
- `make test` (this suite) and `continuum operator --kubeconfig ~/.kube/config` (an operator
  against the reader's own cluster, which never returns) are not run.
- `~/.cache/continuum/demo-cluster` is this test's own directory, so a reader's demo is left
  alone.
- A `###` subsection of the Quick start (a real node's steps, which need one) is not run.
A line whose comment names Minds and states (`# ada Granted, cy Queued`) is run until its output
shows them (the operator acts within seconds), and fails if it never does. The lines the demo
itself prints to look around with are run right after it, the same way (`tail -f` excepted).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEMO_DIR = "~/.cache/continuum/demo-cluster"
NOT_RUN = ("make test", ".venv/bin/continuum operator ")
STATES = "Granted|Queued|Reclaiming|Refused"

pytestmark = pytest.mark.e2e


@dataclass(frozen=True)
class Line:
    number: int  # of the line's first physical line in `where`
    command: str
    comment: str
    where: str = "README.md"


def quick_start_lines(text: str) -> list[Line]:
    """The commands of the README's indented blocks between "## Quick start" and the next
    section: continuation lines joined, comment-only lines dropped, the comment kept apart."""
    lines = text.splitlines()
    start = lines.index("## Quick start")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("## "))
    return block_lines(lines, start, end)


def demo_lines(printed: str) -> list[Line]:
    """The commands the demo prints in its "Look around" block."""
    lines = printed.splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("Look around"))
    end = next(i for i in range(start + 2, len(lines)) if lines[i] and not lines[i][0].isspace())
    return [
        Line(ln.number, ln.command, ln.comment, "tools/demo's output")
        for ln in block_lines(lines, start, end)
        if not ln.command.startswith("tail -f")
    ]


def block_lines(lines: list[str], start: int, end: int) -> list[Line]:
    out: list[Line] = []
    i = start
    subsection = False
    while i < end:
        raw = lines[i]
        if raw.startswith("### "):
            subsection = True  # a part of its own (a real node's): not the demo's path
        if (
            subsection
            or not raw.startswith("    ")
            or raw.strip().startswith("#")
            or not raw.strip()
        ):
            i += 1
            continue
        number, command = i + 1, raw.strip()
        while command.endswith("\\"):
            i += 1
            command = command[:-1] + " " + lines[i].strip()
        code, comment = split_comment(command)
        out.append(Line(number, code, comment))
        i += 1
    return out


def split_comment(command: str) -> tuple[str, str]:
    """The command and its trailing `# comment` (a `#` outside quotes, after a space)."""
    quote = ""
    for n, ch in enumerate(command):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and n and command[n - 1] == " ":
            return command[:n].rstrip(), command[n + 1 :].strip()
    return command, ""


def expected_states(comment: str) -> dict[str, str]:
    return dict(re.findall(rf"\b([a-z]+) ({STATES})\b", comment))


def shown_states(output: str) -> dict[str, str]:
    """NAME -> GRANT of `kubectl get minds` output."""
    rows = [r.split() for r in output.strip().splitlines()]
    if not rows or "GRANT" not in rows[0]:
        return {}
    col = rows[0].index("GRANT")
    return {r[0]: r[col] for r in rows[1:] if len(r) > col}


class Shell:
    """Runs lines one after another, each in a new bash that starts from the environment the
    last one ended with (exported or not: `set -a`)."""

    def __init__(self, env: dict[str, str], state: Path) -> None:
        self.env = env
        self.envfile = state / "env"

    def run(self, line: Line, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
        script = f'set -a -o pipefail\n{command}\nrc=$?\nenv -0 > "{self.envfile}"\nexit $rc\n'
        proc = subprocess.run(
            ["bash", "-c", script],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if proc.returncode == 0 and self.envfile.exists():
            pairs = self.envfile.read_text().split("\0")
            self.env = dict(p.split("=", 1) for p in pairs if "=" in p)
        return proc


def fail(line: Line, command: str, proc: subprocess.CompletedProcess[str], why: str) -> None:
    pytest.fail(
        f"{line.where}:{line.number}: {line.command}\n(run as: {command})\n{why}\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}",
        pytrace=False,
    )


@pytest.fixture
def demo_dir(tmp_path: Path) -> Iterator[Path]:
    state = tmp_path / "demo-cluster"
    try:
        yield state
    finally:
        env = {**os.environ, "CONTINUUM_CLUSTER_DIR": str(state)}
        subprocess.run([str(ROOT / "tools" / "demo"), "stop"], cwd=ROOT, env=env,
                       capture_output=True, timeout=120, check=False)  # fmt: skip


def test_the_readme_quick_start_works_line_by_line(demo_dir: Path, tmp_path: Path) -> None:
    lines = quick_start_lines(README.read_text())
    commands = [ln.command for ln in lines]
    # The README's path, in order: the demo first and its stop last, a queue moved by a
    # deletion in between, and the chart installed after the demo installed the CRDs.
    assert commands[0] == "make demo" and commands[-1] == "tools/demo stop", (
        "the Quick start (outside its ### subsections) begins with make demo and ends with "
        f"tools/demo stop: {commands}"
    )
    helm = next(i for i, c in enumerate(commands) if c.startswith("helm install "))
    delete = next(i for i, c in enumerate(commands) if c.startswith("kubectl delete mind "))
    assert 0 < delete < helm < len(commands) - 1
    assert any(expected_states(ln.comment).get("cy") == "Queued" for ln in lines[:delete])
    assert any(expected_states(ln.comment).get("cy") == "Granted" for ln in lines[delete:])

    env = {**os.environ, "CONTINUUM_CLUSTER_DIR": str(demo_dir)}
    shell = Shell(env, tmp_path)
    ran = 0
    todo = list(lines)
    while todo:
        line = todo.pop(0)
        if line.command.startswith(NOT_RUN):
            continue
        command = line.command.replace(DEMO_DIR, str(demo_dir))
        if command == "make demo":
            command = "tools/demo"
        timeout = 600 if command == "tools/demo" else 180
        expected = expected_states(line.comment)
        deadline = time.monotonic() + 90
        while True:
            proc = shell.run(line, command, timeout)
            if proc.returncode != 0:
                fail(line, command, proc, f"exited {proc.returncode}")
            shown = shown_states(proc.stdout)
            if all(shown.get(m) == s for m, s in expected.items()) and (
                not expected or set(shown) == set(expected)
            ):
                break
            if time.monotonic() > deadline:
                fail(line, command, proc, f"the comment says {expected}, kubectl shows {shown}")
            time.sleep(0.5)  # a bash and a kubectl each try
        ran += 1
        if command == "tools/demo":
            printed = demo_lines(proc.stdout)
            assert len(printed) >= 6, proc.stdout[-3000:]
            todo = printed + todo
    assert ran >= 20, ran


# --- the parser, on the README as it is (no cluster) ------------------------------------------


def test_the_parser_reads_the_readme_commands_with_their_comments() -> None:
    lines = quick_start_lines(README.read_text())
    by_command = {ln.command: ln for ln in lines}
    assert "make demo" in by_command and "make test" in by_command
    plan = next(ln for ln in lines if ln.command.startswith(".venv/bin/continuum plan "))
    assert "--engine examples/engines/agent-32b.yaml -o table" in plan.command  # joined
    assert all(not ln.command.startswith("#") for ln in lines)
    assert split_comment("kubectl get x -o jsonpath='{.a}#b' # why") == (
        "kubectl get x -o jsonpath='{.a}#b'",
        "why",
    )
    assert expected_states("ada Granted, cy Queued, dee Refused") == {
        "ada": "Granted",
        "cy": "Queued",
        "dee": "Refused",
    }
