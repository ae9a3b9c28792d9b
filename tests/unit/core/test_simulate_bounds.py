"""Hostile scenarios for `continuum simulate` (docs/simulate.md, "Bounds"): a file of a few lines
must not take gigabytes or hours. Each bound stops a run with exit 2 and a message naming the
bound, where the run was and what to change; an unbounded duration, times of `.inf`, and counts
adding up past the simulator's most minds are refused when the file is read."""

from __future__ import annotations

import resource
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from continuum_operator import cli
from continuum_operator.core.simulate import (
    EngineScenario,
    MindScenario,
    Scenario,
    ScenarioTooLarge,
    SimulationBounds,
    simulate,
)
from continuum_operator.scenario import load
from tests.support.builders import ROOT

FIVE_LINES = """\
duration: 1.0e+12
engines: [{name: e, slots: 1, tokensPerSlot: 1}]
minds:
- {name: m, engine: e, turnSeconds: 0.001, thinkSeconds: 0}
"""

# The five-line scenario ran to 2.8 GB and a MemoryError traceback; bounded, it stops at its
# millionth event (about 310 MB of resident memory measured).
MEMORY_BYTES = 1 << 30

_CHILD = """
import sys
from continuum_operator import cli
sys.exit(cli.main(["simulate", sys.argv[1]]))
"""


def test_the_five_line_scenario_exits_2_in_a_process_capped_at_1_gib(tmp_path: Path) -> None:
    path = tmp_path / "hostile.yaml"
    path.write_text(FIVE_LINES)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
        resource.setrlimit(resource.RLIMIT_CPU, (120, 120))

    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)],
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"error: {path}: the scenario reached the simulator's bound")
    assert "1,000,000 events at virtual time" in done.stderr
    assert "shorten duration, lengthen the minds' turnSeconds and thinkSeconds" in done.stderr


@pytest.mark.parametrize(
    ("text", "said"),
    [
        (
            "duration: .inf\nengines: [{name: e, slots: 1, tokensPerSlot: 1}]\n",
            "duration: Input should be a finite number",
        ),
        (
            "engines: [{name: e, slots: 1, tokensPerSlot: 1}]\n"
            "minds: [{name: m, engine: e, turnSeconds: .nan}]\n",
            "minds[0].turnSeconds: Input should be a finite number",
        ),
        (
            "engines: [{name: e, slots: 1, tokensPerSlot: 1}]\nminds:\n"
            "- {name: a, engine: e, count: 1000000}\n- {name: b, engine: e, count: 1000000}\n",
            "the minds' counts add up to 2,000,000, more than the simulator's 100,000; lower count",
        ),
    ],
    ids=["infinite-duration", "nan-turn", "two-million-minds"],
)
def test_scenarios_past_the_static_bounds_are_refused_when_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, said: str
) -> None:
    path = tmp_path / "s.yaml"
    path.write_text(text)
    assert cli.main(["simulate", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and said in err, err


def test_each_bound_stops_the_run_saying_which() -> None:
    busy = Scenario(
        engines=(EngineScenario("e", 1, 1),),
        minds=(MindScenario("m", "e", turn_seconds=0.001, think_seconds=0.0),),
        duration=1e12,
    )
    with pytest.raises(ScenarioTooLarge, match=r"bound of 1,000 events at virtual time"):
        simulate(_with(busy, SimulationBounds(events=1_000)))
    with pytest.raises(ScenarioTooLarge, match=r"bound of 500 lines of transition log"):
        simulate(_with(busy, SimulationBounds(log_lines=500)))
    # A crowd arriving one by one: each step weighs every mind of the engine.
    crowd = Scenario(
        engines=(EngineScenario("e", 4, 1),),
        minds=tuple(MindScenario(f"m{i}", "e", arrive=i * 0.001) for i in range(2_000)),
    )
    with pytest.raises(ScenarioTooLarge, match=r"bound of 100,000 minds and slots weighed"):
        simulate(_with(crowd, SimulationBounds(allocator_work=100_000)))


def test_the_examples_run_far_inside_the_default_bounds() -> None:
    examples = ROOT / "examples" / "scenarios"
    for path in sorted(examples.glob("*.yaml")):
        result = simulate(load(path))
        assert result.events < SimulationBounds().events // 100, path


def _with(s: Scenario, bounds: SimulationBounds) -> Scenario:
    return replace(s, bounds=bounds)
