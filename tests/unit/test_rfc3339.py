"""RFC 3339 times have one home (`core.rfc3339`): what each writer prints, what `parse` reads, and
that no other module of the package formats or parses them by itself."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from continuum_operator.core import rfc3339
from tests.builders import ROOT

T = 1_764_784_800.123456  # 2025-12-03T18:00:00.123456Z

times = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)


def test_each_writer_prints_its_own_precision() -> None:
    assert rfc3339.format_seconds(T) == "2025-12-03T18:00:00Z"
    assert rfc3339.format_micro(T) == "2025-12-03T18:00:00.123456Z"
    assert rfc3339.format_exact(T) == "2025-12-03T18:00:00.123456Z"
    assert rfc3339.format_exact(1_764_784_800.0) == "2025-12-03T18:00:00.0Z"


def test_parse_reads_zulu_offsets_and_the_api_servers_times() -> None:
    assert rfc3339.parse("2025-12-03T18:00:00Z") == 1_764_784_800.0
    assert rfc3339.parse("2025-12-03T20:00:00+02:00") == 1_764_784_800.0
    assert rfc3339.parse("2025-12-03T18:00:00.500000Z") == 1_764_784_800.5


def test_parse_answers_none_for_anything_that_is_not_a_time() -> None:
    for value in (None, "", "yesterday", "2025-13-03T18:00:00Z", 1_764_784_800, b"x", ["t"]):
        assert rfc3339.parse(value) is None, value


@given(times)
def test_whole_seconds_and_microseconds_read_back_within_their_precision(t: float) -> None:
    seconds = rfc3339.parse(rfc3339.format_seconds(t))
    micro = rfc3339.parse(rfc3339.format_micro(t))
    # The fraction is dropped after rounding to the microsecond, as datetime rounds.
    assert seconds is not None and -1e-6 <= t - seconds < 1
    assert micro is not None and abs(micro - t) < 2e-6


@given(times)
def test_exact_times_read_back_as_the_same_float(t: float) -> None:
    assert rfc3339.parse_exact(rfc3339.format_exact(t)) == t
    assert rfc3339.parse(rfc3339.format_exact(t)) is not None


def test_parse_exact_refuses_what_format_exact_never_writes() -> None:
    for value in ("2025-12-03T18:00:00", "2025-12-03T18:00:00.1e3Z", "x", None, True):
        assert rfc3339.parse_exact(value) is None, value
    assert rfc3339.parse_exact(12) == 12.0  # journals once held Unix seconds


# Modules that still convert times themselves, each for a behaviour of its own.
OWN_BEHAVIOUR = {
    # The agent's clock hands it a datetime, not Unix seconds.
    "agent/writer.py",
    # The gateway's grant table: a bad time is an error naming where, a naive time is UTC.
    "engine/admission.py",
    # The gateway's log and report times in milliseconds.
    "engine/gateway.py",
}


def test_no_other_module_formats_or_parses_rfc3339_by_itself() -> None:
    package = ROOT / "operator" / "continuum_operator"
    converting = re.compile(r"strftime\(|fromisoformat\(|isoformat\(|time\.gmtime\(")
    found = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if converting.search(path.read_text())
    }
    assert found - {"core/rfc3339.py"} <= OWN_BEHAVIOUR, "use continuum_operator.core.rfc3339"
