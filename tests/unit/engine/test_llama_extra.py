"""The `llama` extra pins the llama-cpp-python that tools/versions builds, and nothing else."""

from __future__ import annotations

import tomllib

from tests.support.builders import ROOT


def _versions() -> dict[str, str]:
    lines = (ROOT / "tools" / "versions").read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def test_the_llama_extra_pins_the_version_tools_versions_builds() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["llama"]
    assert extra == [f"llama-cpp-python=={_versions()['LLAMA_CPP_PYTHON_VERSION']}"]


def test_llama_cpp_python_is_only_an_extra() -> None:
    """The operator, the agent and `continuum plan` run without it; only the runtimes load it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.lower().startswith("llama")]
