"""``/api/timeseries``: per-interval rates from counter deltas between the dashboard's samples."""

from __future__ import annotations

import time

import pytest

from kvstore.service.dashboard.history import History, Sample, percentiles
from kvstore.service.dashboard.models import LatencyPercentiles


def test_each_point_covers_only_its_own_interval(traffic, dashboard, client):
    ns = traffic.namespace()
    prompt = traffic.hashes(ns, 0, 10)
    traffic.put(ns, prompt)
    traffic.lookup(ns, prompt)  # 40 of 40 tokens hit, on the host
    traffic.lookup(ns, traffic.hashes(ns, 50, 10))  # 0 of 40
    for ms in range(1, 101):  # loads of 1 ms .. 100 ms
        traffic.load(ns, prompt[:1], seconds=ms / 1000)
    dashboard.sample()

    for _ in range(3):
        traffic.lookup(ns, prompt)  # 120 of 120
    traffic.metrics.prefill(ns, saved_tokens=120, computed_tokens=0)
    evictions_before = traffic.store.stats().tier("host").evictions
    traffic.put(ns, traffic.hashes(ns, 200, 12))  # 12 new blocks through a full 10-block host tier
    evicted = traffic.store.stats().tier("host").evictions - evictions_before
    dashboard.sample()

    dashboard.sample()  # an interval without traffic

    body = client.get("/api/timeseries", params={"window_s": 3600}).json()
    assert body["tiers"] == ["host", "disk"]
    first, second, idle = body["points"]
    assert first["time_s"] < second["time_s"] < idle["time_s"]

    assert first["hit_rate"] == 0.5
    assert first["hit_rate_by_tier"] == {"host": 0.5, "disk": 0.0}
    assert first["lookup_tokens_per_s"] * first["interval_s"] == pytest.approx(80)
    assert first["load_latency_s"] == dict(count=100, p50=0.050, p90=0.090, p99=0.099)

    assert second["hit_rate"] == 1.0  # not the cumulative 160 / 200
    assert second["prefill_saved_per_s"] * second["interval_s"] == pytest.approx(120)
    assert evicted > 0
    assert second["evictions_per_s"]["host"] * second["interval_s"] == pytest.approx(evicted)
    assert second["load_latency_s"]["count"] == 0

    stats = traffic.store.stats()
    assert idle["used_bytes"] == {t.name: t.used_bytes for t in stats.tiers}
    assert idle["capacity_bytes"] == {"host": 128 << 10, "disk": 1 << 20}
    assert (idle["hit_rate"], idle["lookup_tokens_per_s"], idle["evictions_per_s"]) == (None, 0, {"host": 0, "disk": 0})
    assert idle["load_latency_s"] == dict(count=0, p50=None, p90=None, p99=None)


def test_window_keeps_only_recent_points(dashboard, client):
    dashboard.sample()
    dashboard.sample()
    time.sleep(0.3)
    assert len(client.get("/api/timeseries", params={"window_s": 3600}).json()["points"]) == 2
    assert client.get("/api/timeseries", params={"window_s": 0.1}).json()["points"] == []
    assert client.get("/api/timeseries", params={"window_s": 0}).status_code == 422


def test_history_keeps_its_newest_samples():
    history = History(max_samples=3)
    for t in range(5):
        history.add(sample_at(float(t)))
    assert [p.time_s for p in history.points(since_s=0)] == [3.0, 4.0]


def test_a_clock_stepping_back_starts_the_history_over():
    history = History(max_samples=10)
    for t in (100.0, 101.0, 101.0, 50.0, 51.0):
        history.add(sample_at(t))
    assert [p.time_s for p in history.points(since_s=0)] == [51.0]


def test_percentiles_are_nearest_rank():
    assert percentiles([0.3, 0.1, 0.2]) == LatencyPercentiles(count=3, p50=0.2, p90=0.3, p99=0.3)
    assert percentiles([7.0]) == LatencyPercentiles(count=1, p50=7.0, p90=7.0, p99=7.0)


def sample_at(time_s: float) -> Sample:
    return Sample(time_s, 0.0, {}, 0.0, {}, {}, {}, percentiles([]))
