"""RFC 3339 times have one home (`core.rfc3339`): what each writer prints, what `parse` reads, and
that no other module of the package formats or parses them by itself."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta, timezone

from hypothesis import given
from hypothesis import strategies as st

from continuum_operator.core import rfc3339
from tests.support.builders import ROOT

T = 1_764_784_800.123456  # 2025-12-03T18:00:00.123456Z

times = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)


def test_each_writer_prints_its_own_precision() -> None:
    assert rfc3339.format_seconds(T) == "2025-12-03T18:00:00Z"
    assert rfc3339.format_micro(T) == "2025-12-03T18:00:00.123456Z"
    assert rfc3339.format_exact(T) == "2025-12-03T18:00:00.123456Z"
    assert rfc3339.format_exact(1_764_784_800.0) == "2025-12-03T18:00:00.0Z"
    assert rfc3339.format_milli(T) == "2025-12-03T18:00:00.123Z"
    assert rfc3339.format_milli(1_764_784_800.0) == "2025-12-03T18:00:00.000Z"
    assert rfc3339.format_isoformat(T) == "2025-12-03T18:00:00.123456Z"
    assert rfc3339.format_isoformat(1_764_784_800.0) == "2025-12-03T18:00:00Z"
    assert rfc3339.format_isoformat(1_764_784_800.5) == "2025-12-03T18:00:00.500000Z"


def test_a_datetime_is_written_at_its_instant_in_utc() -> None:
    """The agent's clock hands `format_micro` a datetime: its instant, whatever its zone."""
    at = datetime(2025, 12, 3, 18, 0, 0, 123456, tzinfo=UTC)
    assert rfc3339.format_micro(at) == "2025-12-03T18:00:00.123456Z"
    east = at.astimezone(timezone(timedelta(hours=2)))
    assert rfc3339.format_micro(east) == "2025-12-03T18:00:00.123456Z"
    naive = datetime(2025, 12, 3, 18, 0, 0)  # taken as local time, as `astimezone` takes it
    assert rfc3339.format_micro(naive) == rfc3339.format_micro(naive.timestamp())


@given(times)
def test_the_writers_print_what_their_modules_once_printed_themselves(t: float) -> None:
    at = datetime.fromtimestamp(t, UTC)
    # engine/gateway.py's log and report times, engine/admission.py's grant table.
    assert rfc3339.format_milli(t) == at.isoformat(timespec="milliseconds").replace("+00:00", "Z")
    assert rfc3339.format_isoformat(t) == at.isoformat().replace("+00:00", "Z")
    # agent/writer.py's Lease times, from its datetime clock.
    assert rfc3339.format_micro(at) == at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    assert rfc3339.format_micro(at) == rfc3339.format_micro(t)


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
    # A grant entry's deadline is read strictly: a bad time is an error naming where, and a
    # naive time is UTC (`parse` answers None, and takes a naive one as local time).
    "model/grant.py",
    # The gateway's grant table writes its times through `rfc3339.format_isoformat` (the
    # pattern's false positive, kept named).
    "engine/admission.py",
    # A runtime report's `lastExit.at` is read only as engine/runtime.py writes it (whole
    # seconds, `Z`): anything else is no exit time.
    "kube/engines/runtime_report.py",
}


def test_no_other_module_formats_or_parses_rfc3339_by_itself() -> None:
    package = ROOT / "operator" / "continuum_operator"
    converting = re.compile(r"strftime\(|strptime\(|fromisoformat\(|isoformat\(|gmtime\(|timegm\(")
    found = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if converting.search(path.read_text())
    }
    assert found - {"core/rfc3339.py"} <= OWN_BEHAVIOUR, "use continuum_operator.core.rfc3339"
