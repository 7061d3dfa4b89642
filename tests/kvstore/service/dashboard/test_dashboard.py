"""The router's shape (GET only, documented, no /metrics), its static files, and the sampling loop."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from kvstore.service.dashboard import Dashboard
from kvstore.service.dashboard.dashboard import STATIC_DIR

API_PATHS = {"/api/summary", "/api/timeseries", "/api/namespaces", "/api/hit_rate_curve"}


def test_openapi_documents_every_api_endpoint_with_its_model(client):
    schema = client.get("/openapi.json").json()
    assert set(schema["paths"]) == API_PATHS
    assert all(set(methods) == {"get"} for methods in schema["paths"].values())
    ok = schema["paths"]["/api/summary"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/Summary"}
    assert {"Summary", "Timeseries", "TimePoint", "Namespaces", "HitRateCurve", "CurvePoint"} <= \
        set(schema["components"]["schemas"])


def test_every_route_is_a_get_and_none_is_metrics(dashboard):
    paths = {route.path: route.methods for route in dashboard.router.routes}
    assert set(paths) == API_PATHS | {"/", "/static/{name}"}
    assert all(methods == {"GET"} for methods in paths.values())


def test_reading_every_endpoint_changes_nothing(traffic, client):
    ns = traffic.namespace()
    prompt = traffic.hashes(ns, 0, 6)
    traffic.put(ns, prompt)
    traffic.lookup(ns, prompt)
    before = (traffic.store.stats(), traffic.metrics.totals(), len(traffic.metrics.recent_traffic()))
    for path in ("/", "/static/app.js", *API_PATHS):
        assert client.get(path).status_code == 200
    assert (traffic.store.stats(), traffic.metrics.totals(), len(traffic.metrics.recent_traffic())) == before


def test_the_page_and_its_assets_are_served(client):
    page = client.get("/")
    assert page.headers["content-type"].startswith("text/html")
    assert 'data-metric="hit_rate"' in page.text and "static/uPlot.iife.min.js" in page.text
    for name in ("app.js", "style.css", "uPlot.iife.min.js", "uPlot.min.css"):
        response = client.get(f"/static/{name}")
        assert response.status_code == 200
        assert response.content == (STATIC_DIR / name).read_bytes()
    assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/static/missing.js").status_code == 404
    assert client.get("/static/..%2Fdashboard.py").status_code == 404


def test_run_samples_until_cancelled(metrics):
    dashboard = Dashboard(metrics, sample_interval_s=0.02, history_s=10.0)

    async def run_briefly():
        task = asyncio.create_task(dashboard.run())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run_briefly())
    assert len(dashboard.history.points(since_s=0)) >= 3


def test_a_sample_that_fails_is_logged_and_sampling_goes_on(metrics, monkeypatch, caplog):
    """One failed ``totals`` ended the sampling task for good: the history froze, silently."""
    dashboard = Dashboard(metrics, sample_interval_s=0.02, history_s=10.0)
    totals, failures = metrics.totals, []

    def fails_once():
        if not failures:
            failures.append(1)
            raise OSError("injected: a transient failure")
        return totals()

    monkeypatch.setattr(metrics, "totals", fails_once)

    async def run_briefly():
        task = asyncio.create_task(dashboard.run())
        await asyncio.sleep(0.3)
        task.cancel()

    asyncio.run(run_briefly())
    assert failures and len(dashboard.history.points(since_s=0)) >= 3
    assert "a history sample failed" in caplog.text


def test_a_load_latency_counts_in_one_interval_only(metrics, monkeypatch):
    """A sample read the latencies since the previous sample's time with no upper bound, so one
    recorded between the sample's own time and that read counted in its interval and the next."""
    dashboard = Dashboard(metrics, sample_interval_s=1.0)
    started = dashboard.history.latest().time_s
    time.sleep(0.01)
    metrics.load_took("bytes", 0.25)
    recorded = time.time()
    with monkeypatch.context() as clock:  # the sample's time falls before the load was recorded
        clock.setattr(time, "time", lambda: (started + recorded) / 2)
        dashboard.sample()
    dashboard.sample()
    counts = [point.load_latency_s.count for point in dashboard.history.points(since_s=0)]
    assert counts == [0, 1]


def test_bad_intervals_are_refused(metrics):
    with pytest.raises(ValueError, match="sample_interval_s"):
        Dashboard(metrics, sample_interval_s=0)
    with pytest.raises(ValueError, match="history_s"):
        Dashboard(metrics, sample_interval_s=10, history_s=5)


def test_under_a_prefix_the_page_finds_its_relative_urls(dashboard):
    """The page fetches ``static/...`` and ``api/...`` relative to itself, so a prefix works as is."""
    app = FastAPI()
    app.include_router(dashboard.router, prefix="/dashboard")
    with TestClient(app) as client:
        page = client.get("/dashboard/").text
        for url in ("static/app.js", "static/style.css", "api/summary", "api/hit_rate_curve"):
            assert client.get(f"/dashboard/{url}").status_code == 200
        assert 'src="static/app.js"' in page and "/static" not in page
