"""Settings for every test: Hypothesis never fails a property for being slow on a loaded
machine (CI runs beside other jobs; speed is measured in bench/, not asserted here)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

settings.register_profile("continuum", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("continuum")
