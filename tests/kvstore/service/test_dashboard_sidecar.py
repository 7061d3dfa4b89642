"""The dashboard of a real ``kvstore serve`` process, in headless Chromium: while the bundled
engine's demo traffic flows through it the page shows what the JSON API and /metrics report, and
with a token the page opened once as ``/?token=TOKEN`` goes live and keeps the token out of URLs."""

from __future__ import annotations

import os
import re
import threading
import time

import httpx
import pytest

from engine_adapter.demo import DemoConfig, run_demo
from kvstore.service.local import LocalSidecar

CHROMIUM = "/usr/bin/chromium"
sync_api = pytest.importorskip("playwright.sync_api", reason="the browser test needs the playwright package")
pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"the browser test needs Chromium at {CHROMIUM}")


def settled_summary(url: str, polls: int = 60) -> dict:
    """/api/summary once its counts stop moving: engines report prefill on a background thread, so
    reports can land after the demo returns."""
    last = None
    for _ in range(polls):
        summary = httpx.get(url + "api/summary", timeout=10).json()
        counts = (summary["hit_rate"], summary["prefill_tokens_saved"])
        if counts == last and summary["prefill_tokens_saved"] > 0:
            return summary
        last = counts
        time.sleep(0.5)
    pytest.fail(f"the sidecar's counts kept moving for {polls * 0.5:.0f} s after the demo ended: {last}")


def test_the_sidecar_dashboard_shows_the_demo_traffic_live(tmp_path):
    with LocalSidecar(str(tmp_path), "64MiB", "256MiB", env={"KVSTORE_SHM_DIR": str(tmp_path)}) as sidecar, \
            sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000})
        page.goto(sidecar.url)
        page.wait_for_function("Number(document.body.dataset.updates) >= 1", timeout=15_000)
        page.evaluate("window.notReloaded = true")

        demo = threading.Thread(target=run_demo, args=(DemoConfig.quick(sidecar=sidecar.address, conversations=2,
                                                                        turns=2, long_prompt_tokens=512),
                                                       lambda line: None))
        demo.start()
        demo.join(240)
        assert not demo.is_alive()

        summary = settled_summary(sidecar.url)
        page.wait_for_function(f"document.querySelector('[data-metric=hit_rate]').dataset.value == "
                               f"'{summary['hit_rate']}' && document.querySelector('[data-metric=prefill_saved]')"
                               f".dataset.value == '{summary['prefill_tokens_saved']}'", timeout=15_000)
        assert 0 < summary["hit_rate"] < 1 and summary["prefill_tokens_saved"] > 0
        assert page.locator('[data-metric="prefill_saved"]').get_attribute("data-value") == \
            str(summary["prefill_tokens_saved"])
        rows = page.locator("#namespaces tbody tr").evaluate_all("rows => rows.map(r => r.dataset.namespace)")
        assert len(rows) == 1 and rows[0].startswith("demo")
        assert page.evaluate("window.notReloaded") is True, "the numbers arrived without a reload"
        page.screenshot(path=str(tmp_path / "sidecar-dashboard.png"), full_page=True)
        browser.close()

        exposition = httpx.get(sidecar.url + "metrics", timeout=10).text
        saved = float(re.search(r'^kvstore_prefill_tokens_saved_total\{namespace="demo[^"]*"\} (\S+)$',
                                exposition, re.M).group(1))
        assert saved == summary["prefill_tokens_saved"]
    assert (tmp_path / "sidecar-dashboard.png").stat().st_size > 30_000


TOKEN = "s3cret-token-value"


def test_the_dashboard_of_a_sidecar_with_a_token_goes_live_from_a_token_url(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    with LocalSidecar(str(tmp_path), "64MiB", "256MiB", extra_args=("--token-file", str(token_file)),
                      env={"KVSTORE_SHM_DIR": str(tmp_path)}) as sidecar, \
            sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        page = browser.new_page()
        requests = []
        page.on("request", lambda request: requests.append(request))
        page.goto(sidecar.url + f"?token={TOKEN}")
        page.wait_for_function("Number(document.body.dataset.updates) >= 2", timeout=15_000)

        assert page.get_attribute("#status", "data-state") == "live"
        summary = httpx.get(sidecar.url + "api/summary", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        capacity = page.locator('[data-metric="tier_capacity_bytes"][data-tier="host"]').get_attribute("data-value")
        assert capacity == str(64 << 20) == str(next(t["capacity_bytes"] for t in summary["tiers"] if t["name"] == "host"))
        assert page.url == sidecar.url, "the token left the address bar"
        headers = [(r.url, r.all_headers()) for r in requests]
        assert [url for url, sent in headers if "referer" in sent] == [], "no request carries a Referer"
        api_calls = [sent.get("authorization") for url, sent in headers if "/api/" in url]
        assert api_calls and set(api_calls) == {f"Bearer {TOKEN}"}
        assert page.evaluate("fetch('api/summary').then(r => r.status)") == 401

        page.reload()  # the token lives on in this tab's sessionStorage, not in the URL
        page.wait_for_function("Number(document.body.dataset.updates) >= 1", timeout=15_000)
        assert page.url == sidecar.url and page.get_attribute("#status", "data-state") == "live"

        tab = browser.new_page()  # a tab of its own has no token, and says what it needs
        tab.goto(sidecar.url)
        tab.wait_for_function("document.getElementById('status').dataset.state === 'error'", timeout=15_000)
        assert tab.locator("#status").text_content() == "needs the token · open ?token=TOKEN"
        assert tab.evaluate("document.body.dataset.updates") == "0"
        browser.close()
