"""Who may read what on the sidecar's HTTP port, with and without a token.

With a token, what carries data (the JSON API, the OpenAPI schema, /metrics when protected)
needs ``Authorization: Bearer TOKEN``; the page and its static assets (code, no data) are open,
because a browser cannot add a header to ``<script>`` and ``<link>`` loads. No route serves the
CDN-backed Swagger UI or ReDoc, and no response lets the browser send the URL on as a Referer.
"""

from __future__ import annotations

import warnings

import pytest
from fastapi.testclient import TestClient

from kvstore.service.dashboard import Dashboard
from kvstore.service.http import create_http_app
from kvstore.service.metrics import ServiceMetrics

TOKEN = "s3cret-token-value"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
API = ("/api/summary", "/api/timeseries", "/api/namespaces", "/api/hit_rate_curve")
PAGE = ("/", "/static/app.js", "/static/style.css", "/static/uPlot.iife.min.js", "/static/uPlot.min.css")
FASTAPI_DOCS = ("/docs", "/redoc", "/docs/oauth2-redirect")


def http_client(store, token: str | None) -> TestClient:
    metrics = ServiceMetrics(store)
    return TestClient(create_http_app(metrics, token=token, dashboard=Dashboard(metrics)))


def test_with_a_token_the_data_needs_the_header_and_the_page_code_does_not(store):
    client = http_client(store, TOKEN)
    for path in (*API, "/openapi.json"):
        refused = client.get(path)
        assert refused.status_code == 401, path
        assert refused.headers["www-authenticate"] == "Bearer" and "Bearer TOKEN" in refused.json()["detail"]
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert client.get(path, headers=BEARER).status_code == 200, path
    for path in PAGE:
        assert client.get(path).status_code == 200, path


@pytest.mark.parametrize("header, status", [
    (f"bearer {TOKEN}", 200), (f"BEARER {TOKEN}", 200), (f"Basic {TOKEN}", 401), (f"Bearer{TOKEN}", 401),
    (f"Bearer {TOKEN}x", 401), ("Bearer", 401), ("", 401),
])
def test_the_bearer_scheme_is_case_insensitive_and_nothing_else_is_loose(store, header, status):
    assert http_client(store, TOKEN).get("/api/summary", headers={"Authorization": header}).status_code == status


def test_the_token_is_taken_from_the_header_only(store):
    """A token in a URL ends up in history, logs and Referers: no route accepts it there."""
    client = http_client(store, TOKEN)
    for path in (*API, "/openapi.json"):
        assert client.get(path, params={"token": TOKEN}).status_code == 401, path


def test_the_schema_is_at_openapi_json_and_documents_the_api(store):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of duplicate operation ids while it builds the schema
        schema = http_client(store, TOKEN).get("/openapi.json", headers=BEARER).json()
    assert set(schema["paths"]) == {*API, "/healthz"}
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)), ids
    assert list(schema["paths"]["/healthz"]) == ["get"]


def test_healthz_answers_get_and_head(store):
    client = http_client(store, TOKEN)
    assert (client.get("/healthz").status_code, client.get("/healthz").text) == (200, "ok")
    assert client.head("/healthz").status_code == 200


@pytest.mark.parametrize("token", [TOKEN, None])
def test_no_swagger_ui_or_redoc_with_or_without_a_token(store, token):
    client = http_client(store, token)
    for path in FASTAPI_DOCS:
        assert client.get(path, headers=BEARER).status_code == 404, path


def test_without_a_token_everything_is_open(store):
    client = http_client(store, None)
    for path in (*PAGE, *API, "/openapi.json", "/metrics", "/healthz"):
        assert client.get(path).status_code == 200, path


@pytest.mark.parametrize("token", [TOKEN, None])
def test_no_response_sends_a_referer(store, token):
    client = http_client(store, token)
    for path in ("/", "/static/app.js", "/api/summary", "/openapi.json", "/metrics", "/healthz", "/docs"):
        assert client.get(path).headers.get("referrer-policy") == "no-referrer", path


@pytest.mark.parametrize("host, status", [
    ("127.0.0.1:50552", 200), ("localhost:50552", 200), ("[::1]:50552", 200), ("localhost", 200),
    ("LocalHost:50552", 200), ("localhost.:50552", 200), ("127.0.0.2", 200),
    ("attacker.example:50552", 421), ("attacker.example", 421), ("10.0.0.7:50552", 421), ("", 421),
])
def test_without_a_token_on_loopback_only_a_loopback_host_is_answered(store, host, status):
    """DNS rebinding: a page served as attacker.example, whose name then points at 127.0.0.1,
    sends its own name as the Host; without a token nothing else would stop it reading the data."""
    app = TestClient(create_http_app(ServiceMetrics(store), dashboard=Dashboard(ServiceMetrics(store)),
                                     local_only=True))
    for path in ("/api/summary", "/metrics", "/openapi.json"):
        assert app.get(path, headers={"host": host}).status_code == status, path


@pytest.mark.parametrize("host, status", [("localhost:50552", 200), ("attacker.example:50552", 421)])
def test_with_a_token_on_loopback_the_open_metrics_still_need_a_loopback_host(store, host, status):
    """A token guards the API, not the open ``/metrics``: the Host check must stay on with one."""
    app = TestClient(create_http_app(ServiceMetrics(store), token=TOKEN, local_only=True))
    assert app.get("/metrics", headers={"host": host}).status_code == status
    bearer = {"host": host, "authorization": f"Bearer {TOKEN}"}
    assert app.get("/openapi.json", headers=bearer).status_code == status
