"""`continuum plan` from the outside: exit codes, output formats, leases, and bad input.

Every malformed file exits 2 with one message naming the file and the exact field path
(docs/design.md rule 9). The cases start from the example files and change one thing each.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from continuum_operator.cli import main
from continuum_operator.cli.errors import EXIT_INVALID, EXIT_OK, EXIT_UNSCHEDULABLE
from tests.support.builders import ROOT

EXAMPLES = ROOT / "examples"
BOARDS = sorted((EXAMPLES / "boards").glob("*.yaml"))
ENGINES = sorted((EXAMPLES / "engines").glob("*.yaml"))
M5 = EXAMPLES / "boards" / "m5-unified.yaml"
L4X2 = EXAMPLES / "boards" / "l4x2-discrete.yaml"
AGENT = EXAMPLES / "engines" / "agent-32b.yaml"
GiB = 2**30

# Pairs of examples that are valid but cannot be planned (exit 3). Every example board serves
# every example engine, if only with layers on the host, except llama-405b-f16, which fits no
# board on purpose: it shows an Engine saying why (make demo).
UNSCHEDULABLE_EXAMPLES: frozenset[tuple[str, str]] = frozenset(
    (b.stem, "llama-405b-f16") for b in BOARDS
)

Doc = dict[str, Any]
Mutation = Callable[[Doc], None]


def _load(path: Path) -> Doc:
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc, dict)
    return doc


def _steps(path: str) -> list[str | int]:
    return [int(i) if i else k for k, i in re.findall(r"([^.\[\]]+)|\[(\d+)\]", path)]


def _parent(doc: Any, path: str) -> tuple[Any, str | int]:
    *head, last = _steps(path)
    for step in head:
        doc = doc[step]
    return doc, last


def put(path: str, value: Any) -> Mutation:
    def mutate(doc: Doc) -> None:
        parent, last = _parent(doc, path)
        parent[last] = value

    return mutate


def drop(path: str) -> Mutation:
    def mutate(doc: Doc) -> None:
        parent, last = _parent(doc, path)
        del parent[last]

    return mutate


def append(path: str, value: Any) -> Mutation:
    def mutate(doc: Doc) -> None:
        parent, last = _parent(doc, path)
        parent[last].append(value)

    return mutate


def rename(path: str, new: str) -> Mutation:
    def mutate(doc: Doc) -> None:
        parent, last = _parent(doc, path)
        parent[new] = parent.pop(last)

    return mutate


def _with_placement(node: str, pools: list[Doc], name: str = "other") -> Doc:
    """An Engine already placed on `node`: its status.placement is its lease."""
    doc = _load(AGENT)
    doc["metadata"]["name"] = name
    doc["status"] = {"placement": {"node": node, "pools": pools}}
    return doc


@dataclass(frozen=True)
class Bad:
    """One malformed input: which file, how it differs, and what the error must name."""

    id: str
    target: str  # "board", "engine" or "lease"
    field: str | None  # the exact field path; None when the file as a whole is wrong
    says: str  # a piece of the problem as stated
    base: Path | None = None  # the example the file starts from; the target's default if None
    mutate: Mutation | None = None
    text: str | None = None  # the file's whole text instead of a mutated example
    absent: bool = False  # the file does not exist


CASES = [
    # Sizes.
    Bad("a_negative_layer_size", "engine", "spec.model.facts.layerBytes",
        "between 0 and 2^62", mutate=put("spec.model.facts.layerBytes", -1)),
    Bad("a_layer_size_past_int64", "engine", "spec.model.facts.layerBytes",
        "between 0 and 2^62", mutate=put("spec.model.facts.layerBytes", 2**63)),
    Bad("a_negative_entry_in_a_per_layer_list", "engine", "spec.model.facts.layerBytes",
        "entry [5] is -1", mutate=put("spec.model.facts.layerBytes", [1] * 5 + [-1] + [1] * 58)),
    Bad("a_negative_pool_capacity", "board", "status.pools[0].capacityBytes",
        "greater than or equal to 0", mutate=put("status.pools[0].capacityBytes", -5)),
    Bad("a_per_process_cap_past_int64", "board", "status.perProcessCapBytes",
        "less than or equal to", mutate=put("status.perProcessCapBytes", 2**63)),
    Bad("a_negative_context", "engine", "spec.contextTokensPerMind",
        "greater than or equal to 16", mutate=put("spec.contextTokensPerMind", -6144)),
    Bad("zero_gpus", "engine", "spec.placement.gpus",
        "greater than or equal to 1", mutate=put("spec.placement", {"gpus": 0})),
    # Cross-field rules.
    Bad("minds_min_above_minds_max", "engine", "spec.minds",
        "min (5) must not exceed max (2)", mutate=put("spec.minds", {"min": 5, "max": 2})),
    Bad("minds_min_zero", "engine", "spec.minds.min",
        "greater than or equal to 1", mutate=put("spec.minds.min", 0)),
    Bad("a_layer_list_shorter_than_layers", "engine", "spec.model.facts.layerBytes",
        "lists 3 layers but layers is 64", mutate=put("spec.model.facts.layerBytes", [1, 2, 3])),
    Bad("a_kv_list_longer_than_layers", "engine", "spec.model.facts.kvBytesPerTokenPerLayer",
        "lists 65 layers but layers is 64",
        mutate=put("spec.model.facts.kvBytesPerTokenPerLayer", [4096] * 65)),
    Bad("a_unified_board_with_two_pools", "board", "status.pools",
        "exactly one pool of kind `unified`",
        mutate=append("status.pools", {"kind": "unified", "capacityBytes": GiB})),
    Bad("a_unified_board_with_a_host_pool", "board", "status.pools",
        "got [host]", mutate=put("status.pools[0].kind", "host")),
    Bad("a_discrete_board_without_a_device_pool", "board", "status.pools",
        "one `device` pool per GPU; got [host]", base=L4X2,
        mutate=put("status.pools", [{"kind": "host", "capacityBytes": 64 * GiB}])),
    Bad("a_device_pool_without_device", "board", "status.pools[1].device",
        "needs `device`", base=L4X2, mutate=drop("status.pools[1].device")),
    Bad("two_device_pools_on_one_gpu", "board", "status.pools",
        "repeat a GPU index", base=L4X2, mutate=put("status.pools[2].device", 0)),
    Bad("used_bytes_above_capacity", "board", "status.pools[2].usedBytes",
        "exceeds capacityBytes", base=L4X2, mutate=put("status.pools[2].usedBytes", 10**12)),
    Bad("coherent_on_a_host_pool", "board", "status.pools[0].coherent",
        "device pools only", base=L4X2, mutate=put("status.pools[0].coherent", True)),
    Bad("an_unknown_board_with_device_pools", "board", "status.pools",
        "governs only a `host` pool", base=L4X2, mutate=put("status.memoryMode", "unknown")),
    Bad("neither_facts_nor_source", "engine", "spec.model",
        "give the model's `facts` inline", mutate=put("spec.model", {})),
    Bad("a_source_without_facts_offline", "engine", "spec.model.facts",
        "continuum facts", mutate=put("spec.model",
                                      {"source": {"kind": "hostPath", "path": "/m/a.gguf"}})),
    # Words.
    Bad("offload_most", "engine", "spec.offload",
        "'auto', 'all' or 'none'", mutate=put("spec.offload", "most")),
    Bad("a_negative_offload", "engine", "spec.offload",
        "greater than or equal to 0 (got -1)", mutate=put("spec.offload", -1)),
    Bad("kv_cache_type_q5", "engine", "spec.kvCacheType",
        '(got "q5")', mutate=put("spec.kvCacheType", "q5")),
    Bad("memory_mode_hybrid", "board", "status.memoryMode",
        "'unified', 'discrete' or 'unknown'", mutate=put("status.memoryMode", "hybrid")),
    Bad("a_board_of_kind_engine", "board", "kind",
        "expected kind NodeBoard, got 'Engine'", mutate=put("kind", "Engine")),
    Bad("an_embed_lane_given_as_the_board", "board", "kind",
        "expected kind NodeBoard, got 'EmbedLane'", mutate=put("kind", "EmbedLane")),
    Bad("an_engine_of_kind_nodeboard", "engine", "kind",
        "expected kind Engine", mutate=put("kind", "NodeBoard")),
    Bad("another_api_version", "engine", "apiVersion",
        "continuum.dev/v1alpha1", mutate=put("apiVersion", "continuum.dev/v1")),
    Bad("an_uppercase_node_name", "board", "metadata.name",
        "should match pattern", mutate=put("metadata.name", "M5_Studio")),
    # Typos: unknown fields are refused, never ignored.
    Bad("a_typo_in_a_spec_field", "engine", "spec.contextTokensPerMine",
        "unknown field", mutate=put("spec.contextTokensPerMine", 4096)),
    Bad("a_typo_in_an_optional_field", "engine", "spec.reserveByte",
        "unknown field", mutate=put("spec.reserveByte", GiB)),
    Bad("a_typo_in_a_pool_field", "board", "status.pools[0].usedByte",
        "unknown field", mutate=rename("status.pools[0].usedBytes", "usedByte")),
    Bad("a_typo_in_status", "board", "stauts",
        "unknown field", mutate=rename("status", "stauts")),
    Bad("a_missing_context", "engine", "spec.contextTokensPerMind",
        "required field is missing", mutate=drop("spec.contextTokensPerMind")),
    # Types: as the API server reads them, a quoted number is a string.
    Bad("a_word_for_an_integer", "engine", "spec.contextTokensPerMind",
        "valid integer", mutate=put("spec.contextTokensPerMind", "lots")),
    Bad("a_quoted_number_for_an_integer", "engine", "spec.contextTokensPerMind",
        'valid integer (got "6144")', mutate=put("spec.contextTokensPerMind", "6144")),
    Bad("a_boolean_for_an_integer", "engine", "spec.contextTokensPerMind",
        "valid integer (got true)", mutate=put("spec.contextTokensPerMind", True)),
    Bad("a_quantity_for_bytes", "board", "status.pools[0].capacityBytes",
        'valid integer (got "56Gi")', mutate=put("status.pools[0].capacityBytes", "56Gi")),
    Bad("a_word_for_per_layer_bytes", "engine", "spec.model.facts.layerBytes",
        "valid integer, or input should be a valid array",
        mutate=put("spec.model.facts.layerBytes", "big")),
    Bad("a_word_inside_a_per_layer_list", "engine", "spec.model.facts.layerBytes[63]",
        'valid integer (got "x")', mutate=put("spec.model.facts.layerBytes", [1] * 63 + ["x"])),
    Bad("a_word_for_minds", "engine", "spec.minds",
        "object", mutate=put("spec.minds", "four")),
    Bad("pools_as_a_mapping", "board", "status.pools",
        "valid array", mutate=put("status.pools", {"kind": "unified"})),
    # Leases are Engines too, checked the same way.
    Bad("a_lease_on_a_pool_with_a_bad_name", "lease", "status.placement.pools[0].pool",
        "should match pattern", text=yaml.safe_dump(
            _with_placement("m5-studio", [{"pool": "gpu/0", "bytes": GiB}]))),
    # Files that are not one object.
    Bad("a_file_that_is_not_yaml", "board", None, "not valid YAML", text="kind: [open\n  : :\n"),
    Bad("a_file_that_does_not_exist", "engine", None, "cannot read the file", absent=True),
    Bad("two_objects_in_one_file", "board", None, "expected one object, found 2",
        text=M5.read_text() + "\n---\n" + M5.read_text()),
    Bad("a_file_that_is_a_list", "board", None, "expected a mapping (a Kubernetes object)",
        text=yaml.safe_dump([_load(M5)])),
    Bad("an_empty_file", "engine", None, "expected one object, found 0", text=""),
    Bad("a_file_that_is_one_word", "engine", None, "got str", text="agent-32b\n"),
]  # fmt: skip


def _plan(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, str, str]:
    code = main(["plan", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_there_are_at_least_twenty_malformed_cases_each_named_once() -> None:
    assert len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_malformed_file_exits_2_naming_the_file_and_the_field(
    case: Bad, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    default = {"board": M5, "engine": AGENT, "lease": AGENT}[case.target]
    bad = tmp_path / f"{case.target}.yaml"
    if case.text is not None:
        bad.write_text(case.text)
    elif not case.absent:
        doc = copy.deepcopy(_load(case.base or default))
        assert case.mutate is not None
        case.mutate(doc)
        bad.write_text(yaml.safe_dump(doc, sort_keys=False))
    files = {"board": M5, "engine": AGENT, case.target: bad}
    leases: list[str | Path] = ["--lease", bad] if case.target == "lease" else []

    code, out, err = _plan(
        capsys, "--board", files["board"], "--engine", files["engine"], *leases, "-o", "json"
    )

    assert code == EXIT_INVALID, err
    assert out == ""
    where = f"error: {bad}: {case.field}: " if case.field else f"error: {bad}: "
    assert where in err, err
    assert case.says in err, err
    assert len(err.strip().splitlines()) == 1 or case.id == "a_file_that_is_not_yaml", err


def test_a_problem_in_one_field_names_that_field_not_its_neighbour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _load(AGENT)
    doc["spec"]["minds"]["max"] = "many"
    bad = tmp_path / "engine.yaml"
    bad.write_text(yaml.safe_dump(doc))

    code, _, err = _plan(capsys, "--board", M5, "--engine", bad)

    assert code == EXIT_INVALID
    assert f"{bad}: spec.minds.max: " in err
    assert "spec.minds.min" not in err


@pytest.mark.parametrize("board", BOARDS, ids=[b.stem for b in BOARDS])
@pytest.mark.parametrize("engine", ENGINES, ids=[e.stem for e in ENGINES])
def test_every_example_pair_plans_or_is_refused_with_reasons(
    board: Path, engine: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _plan(capsys, "--board", board, "--engine", engine, "-o", "json")

    doc = json.loads(out)
    if (board.stem, engine.stem) in UNSCHEDULABLE_EXAMPLES:
        assert code == EXIT_UNSCHEDULABLE
        assert doc["schedulable"] is False
        assert "unschedulable: " in err
    else:
        assert code == EXIT_OK, err
        assert err == ""
        assert doc["schedulable"] is True
        assert doc["node"] == _load(board)["metadata"]["name"]
        assert doc["mindsGrantable"] >= 1
        assert doc["poolTokens"] == doc["mindsGrantable"] * doc["contextTokensPerMind"]


def test_a_plan_that_cannot_fit_exits_3_with_its_reasons_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _load(AGENT)
    doc["spec"]["contextTokensPerMind"] = 1_000_000
    doc["spec"]["minds"] = {"min": 4, "max": 4}
    engine = tmp_path / "engine.yaml"
    engine.write_text(yaml.safe_dump(doc))

    code, out, err = _plan(capsys, "--board", M5, "--engine", engine, "-o", "json")

    assert code == EXIT_UNSCHEDULABLE
    assert json.loads(out)["schedulable"] is False
    assert "unschedulable: InsufficientMemory: " in err
    assert "spec.minds.min" in err  # says what to change


def test_asking_for_more_gpus_than_the_node_has_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _load(AGENT)
    doc["spec"]["placement"] = {"gpus": 4}
    engine = tmp_path / "engine.yaml"
    engine.write_text(yaml.safe_dump(doc))

    code, _, err = _plan(capsys, "--board", L4X2, "--engine", engine)

    assert code == EXIT_UNSCHEDULABLE
    assert "unschedulable: NotEnoughGpus: " in err


def test_yaml_output_is_the_same_object_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    _, as_json, _ = _plan(capsys, "--board", M5, "--engine", AGENT, "-o", "json")
    code, as_yaml, _ = _plan(capsys, "--board", M5, "--engine", AGENT, "-o", "yaml")

    assert code == EXIT_OK
    assert yaml.safe_load(as_yaml) == json.loads(as_json)


def test_table_output_reads_as_a_summary_for_people(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(capsys, "--board", L4X2, "--engine", AGENT, "-o", "table")

    assert code == EXIT_OK
    assert "Node:" in out and "gpu-l4-07" in out
    assert re.search(r"Layers on device:\s+\d+/65", out)
    assert re.search(r"^device\s+[\d,]+ MiB", out, re.MULTILINE)
    assert "Engine args: --n-gpu-layers" in out
    assert "Reasons:" in out


def test_table_is_the_default_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _plan(capsys, "--board", M5, "--engine", AGENT)

    assert code == EXIT_OK
    assert out.startswith("Node:")


def _plan_json(capsys: pytest.CaptureFixture[str], board: Path, *leases: Path) -> Doc:
    args = [a for lease in leases for a in ("--lease", lease)]
    code, out, err = _plan(capsys, "--board", board, "--engine", AGENT, *args, "-o", "json")
    assert code == EXIT_OK, err
    doc: Doc = json.loads(out)
    return doc


def _write(tmp_path: Path, name: str, *docs: Doc) -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def test_a_lease_on_the_same_unified_node_lowers_what_is_available(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Leased bytes count only past what is measured (available = capacity - max(leased, used)),
    # so the lease is larger than the pool's measured usage.
    lease = _write(
        tmp_path,
        "lease.yaml",
        _with_placement("m5-studio", [{"pool": "unified", "bytes": 30 * GiB}]),
    )

    alone = _plan_json(capsys, M5)
    leased = _plan_json(capsys, M5, lease)

    assert (leased["layersOnDevice"], leased["poolTokens"]) < (
        alone["layersOnDevice"],
        alone["poolTokens"],
    )
    assert leased["budget"]["shared"] < alone["budget"]["shared"]


def test_a_lease_on_a_gpu_of_the_same_discrete_node_lowers_the_layers_on_device(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lease = _write(
        tmp_path,
        "lease.yaml",
        _with_placement("gpu-l4-07", [{"pool": "device/0", "bytes": 20 * GiB}]),
    )

    alone = _plan_json(capsys, L4X2)
    leased = _plan_json(capsys, L4X2, lease)

    assert leased["layersOnDevice"] < alone["layersOnDevice"]
    assert leased["budget"]["device"] < alone["budget"]["device"]


def test_a_lease_on_a_different_node_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lease = _write(
        tmp_path,
        "lease.yaml",
        _with_placement("spark-01", [{"pool": "unified", "bytes": 30 * GiB}]),
        _with_placement("gpu-l4-08", [{"pool": "device/0", "bytes": 20 * GiB}], name="third"),
    )

    assert _plan_json(capsys, M5, lease) == _plan_json(capsys, M5)
    assert _plan_json(capsys, L4X2, lease) == _plan_json(capsys, L4X2)


def test_the_engine_s_own_lease_is_not_counted_against_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = _load(AGENT)["metadata"]["name"]
    lease = _write(
        tmp_path,
        "lease.yaml",
        _with_placement("m5-studio", [{"pool": "unified", "bytes": 30 * GiB}], name=me),
    )

    assert _plan_json(capsys, M5, lease) == _plan_json(capsys, M5)


def test_leases_may_come_as_a_kubectl_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    items = [_with_placement("m5-studio", [{"pool": "unified", "bytes": 30 * GiB}])]
    lease = _write(tmp_path, "lease.yaml", {"apiVersion": "v1", "kind": "List", "items": items})
    single = _write(tmp_path, "single.yaml", *items)

    assert _plan_json(capsys, M5, lease) == _plan_json(capsys, M5, single)
