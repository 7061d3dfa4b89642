"""The names the sidecar exports, read from its real metrics registry over a real (tiny) store."""

from __future__ import annotations

import pytest

from tests.deploy.helpers import exported_sample_names


@pytest.fixture(scope="session")
def metric_families(tmp_path_factory) -> dict[str, str]:
    """{family name: type} of every family ``ServiceMetrics.registry`` exports."""
    from kvstore.service.metrics import ServiceMetrics
    from kvstore.store import TieredStore
    from kvstore.tiers.host import HostTier

    store = TieredStore([HostTier(1 << 20, shm_dir=str(tmp_path_factory.mktemp("shm")))])
    try:
        return {family.name: family.type for family in ServiceMetrics(store).registry.collect()}
    finally:
        store.close()


@pytest.fixture(scope="session")
def exported(metric_families) -> set[str]:
    """Every sample name /metrics can carry, as PromQL selects it (the data plane's where it runs)."""
    from kvstore.service.metrics import DATA_PLANE_METRIC_NAMES, METRIC_NAMES

    histograms = {name for name, kind in metric_families.items() if kind == "histogram"}
    return exported_sample_names(METRIC_NAMES + DATA_PLANE_METRIC_NAMES, histograms)
