"""The sidecar's hit-rate dashboard: one live page and the JSON API it polls.

``Dashboard(metrics).router`` is a FastAPI router of GET routes only; it reads ``ServiceMetrics``
and never changes the store. Include it in the sidecar's app (at the root, or under a prefix
whose page is then ``PREFIX/``: the page fetches its assets and data by relative URLs), and run
``Dashboard.run()`` beside the server to keep the history. It defines no ``/metrics``. The
router is two: ``page_router`` (the page and its assets, which hold no data) and ``api_router``
(the data), so that an app with a token can guard the data and leave the page's code open.

- ``GET /``: the page (``static/index.html``): token hit rate over time overall and per tier,
  prefill tokens saved, bytes used per tier against capacity, evictions, load latency
  percentiles, the top namespaces and the hit-rate curve, refreshed every 2 s.
- ``GET /static/{name}``: the page's bundled assets (uPlot, vendored: no CDN).
- ``GET /api/summary``: totals since start (lookup and hit tokens, overall and by tier, token
  hit rate, prefill tokens saved and computed, tokens loaded by tier), per-tier bytes used,
  capacity, blocks, evictions and demotions, namespaces and active leases.
- ``GET /api/timeseries?window_s=600``: one point per sample interval: token hit rate overall
  and per tier, lookup and prefill-saved tokens/s, evictions/s and bytes used per tier, load
  latency p50/p90/p99, all from counter deltas over the interval.
- ``GET /api/namespaces?limit=10``: namespaces by looked-up tokens, with hit rate and prefill.
- ``GET /api/hit_rate_curve``: an LRU stack-distance estimate of the recent lookups' token hit
  rate at 1/8x to 8x the store's capacity, beside the hit rate they actually got.

Ratios are computed here, from counters (the metrics export none); they are null when there is
nothing to divide by.
"""

from kvstore.service.dashboard.dashboard import Dashboard

__all__ = ["Dashboard"]
