"""The container images' Dockerfiles (images/): no builder runs here, so they are checked by
reading them: pinned bases, a non-root user that matches the chart's security context, an
entrypoint whose subcommands `continuum` really has, sources that exist, the llama.cpp source
the tests build, and image names the chart and the operator agree on."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from continuum_operator.cli import build_parser
from continuum_operator.kube.base.settings import PodSettings
from tests.support.builders import ROOT
from tests.support.helm import CHART

IMAGES = ROOT / "images"
NAMES = ("operator", "agent", "engine")


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Dockerfile:
    args: dict[str, str]  # ARGs before the first FROM, with their defaults
    stages: list[Stage]

    def final(self, keyword: str) -> list[str]:
        return [v for k, v in self.stages[-1].instructions if k == keyword]


def parse(path: Path) -> Dockerfile:
    """Instructions with their continuation lines joined; comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, f"{path}: a continuation runs off the end"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert keyword == "ARG", f"{path}: {keyword} before the first FROM"
            key, _, default = rest.partition("=")
            args[key] = default.strip('"')
        else:
            stages[-1].instructions.append((keyword, rest))
    return Dockerfile(args, stages)


def resolve(image: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)


@pytest.fixture(params=NAMES)
def dockerfile(request: pytest.FixtureRequest) -> tuple[str, Dockerfile]:
    name: str = request.param
    return name, parse(IMAGES / name / "Dockerfile")


def test_every_base_image_is_pinned_to_a_tag(dockerfile: tuple[str, Dockerfile]) -> None:
    name, df = dockerfile
    stage_names = {s.name for s in df.stages if s.name}
    for stage in df.stages:
        base = resolve(stage.base, df.args)
        if base in stage_names:
            continue
        assert ":" in base and not base.endswith(":latest"), f"{name}: FROM {base}"


def test_the_final_stage_runs_as_the_charts_non_root_user(
    dockerfile: tuple[str, Dockerfile],
) -> None:
    name, df = dockerfile
    users = df.final("USER")
    assert users, f"{name}: no USER in the final stage"
    uid, _, gid = users[-1].partition(":")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    if name in {"operator", "agent"}:  # the engine's pod is the operator's to build
        ctx = values[name]["podSecurityContext"]
        assert (int(uid), int(gid)) == (ctx["runAsUser"], ctx["runAsGroup"])
    assert int(uid) != 0


def test_the_entrypoint_is_continuum_and_its_command_a_real_subcommand(
    dockerfile: tuple[str, Dockerfile],
) -> None:
    name, df = dockerfile
    entrypoint = json.loads(df.final("ENTRYPOINT")[-1])  # exec form: signals reach continuum
    assert entrypoint == ["continuum"]
    cmd = json.loads(df.final("CMD")[-1])
    assert cmd[0] == name
    if "--help" not in cmd:
        args = build_parser().parse_args(cmd)
        assert args.command == name


