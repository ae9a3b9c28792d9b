"""Every metric continuum exports is in docs/metrics.md, under the name Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry

from continuum_operator.agent.metrics import AgentMetrics
from continuum_operator.embed.metrics import LaneMetrics
from continuum_operator.engine.metrics import EngineMetrics
from continuum_operator.kube.base.metrics import OperatorMetrics
from continuum_operator.kube.engines.pool_metrics import PoolMetrics
from tests.support.builders import ROOT


def operator_registry() -> CollectorRegistry:
    m = OperatorMetrics()
    PoolMetrics(m.registry)  # the decision loop adds the pool gauges to the same registry
    return m.registry


REGISTRIES: dict[str, Callable[[], CollectorRegistry]] = {
    "operator": operator_registry,
    "gateway": lambda: EngineMetrics().registry,
    "agent": lambda: AgentMetrics("n1").registry,
    "lane": lambda: LaneMetrics().registry,
}


@pytest.mark.parametrize("exporter", sorted(REGISTRIES))
def test_every_metric_of_each_exporter_is_documented(exporter: str) -> None:
    documented = (ROOT / "docs" / "metrics.md").read_text()
    families = list(REGISTRIES[exporter]().collect())
    assert families
    for family in families:
        # prometheus-client names a counter's family without `_total`; a scrape shows it with.
        name = f"{family.name}_total" if family.type == "counter" else family.name
        assert name.startswith("continuum_"), name
        assert f"`{name}`" in documented, f"{exporter}: {name} is not in docs/metrics.md"
