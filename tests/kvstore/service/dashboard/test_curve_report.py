"""``/api/hit_rate_curve``: the LRU estimate of the recent lookups, read around the store's capacity."""

from __future__ import annotations

import pytest

from kvstore.service.dashboard import Dashboard
from kvstore.service.metrics import ServiceMetrics
from tests.kvstore.service.dashboard.conftest import BLOCK_BYTES, BLOCK_TOKENS, STORE_SIZES


def test_curve_of_two_alternating_prompts(traffic, client):
    """A and B of 10 blocks each put together, then looked up A B A B: every lookup reuses its
    blocks after 20 distinct blocks (the put's, then the lookups'), so all hit from 20 blocks of
    capacity on."""
    ns = traffic.namespace()
    a, b = traffic.hashes(ns, 0, 10), traffic.hashes(ns, 100, 10)
    traffic.put(ns, a + b)
    for prompt in (a, b, a, b):
        traffic.lookup(ns, prompt)

    c = client.get("/api/hit_rate_curve").json()

    assert c["estimator"] == "lru_stack_distance" and "LRU estimate" in c["note"]
    assert (c["window_requests"], c["window_blocks"], c["window_tokens"]) == (4, 40, 160)
    assert c["window_start_s"] <= c["window_end_s"]
    assert c["observed_hit_rate"] == 1.0  # the store held both all along
    assert c["current_capacity_bytes"] == 1 << 20  # write-through: the largest tier
    assert c["capacity_rule"].startswith("largest tier")
    factors = [p["capacity_factor"] for p in c["points"]]
    assert factors[0] == 1 / 8 and factors[-1] == 8 and 1.0 in factors and factors == sorted(factors)
    reuse_bytes = 20 * BLOCK_BYTES
    for point in c["points"]:
        assert point["capacity_bytes"] == round(point["capacity_factor"] * (1 << 20))
        assert point["capacity_tokens"] == point["capacity_bytes"] * BLOCK_TOKENS // BLOCK_BYTES
        assert point["hit_rate"] == (1.0 if point["capacity_bytes"] >= reuse_bytes else 0.0)
    assert c["points"][0]["hit_rate"] == 0.0  # 1/8 of 1 MiB holds only 14 of the 20 blocks
    assert c["current"] == c["points"][factors.index(1.0)]
    assert c["current"]["hit_tokens"] == 160


def test_curve_without_lookups_is_empty(client):
    c = client.get("/api/hit_rate_curve").json()
    assert (c["window_requests"], c["observed_hit_rate"], c["window_start_s"]) == (0, None, None)
    assert c["current"] == dict(capacity_factor=1.0, capacity_bytes=1 << 20, capacity_tokens=None,
                                hit_tokens=0, hit_rate=None)


@pytest.mark.parametrize("refresh_s, requests_seen", [(0.0, 2), (3600.0, 1)])
def test_curve_is_recomputed_at_most_once_per_refresh(traffic, refresh_s, requests_seen):
    dashboard = Dashboard(traffic.metrics, curve_refresh_s=refresh_s)
    ns = traffic.namespace()
    traffic.lookup(ns, traffic.hashes(ns, 0, 3))
    assert dashboard.hit_rate_curve().window_requests == 1
    traffic.lookup(ns, traffic.hashes(ns, 0, 3))
    assert dashboard.hit_rate_curve().window_requests == requests_seen


def test_without_write_through_the_tiers_capacities_add_up(make_store):
    store = make_store(write_policy="on_eviction", background_writes=False, **STORE_SIZES)
    curve = Dashboard(ServiceMetrics(store)).hit_rate_curve()
    assert curve.current_capacity_bytes == (128 << 10) + (1 << 20)
    assert curve.capacity_rule.startswith("sum of tiers")
