"""The page in a real browser: headless Chromium against a real uvicorn server over a real store.

The page must show what ``/api/summary`` says (formatted text and raw ``data-value``), draw its
charts, and follow new traffic without a reload.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from kvstore.service.dashboard import Dashboard

CHROMIUM = "/usr/bin/chromium"
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs the playwright package")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"the browser test needs Chromium at {CHROMIUM}")

CHARTS = ("chart-hit-rate", "chart-tokens", "chart-bytes", "chart-evictions", "chart-latency", "chart-curve")


class UvicornThread:
    """A real uvicorn server for ``app`` on a free port of 127.0.0.1, in a background thread."""

    def __init__(self, app: FastAPI):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(10)


def dashboard_app(dashboard: Dashboard) -> FastAPI:
    """The dashboard's router, sampled by its own ``run`` loop while the app is up."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        sampler = asyncio.create_task(dashboard.run())
        yield
        sampler.cancel()

    app = FastAPI(lifespan=lifespan)
    app.include_router(dashboard.router)
    return app


@pytest.fixture
def server(metrics):
    server = UvicornThread(dashboard_app(Dashboard(metrics, sample_interval_s=0.25, history_s=60.0)))
    yield server
    server.stop()


@pytest.fixture
def page():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield browser.new_page(viewport={"width": 1440, "height": 1000})
        browser.close()


def metric(page, name: str, tier: str | None = None):
    selector = f'[data-metric="{name}"]' + (f'[data-tier="{tier}"]' if tier else ":not([data-tier])")
    return page.locator(selector).first


def shown(page, name: str, tier: str | None = None) -> tuple[str, str]:
    """A data-metric element's text and its raw value."""
    element = metric(page, name, tier)
    return element.text_content(), element.get_attribute("data-value")


def test_page_shows_the_api_numbers_and_follows_new_traffic(traffic, server, page, tmp_path):
    ns = traffic.namespace("alpha")
    prompt = traffic.hashes(ns, 0, 15)
    traffic.put(ns, prompt)
    traffic.lookup(ns, prompt)  # 15 of 15 hit
    traffic.lookup(ns, traffic.hashes(ns, 100, 5))  # 0 of 5
    traffic.load(ns, prompt[-3:], seconds=0.004)
    traffic.metrics.prefill(ns, saved_tokens=12_345, computed_tokens=20)

    page.goto(server.url)
    page.wait_for_function("Number(document.body.dataset.updates) >= 1", timeout=10_000)
    summary = httpx.get(server.url + "api/summary").json()

    assert summary["hit_rate"] == 0.75
    assert shown(page, "hit_rate") == ("75.0%", "0.75")
    assert shown(page, "prefill_saved") == ("12.3k", "12345")
    assert shown(page, "prefill_saved_fraction") == ("99.8%", str(summary["prefill_saved_fraction"]))
    capacity_text = {"host": "128.0 KiB", "disk": "1.0 MiB"}
    for tier in summary["tiers"]:
        used = tier["used_bytes"]
        assert used > 0 and shown(page, "tier_used_bytes", tier["name"]) == (f"{used / 1024:.1f} KiB", str(used))
        assert shown(page, "tier_capacity_bytes", tier["name"])[0] == capacity_text[tier["name"]]
    assert page.locator("#namespaces tbody tr").evaluate_all("rows => rows.map(r => r.dataset.namespace)") == \
        [f"alpha/{ns.hex()[:8]}"]
    assert metric(page, "curve_requests").get_attribute("data-value") == "2"
    assert page.get_attribute("#status", "data-state") == "live"

    for chart in CHARTS:
        box = page.locator(f"#{chart} canvas").first.bounding_box()
        assert box and box["width"] > 200 and box["height"] > 100, f"{chart} has no drawn canvas"
    page.wait_for_function("charts.plots.get('chart-hit-rate').plot.data[0].length >= 1", timeout=10_000)

    page.evaluate("window.notReloaded = true")
    traffic.lookup(ns, traffic.hashes(ns, 300, 5))  # 20 more tokens, all missing: 60 of 100 hit
    page.wait_for_function("parseFloat(document.querySelector('[data-metric=hit_rate]').dataset.value) === 0.6",
                           timeout=10_000)
    assert metric(page, "hit_rate").text_content() == "60.0%" == \
        f"{100 * httpx.get(server.url + 'api/summary').json()['hit_rate']:.1f}%"
    assert page.evaluate("window.notReloaded") is True

    screenshot = tmp_path / "dashboard.png"
    page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 30_000


COUNT_RESIZE_OBSERVERS = """
window.liveObservers = 0;
window.ResizeObserver = class extends window.ResizeObserver {
  constructor(callback) { super(callback); window.liveObservers += 1; }
  disconnect() { window.liveObservers -= 1; super.disconnect(); }
};
"""


def test_a_rebuilt_chart_leaves_no_resize_observer_behind(traffic, server, page):
    """A chart is rebuilt when its series change (a tier appears); until session 34 the destroyed
    plot's ResizeObserver stayed connected, one more for every rebuild."""
    page.add_init_script(COUNT_RESIZE_OBSERVERS)
    page.goto(server.url)
    page.wait_for_function("Number(document.body.dataset.updates) >= 1", timeout=10_000)
    assert page.evaluate("liveObservers") == len(CHARTS)
    replaced = page.evaluate("""() => {
        const old = charts.plots.get('chart-curve').plot;
        for (const shape of ['one', 'two', 'three']) charts.update('chart-curve', shape, curveOptions, old.data);
        return charts.plots.get('chart-curve').plot !== old;
    }""")
    assert replaced, "the chart was not rebuilt"
    assert page.evaluate("liveObservers") == len(CHARTS)
