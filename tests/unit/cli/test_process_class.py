"""`continuum run --class background`: a command and everything it starts run at the OS's lowest
ordinary priority (docs/design.md rule 8), measured on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from continuum_operator import procclass
from continuum_operator.procclass import ProcessClass

pytestmark = pytest.mark.skipif(os.name != "posix", reason="nice values are Unix's")

# A child that reports its nice value and starts a grandchild that reports its own.
FAMILY = textwrap.dedent(
    """
    import os, subprocess, sys
    print("child", os.nice(0), flush=True)
    subprocess.run([sys.executable, "-c", "import os; print('grandchild', os.nice(0))"], check=True)
    """
)


def continuum_run(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "continuum_operator.cli", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def reported(stdout: str) -> dict[str, int]:
    return {who: int(n) for who, n in (line.split() for line in stdout.splitlines())}


def test_a_child_and_a_grandchild_under_background_report_nice_19() -> None:
    done = continuum_run("--class", "background", "--", sys.executable, "-c", FAMILY)
    assert done.returncode == 0, done.stderr
    assert reported(done.stdout) == {"child": 19, "grandchild": 19}


def test_the_normal_class_leaves_the_family_at_the_parents_priority() -> None:
    done = continuum_run("--class", "normal", "--", sys.executable, "-c", FAMILY)
    assert done.returncode == 0, done.stderr
    mine = os.nice(0)
    assert reported(done.stdout) == {"child": mine, "grandchild": mine}


def test_the_class_defaults_to_the_mark_the_webhook_puts_in_a_childs_environment() -> None:
    env = {**os.environ, procclass.ENV: "background"}
    done = continuum_run("--", sys.executable, "-c", FAMILY, env=env)
    assert reported(done.stdout) == {"child": 19, "grandchild": 19}


def test_the_commands_exit_status_is_passed_on() -> None:
    done = continuum_run("--class", "background", "--", sys.executable, "-c", "raise SystemExit(7)")
    assert done.returncode == 7


def test_a_missing_command_is_a_usage_error_and_an_unknown_program_exits_127() -> None:
    assert continuum_run("--class", "background").returncode == 2
    done = continuum_run("--class", "background", "--", "/nonexistent/program")
    assert done.returncode == 127
    assert "/nonexistent/program" in done.stderr


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs CAP_SYS_NICE")
def test_a_descendant_that_raises_its_own_priority_is_lowered_again_by_the_sweep() -> None:
    # With the privilege to do so, a grandchild raises itself to nice 0; the runner's sweep
    # finds it among its descendants and lowers it back to 19 while it runs. (Its nice is not
    # read back after the raise: a sweep may lower it before the read, under load.)
    escapee = textwrap.dedent(
        """
        import os, time
        os.setpriority(os.PRIO_PROCESS, 0, 0)  # raises unless it took: nice 0 from here
        print("raised", 0, flush=True)
        deadline = time.monotonic() + 20
        while os.getpriority(os.PRIO_PROCESS, 0) != 19 and time.monotonic() < deadline:
            time.sleep(0.05)
        print("lowered", os.getpriority(os.PRIO_PROCESS, 0), flush=True)
        """
    )
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {escapee!r}])"
    done = continuum_run("--class", "background", "--sweep", "0.1", "--", sys.executable, "-c",
                         parent)  # fmt: skip
    assert reported(done.stdout) == {"raised": 0, "lowered": 19}


def _autogroups() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


@pytest.mark.skipif(not _autogroups(), reason="Linux autogroups are off or absent")
def test_a_descendant_in_a_session_of_its_own_has_its_autogroup_lowered_too() -> None:
    # With autogroups, a process that calls setsid competes as a new group at the group's nice
    # (0), whatever its own nice: the sweep lowers that group's nice to 19.
    escapee = textwrap.dedent(
        """
        import os, time
        os.setsid()
        def group():
            return int(open("/proc/self/autogroup").read().split()[-1])
        print("session", group(), flush=True)
        deadline = time.monotonic() + 20
        while group() != 19 and time.monotonic() < deadline:
            time.sleep(0.05)
        print("lowered", group(), flush=True)
        """
    )
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {escapee!r}])"
    done = continuum_run("--class", "background", "--sweep", "0.1", "--", sys.executable, "-c",
                         parent)  # fmt: skip
    assert reported(done.stdout) == {"session": 0, "lowered": 19}


def test_the_lowest_priority_is_nice_19_on_unix() -> None:
    assert procclass.lowest_priority() == 19


def test_lowering_leaves_a_process_already_at_the_lowest_alone() -> None:
    code = "import os, time; os.nice(19); print('ready', flush=True); time.sleep(30)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert procclass.lower(psutil.Process(proc.pid), 19) is False
    finally:
        proc.kill()
        proc.communicate()


def test_process_classes_are_named_as_the_webhook_marks_them() -> None:
    from continuum_operator.kube.children import membership as children

    assert str(ProcessClass.BACKGROUND) == children.BACKGROUND
    assert procclass.ENV == children.CLASS_ENV


class FakeWindowsProcess:
    """A process as psutil shows one on Windows: `nice` is its priority class."""

    def __init__(self, cls: int) -> None:
        self.pid = -1  # no such process: the autogroup step has nothing to do
        self.cls = cls

    def nice(self, value: int | None = None) -> int:
        if value is not None:
            self.cls = value
        return self.cls


def test_on_windows_the_lowest_is_the_idle_class_and_every_other_class_is_above_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    idle, below_normal, normal = 0x40, 0x4000, 0x20  # Windows' values: not ordered by rank
    monkeypatch.setattr(psutil, "WINDOWS", True)
    monkeypatch.setattr(psutil, "POSIX", False)
    monkeypatch.setattr(psutil, "IDLE_PRIORITY_CLASS", idle, raising=False)
    assert procclass.lowest_priority() == idle
    for cls in (below_normal, normal):
        p = FakeWindowsProcess(cls)
        assert procclass.lower(p, idle) is True  # type: ignore[arg-type]
        assert p.cls == idle
    assert procclass.lower(FakeWindowsProcess(idle), idle) is False  # type: ignore[arg-type]


def test_where_psutil_knows_no_lower_class_the_command_runs_at_the_parents(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(psutil, "WINDOWS", False)
    monkeypatch.setattr(psutil, "POSIX", False)
    assert procclass.lowest_priority() is None
    code = procclass.run([sys.executable, "-c", FAMILY], ProcessClass.BACKGROUND, 0.1)
    out, err = capfd.readouterr()
    assert code == 0
    mine = os.nice(0)
    assert reported(out) == {"child": mine, "grandchild": mine}
    assert "parent's class" in err
