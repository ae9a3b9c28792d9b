"""metric_families: a MetricSet's declared families are created on its registry, in order."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from continuum_operator.metric_families import Family, MetricSet, counter, gauge, histogram


@dataclass
class _Set(MetricSet):
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    first = gauge("t_first", "First.", ["a"])
    second = counter("t_second", "Second.", ["reason"], present=[["x"], ["y"]])
    third = histogram("t_third", "Third.", ["a"], buckets=(1.0, 2.0))


def test_families_are_created_on_the_registry_in_declaration_order() -> None:
    s = _Set()
    assert isinstance(s.first, Gauge)
    assert isinstance(s.second, Counter)
    assert isinstance(s.third, Histogram)
    assert [f.name for f in s.registry.collect()] == ["t_first", "t_second", "t_third"]
    assert s.third._upper_bounds == [1.0, 2.0, float("inf")]


def test_present_series_exist_at_zero_from_the_start() -> None:
    s = _Set()
    assert s.registry.get_sample_value("t_second_total", {"reason": "x"}) == 0.0
    assert s.registry.get_sample_value("t_second_total", {"reason": "y"}) == 0.0
    assert s.registry.get_sample_value("t_first", {"a": "x"}) is None


def test_each_set_has_its_own_families() -> None:
    one, two = _Set(), _Set()
    one.first.labels("x").set(3)
    assert two.registry.get_sample_value("t_first", {"a": "x"}) is None
    assert isinstance(_Set.__dict__["first"], Family)


def test_reading_a_family_before_it_is_declared_says_so() -> None:
    class Bare:
        family = gauge("t_bare", "Bare.")

    with pytest.raises(AttributeError, match=r"Bare\.family"):
        _ = Bare().family
