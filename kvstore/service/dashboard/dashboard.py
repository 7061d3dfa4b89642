"""``Dashboard``: the sampler that keeps the history, and the router serving the page and its JSON.

A thin shell over ``ServiceMetrics``: every route is a GET that reads counters, gauges or the
recent-traffic record and changes nothing, in the store or in the metrics. The history is the
only state of its own, and only ``sample`` (or the ``run`` loop calling it) writes to it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from pathlib import Path

from fastapi import APIRouter, HTTPException, Query
from fastapi.responses import FileResponse

from kvstore.service.dashboard.curve_report import CurveCache, current_capacity
from kvstore.service.dashboard.history import History, take_sample
from kvstore.service.dashboard.models import HitRateCurve, Namespaces, Summary, Timeseries
from kvstore.service.dashboard.readings import by_label
from kvstore.service.dashboard.summary import namespaces, summary
from kvstore.service.metrics import ServiceMetrics

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = frozenset(p.name for p in STATIC_DIR.iterdir() if p.is_file())  # all /static/ may serve


class Dashboard:
    """The hit-rate dashboard of one sidecar; include ``router`` in its FastAPI app.

    ``router`` is ``page_router`` (the page and its static assets: code, no data) and
    ``api_router`` (the JSON API: the data). An app with a token puts only ``api_router`` behind
    it: a browser cannot add a header to the page's ``<script>`` and ``<link>`` loads.

    ``sample()`` records one history sample (the constructor takes the first, so the first
    interval starts when the dashboard does); ``run()`` calls it every ``sample_interval_s``
    until cancelled. The history keeps ``history_s`` worth of samples. A hit-rate curve is
    recomputed at most every ``curve_refresh_s`` while lookups keep arriving.
    """

    def __init__(self, metrics: ServiceMetrics, sample_interval_s: float = 1.0, history_s: float = 3600.0,
                 curve_refresh_s: float = 5.0):
        if not sample_interval_s > 0 or not history_s >= sample_interval_s:
            raise ValueError(f"need 0 < sample_interval_s <= history_s, got {sample_interval_s} and {history_s}")
        self.metrics = metrics
        self.sample_interval_s = sample_interval_s
        self.history_s = history_s
        self.history = History(max_samples=math.ceil(history_s / sample_interval_s) + 1)
        self._curves = CurveCache(curve_refresh_s)
        self._sampling = threading.Lock()  # one sample at a time, so their times rise as they are added
        self.page_router = self._page_router()
        self.api_router = self._api_router()
        self.router = APIRouter(routes=[*self.page_router.routes, *self.api_router.routes])
        self.sample()

    def sample(self) -> None:
        """Take one history sample now: the counters, and the load latencies since the last sample."""
        with self._sampling:
            latest = self.history.latest()
            now = time.time()
            latencies = self.metrics.recent_latencies("load", latest.time_s, now) if latest else []
            self.history.add(take_sample(self.metrics.totals(), now, latencies))

    async def run(self) -> None:
        """Sample every ``sample_interval_s`` until cancelled (off the event loop: it reads the store).
        A sample that fails is logged and skipped; the next one is taken on time."""
        while True:
            await asyncio.sleep(self.sample_interval_s)
            try:
                await asyncio.to_thread(self.sample)
            except Exception:
                log.exception("dashboard: a history sample failed; sampling goes on")

    def summary(self) -> Summary:
        return summary(self.metrics.totals(), time.time() - self.metrics.started_s)

    def timeseries(self, window_s: float) -> Timeseries:
        return Timeseries(window_s=window_s, sample_interval_s=self.sample_interval_s, tiers=self.history.tiers(),
                          points=self.history.points(since_s=time.time() - window_s))

    def namespaces(self, limit: int) -> Namespaces:
        return namespaces(self.metrics.totals(), limit)

    def hit_rate_curve(self) -> HitRateCurve:
        capacities = by_label(self.metrics.totals(), "kvstore_tier_capacity_bytes", "tier")
        capacity, rule = current_capacity(capacities, self.metrics.store.write_policy)
        return self._curves.get(self.metrics.recent_traffic(), capacity, rule)

    @staticmethod
    def _page_router() -> APIRouter:
        router = APIRouter()

        @router.get("/", include_in_schema=False)
        def page() -> FileResponse:
            return FileResponse(STATIC_DIR / "index.html")

        @router.get("/static/{name}", include_in_schema=False)
        def static(name: str) -> FileResponse:
            if name not in STATIC_FILES:
                raise HTTPException(404, f"no static file {name!r}; there are {sorted(STATIC_FILES)}")
            return FileResponse(STATIC_DIR / name)

        return router

    def _api_router(self) -> APIRouter:
        router = APIRouter()

        @router.get("/api/summary", response_model=Summary)
        def api_summary() -> Summary:
            """Totals since the sidecar started, per-tier usage, namespaces and leases now."""
            return self.summary()

        @router.get("/api/timeseries", response_model=Timeseries)
        def api_timeseries(window_s: float = Query(600.0, gt=0, description="Seconds of history")) -> Timeseries:
            """History intervals ending in the last ``window_s`` seconds, oldest first."""
            return self.timeseries(window_s)

        @router.get("/api/namespaces", response_model=Namespaces)
        def api_namespaces(limit: int = Query(10, ge=1, le=1000)) -> Namespaces:
            """The namespaces with the most looked-up tokens, with their hit rate and prefill saved."""
            return self.namespaces(limit)

        @router.get("/api/hit_rate_curve", response_model=HitRateCurve)
        def api_hit_rate_curve() -> HitRateCurve:
            """LRU estimate of the recent lookups' token hit rate at 1/8x to 8x the store's capacity."""
            return self.hit_rate_curve()

        return router
