"""Every reconciler's kernel settings come from one settings object (`OperatorSettings.kernels`),
filled from the operator's flags, and `kube.process.run` wires each reconciler with its own: the
Engines', the lanes', the grants' and the placed pods'. They came from four places before (the
Engines' constants, `LoopSettings` read in the lanes' `run`, the grants' constants and keyword
arguments, the placed pods' `interval`)."""

from __future__ import annotations

import argparse
from typing import Any

from continuum_operator.cli.operator import add_arguments, settings_from
from continuum_operator.kube.base.kernel import KernelSettings
from continuum_operator.kube.base.metrics import OperatorMetrics
from continuum_operator.kube.process.run import _reconcilers
from continuum_operator.kube.state.cache import Cache
from continuum_operator.kube.state.mind_cache import MindCache
from tests.support.fakes import FakeKubeApi


def _settings(argv: list[str]) -> Any:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return settings_from(p.parse_args(argv))


def test_the_flags_set_every_reconcilers_kernel_through_one_settings_object() -> None:
    settings = _settings(
        ["--resync", "3", "--full-resync", "30", "--write-workers", "4", "--leader-renew", "1"]
    )
    kernels = settings.kernels
    for kernel in (kernels.engines, kernels.lanes, kernels.grants, kernels.placed):
        assert kernel.resync_seconds == 30  # every reconciler's full resync
    assert kernels.engines.pass_seconds == kernels.grants.pass_seconds == 3
    assert kernels.grants.writers == 4 and settings.grants.write_workers == 4
    assert kernels.engines.writers == settings.loop.engine_writers == 8
    assert settings.leader.renew_seconds == 1  # the leader's section is in the same object


def test_run_wires_each_reconciler_with_its_own_kernel_from_the_settings() -> None:
    settings = _settings(["--full-resync", "30", "--write-workers", "4"])
    api: Any = FakeKubeApi().aio
    cache = Cache()

    def leading() -> bool:
        return True

    built = _reconcilers(api, settings, cache, MindCache(), leading, OperatorMetrics(), None)
    kernels: dict[str, KernelSettings] = {type(r).__name__: r.kernel for r in built}  # type: ignore[attr-defined]
    assert kernels == {
        "Loop": settings.kernels.engines,
        "LaneLoop": settings.kernels.lanes,
        "GrantsLoop": settings.kernels.grants,
        "PlacedPods": settings.kernels.placed,
    }
    # One clock, the cache's, for every reconciler.
    assert all(r.clock is cache.clock for r in built)  # type: ignore[attr-defined]
    # Each one's writes through the adapter that asks the leader's gate at each call.
    assert all(r.api._may_write is leading for r in built)  # type: ignore[attr-defined]
