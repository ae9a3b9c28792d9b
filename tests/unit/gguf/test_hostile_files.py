"""Hostile input files: each refused by `continuum` with exit 2 and a message, quickly and small.

GGUF headers that lie about their lengths and counts (an array of 2^60 entries in 100 bytes,
half a million empty strings, counts of 2^62, tensors whose data lies past the end, files cut
short) are refused by `continuum facts` within 1 s and 256 MiB: time and Python's allocations
measured in the process, and the whole command once more in a subprocess whose address space
is capped at 256 MiB. YAML that is not UTF-8, nested past any object, built of aliases or not a
mapping is refused by `continuum plan`.
"""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from continuum_operator import cli
from continuum_operator.testing import TinyModelShape, write_tiny_gguf
from tests.support.builders import ROOT

MiB = 2**20
SECONDS = 1.0
MEMORY_BYTES = 256 * MiB

# GGUF value types (gguf.GGUFValueType)
U32, STRING, ARRAY = 4, 8, 9


def _s(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _header(n_tensors: int, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv)


def _padded(data: bytes, size: int = 100) -> bytes:
    return data + b"\0" * max(0, size - len(data))


def array_of_2_60() -> bytes:
    return _padded(_header(0, 1) + _s("general.junk") + struct.pack("<IIQ", ARRAY, STRING, 2**60))


def half_a_million_empty_strings() -> bytes:
    n = 500_000
    return (
        _header(0, 1)
        + _s("tokenizer.ggml.tokens")
        + struct.pack("<IIQ", ARRAY, STRING, n)
        + (struct.pack("<Q", 0) * n)
    )


def half_a_million_empty_strings_kept_key() -> bytes:
    n = 500_000
    arch = _s("general.architecture") + struct.pack("<I", STRING) + _s("llama")
    junk = _s("general.junk") + struct.pack("<IIQ", ARRAY, STRING, n) + struct.pack("<Q", 0) * n
    return _header(0, 2) + arch + junk


def huge_tensor_count() -> bytes:
    return _padded(_header(2**62, 0))


def huge_kv_count() -> bytes:
    return _padded(_header(0, 2**62))


def huge_string_length() -> bytes:
    return _padded(_header(0, 1) + struct.pack("<Q", 2**62))


def tensor_past_the_end() -> bytes:
    info = _s("blk.0.attn_q.weight") + struct.pack("<IQQIQ", 2, 2**32, 2**32, 1, 0)
    return _padded(_header(1, 0) + info)


def nested_arrays() -> bytes:
    return _padded(_header(0, 1) + _s("general.junk") + struct.pack("<IIQ", ARRAY, ARRAY, 1))


def huge_block_count() -> bytes:
    arch = _s("general.architecture") + struct.pack("<I", STRING) + _s("llama")
    block = _s("llama.block_count") + struct.pack("<IQ", 10, 2**62)  # UINT64
    return _padded(_header(0, 2) + arch + block)


HOSTILE: dict[str, Callable[[], bytes]] = {
    "an array of 2^60 entries in 100 bytes": array_of_2_60,
    "500k empty vocabulary strings": half_a_million_empty_strings,
    "500k empty strings under another key": half_a_million_empty_strings_kept_key,
    "2^62 tensors": huge_tensor_count,
    "2^62 key-values": huge_kv_count,
    "a key of 2^62 bytes": huge_string_length,
    "a tensor of 2^64 elements": tensor_past_the_end,
    "an array of arrays": nested_arrays,
    "2^62 layers": huge_block_count,
    "an empty file": lambda: b"",
    "not GGUF": lambda: b"PK\x03\x04" + b"\0" * 96,
}


def _tiny(tmp_path: Path) -> bytes:
    return write_tiny_gguf(tmp_path / "whole.gguf", TinyModelShape(n_layer=2)).read_bytes()


def _write_hostile(tmp_path: Path) -> dict[str, Path]:
    files: dict[str, Path] = {}
    for i, (name, build) in enumerate(HOSTILE.items()):
        files[name] = tmp_path / f"hostile-{i}.gguf"
        files[name].write_bytes(build())
    whole = _tiny(tmp_path)
    # Cut inside the fixed header, the key-values, the tensor index and the tensor data.
    for cut in (3, 20, 200, len(whole) // 3, len(whole) - 1):
        files[f"cut at byte {cut}"] = tmp_path / f"cut-{cut}.gguf"
        files[f"cut at byte {cut}"].write_bytes(whole[:cut])
    return files


def _measured(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, float, int]:
    """Exit code, stderr, seconds and peak Python allocation of `continuum facts PATH`.

    Timed without tracemalloc (which slows every allocation several times), then run again
    under it for the peak."""
    start = time.perf_counter()
    code = cli.main(["facts", str(path)])
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    tracemalloc.start()
    try:
        assert cli.main(["facts", str(path)]) == code
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    capsys.readouterr()
    return code, err, seconds, peak


def test_every_hostile_gguf_is_refused_with_exit_2_within_a_second_and_256_mib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, path in _write_hostile(tmp_path).items():
        code, err, seconds, peak = _measured(path, capsys)
        assert code == 2, name
        assert err.startswith(f"error: {path}"), (name, err)
        assert "Traceback" not in err, name
        assert seconds < SECONDS, (name, seconds)
        assert peak < MEMORY_BYTES, (name, peak)


def test_the_refusals_say_what_the_header_claims_against_what_the_file_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _write_hostile(tmp_path)
    said = {}
    for name, path in files.items():
        assert cli.main(["facts", str(path)]) == 2
        said[name] = capsys.readouterr().err
    assert "1152921504606846976 claimed" in said["an array of 2^60 entries in 100 bytes"]
    assert "bytes are left in the file" in said["2^62 tensors"]
    assert "ends past the end of the file" in said["a tensor of 2^64 elements"]
    assert "array of arrays" in said["an array of arrays"]
    assert "block_count is 4611686018427387904" in said["2^62 layers"]
    assert "truncated" in said["cut at byte 20"]


def test_a_whole_model_beside_them_is_still_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ok.gguf"
    path.write_bytes(_tiny(tmp_path))
    assert cli.main(["facts", str(path), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == 2


_CHILD = """
import json, sys
from continuum_operator import cli
codes = {}
for path in sys.argv[1:]:
    codes[path] = cli.main(["facts", path])
print(json.dumps(codes))
"""


def test_continuum_facts_refuses_them_all_in_a_process_capped_at_256_mib(tmp_path: Path) -> None:
    files = _write_hostile(tmp_path)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
        resource.setrlimit(resource.RLIMIT_CPU, (60, 60))

    done = subprocess.run(
        [sys.executable, "-c", _CHILD, *map(str, files.values())],
        preexec_fn=cap,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == {str(p): 2 for p in files.values()}


# --- YAML given to `continuum plan` ------------------------------------------------------------

BAD_YAML: dict[str, tuple[bytes, str]] = {
    "not UTF-8": (b'kind: Engine\nname: "\xff\xfe"\n', "not UTF-8 text: byte 20"),
    "nested 100,000 deep": (b"[" * 100_000 + b"]" * 100_000, "nested deeper than 100 levels"),
    "a mapping nested 5,000 deep": (b"{a: " * 5000 + b"1" + b"}" * 5000, "nested deeper"),
    "aliases (billion laughs)": (
        b'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
        b"b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n",
        "aliases (*name) are not read",
    ),
    "a list": (b"- 1\n- 2\n", "expected a mapping (a Kubernetes object), got list"),
    "a string": (b'"just a string"\n', "expected a mapping (a Kubernetes object), got str"),
    "not YAML": (b"kind: [unclosed\n", "not valid YAML"),
}


EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize("case", BAD_YAML)
@pytest.mark.parametrize("flag", ["--board", "--engine", "--lease"])
def test_a_bad_yaml_file_to_continuum_plan_is_exit_2_with_a_message(
    case: str, flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, message = BAD_YAML[case]
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    files = {
        "--board": EXAMPLES / "boards" / "h200-discrete.yaml",
        "--engine": EXAMPLES / "engines" / "coder-8b.yaml",
        flag: bad,
    }
    assert cli.main(["plan"] + [a for f, p in files.items() for a in (f, str(p))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {bad}: "), err
    assert message in err, err


@pytest.mark.parametrize("case", ["not UTF-8", "aliases (billion laughs)", "nested 100,000 deep"])
def test_a_bad_scenario_or_receipt_file_is_exit_2_with_a_message(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    content, message = BAD_YAML[case]
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    assert cli.main(["simulate", str(bad)]) == 2
    assert message in capsys.readouterr().err
    files = {"--board": EXAMPLES / "boards" / "h200-discrete.yaml",
             "--engine": EXAMPLES / "engines" / "coder-8b.yaml", "--receipt": bad}  # fmt: skip
    assert cli.main(["plan"] + [a for f, p in files.items() for a in (f, str(p))]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("case", ["not UTF-8", "aliases (billion laughs)", "nested 100,000 deep"])
def test_a_bad_grants_file_to_continuum_engine_is_a_grant_table_error_with_a_message(
    case: str, tmp_path: Path
) -> None:
    from continuum_operator.engine.admission import GrantTableError
    from continuum_operator.engine.grants_source import read_table_file

    content, message = BAD_YAML[case]
    bad = tmp_path / "grants.yaml"
    bad.write_bytes(content)
    with pytest.raises(GrantTableError) as refused:
        read_table_file(bad)
    assert str(refused.value).startswith(f"{bad}: ") and message in str(refused.value)