def test_copied_sources_exist_and_pass_the_images_dockerignore(
    dockerfile: tuple[str, Dockerfile],
) -> None:
    name, df = dockerfile
    ignore = (IMAGES / name / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for stage in df.stages:
        for keyword, rest in stage.instructions:
            if keyword != "COPY" or rest.startswith("--from"):
                continue
            *sources, _dest = shlex.split(rest)
            for source in sources:
                assert (ROOT / source).exists(), f"{name}: COPY {source}: not in the repository"
                assert source.rstrip("/") in allowed, f"{name}: {source} is dockerignored"


def test_the_engine_builds_llama_server_from_the_source_the_tests_use() -> None:
    df = parse(IMAGES / "engine" / "Dockerfile")
    versions = dict(
        line.split("=", 1)
        for line in (ROOT / "tools" / "versions").read_text().splitlines()
        if "=" in line and not line.startswith("#")
    )
    assert df.args["LLAMA_CPP_PYTHON_VERSION"] == versions["LLAMA_CPP_PYTHON_VERSION"]
    runs = " ".join(v for s in df.stages for k, v in s.instructions if k == "RUN")
    assert "--target llama-server" in runs
    assert "-DLLAMA_BUILD_SERVER=ON" in runs
    copies = df.final("COPY")
    # llama-server with its libraries and backend modules, /out whole (below).
    assert "--from=llama-built /out/ /opt/llama/" in copies
    # The operator runs `continuum engine ...` and `continuum facts ...` as the pod's command.
    env = " ".join(df.final("ENV"))
    assert "PATH=/opt/continuum/bin" in env


def test_the_cuda_engine_image_can_run_an_engine_with_no_driver_library() -> None:
    """An engine placed on the CPU runs with NVIDIA_VISIBLE_DEVICES=void: no libcuda.so.1 in its
    container. The vendored ggml-cuda links it unless GGML_CUDA_NO_VMM, so llama-server loads
    its backends as modules (GGML_BACKEND_DL, which needs BUILD_SHARED_LIBS; the CPU's variants
    with GGML_CPU_ALL_VARIANTS, which needs GGML_BACKEND_DL), as llama.cpp's own
    .devops/cuda.Dockerfile does; the lanes' binding does without VMM. Shown on a GPU by
    tools/device_check.py, not here."""
    df = parse(IMAGES / "engine" / "Dockerfile")
    runs = [v for s in df.stages for k, v in s.instructions if k == "RUN"]
    [server] = [r for r in runs if "--target llama-server" in r]
    for flag in ("-DGGML_BACKEND_DL=ON", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF"):
        assert flag in server, flag
    assert '-DGGML_CPU_ALL_VARIANTS="${GGML_CPU_ALL_VARIANTS}"' in server
    llama = next(s for s in df.stages if s.name == "llama")
    defaults = dict(v.split("=", 1) for k, v in llama.instructions if k == "ARG" and "=" in v)
    assert defaults["GGML_CPU_ALL_VARIANTS"] == "ON" and defaults["GGML_CUDA"] == "ON"
    # The libraries and backend modules travel with llama-server, found by $ORIGIN.
    assert "-DCMAKE_INSTALL_RPATH='$ORIGIN'" in server and "-name '*.so*'" in server
    [wheel] = [r for r in runs if "pip wheel" in r]
    assert "-DGGML_CUDA_NO_VMM=ON" in wheel
    assert "/opt/llama/llama-server /usr/local/bin/llama-server" in " ".join(df.final("RUN"))


def test_the_cuda_toolkit_has_every_architecture_the_image_asks_for() -> None:
    """CUDA 12.9 for 121a (GB10) and 12.8 for 120a (Blackwell), as the vendored
    ggml/src/ggml-cuda/CMakeLists.txt adds them; the build and the runtime bases agree."""
    df = parse(IMAGES / "engine" / "Dockerfile")
    llama = next(s for s in df.stages if s.name == "llama")
    archs = (
        dict(v.split("=", 1) for k, v in llama.instructions if k == "ARG" and "=" in v)[
            "CUDA_ARCHITECTURES"
        ]
        .strip('"')
        .split(";")
    )
    assert {"90-real", "120a-real", "121a-real"} <= set(archs)
    versions = {
        name: tuple(int(n) for n in re.search(r"cuda:(\d+)\.(\d+)", df.args[name]).groups())  # type: ignore[union-attr]
        for name in ("BUILD_BASE", "BASE")
    }
    assert versions["BUILD_BASE"] == versions["BASE"] >= (12, 9), versions


def test_the_chart_and_the_operator_name_the_same_engine_image() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    engine = values["images"]["engine"]
    rendered = f"{engine['repository']}:{engine['tag'] or chart['appVersion']}"
    assert rendered == PodSettings().image
    for name in NAMES:
        assert values["images"][name]["repository"].endswith(f"/continuum-{name}")
