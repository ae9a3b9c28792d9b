"""Prometheus metric families declared as data: one place that creates them on a registry.

Each component's metrics (`kube.base.metrics`, `kube.engines.pool_metrics`, `agent.metrics`,
`engine.metrics`, `embed.metrics`) is a `MetricSet`: a dataclass whose class attributes are
`Family` declarations (the family's type, name, help text, label names, for a histogram its
buckets, and the series present from the start). Building one creates every family it declares
on its `registry`, in the order the class lists them, which is the order `/metrics` lists them
in. Names stay written out whole, never assembled: they are what users scrape, and what
docs/metrics.md and docs/gateway.md list.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar, overload

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Family", "MetricSet", "counter", "declare", "gauge", "histogram"]

M = TypeVar("M", Counter, Gauge, Histogram)


class Family(Generic[M]):
    """One metric family, declared as a class attribute of a metrics holder.

    Reading it on a holder gives the family `declare` created on the holder's registry (stored
    on the instance, so later reads do not pass through here); on the class, the declaration.
    """

    def __init__(
        self,
        kind: Callable[..., M],
        name: str,
        documentation: str,
        labels: Sequence[str] = (),
        *,
        present: Iterable[Sequence[str]] = (),
        **options: Any,  # the type's own arguments: a histogram's `buckets`
    ) -> None:
        self.kind: Callable[..., M] = kind
        self.name = name
        self.documentation = documentation
        self.labels = tuple(labels)
        # Label values whose series exist from the start, at 0: a rate of them needs no absent
        # series (a labelled family shows no series until one is first used).
        self.present = tuple(tuple(values) for values in present)
        self.options = options
        self.attribute = ""

    def __set_name__(self, owner: type, attribute: str) -> None:
        self.attribute = attribute

    @overload
    def __get__(self, holder: None, owner: type) -> Family[M]: ...
    @overload
    def __get__(self, holder: object, owner: type) -> M: ...
    def __get__(self, holder: object | None, owner: type) -> Family[M] | M:
        if holder is None:
            return self
        raise AttributeError(f"{owner.__name__}.{self.attribute}: not declared on a registry yet")

    def create(self, registry: CollectorRegistry) -> M:
        family = self.kind(
            self.name, self.documentation, self.labels, registry=registry, **self.options
        )
        for values in self.present:
            family.labels(*values)
        return family


def counter(
    name: str,
    documentation: str,
    labels: Sequence[str] = (),
    *,
    present: Iterable[Sequence[str]] = (),
) -> Family[Counter]:
    return Family(Counter, name, documentation, labels, present=present)


def gauge(name: str, documentation: str, labels: Sequence[str] = ()) -> Family[Gauge]:
    return Family(Gauge, name, documentation, labels)


def histogram(
    name: str, documentation: str, labels: Sequence[str], *, buckets: Sequence[float]
) -> Family[Histogram]:
    return Family(Histogram, name, documentation, labels, buckets=buckets)


def declare(holder: object, registry: CollectorRegistry) -> None:
    """Create each `Family` that `holder`'s class declares on `registry`, in declaration order,
    and set it on `holder` under the attribute's name."""
    for cls in reversed(type(holder).__mro__):
        for family in vars(cls).values():
            if isinstance(family, Family):
                setattr(holder, family.attribute, family.create(registry))


class MetricSet:
    """A component's metrics: a dataclass with a `registry` field whose class declares its
    families (`Family`); building it creates them on that registry. A subclass that sets up
    more (series labelled with a field's value) extends `__post_init__`."""

    registry: CollectorRegistry

    def __post_init__(self) -> None:
        declare(self, self.registry)
