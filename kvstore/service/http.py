"""The sidecar's HTTP face: Prometheus ``/metrics``, ``/healthz`` and the dashboard.

    GET /metrics      Prometheus text format of ``ServiceMetrics.registry`` (open unless
                      ``protect_metrics``; Prometheus scrapers then send the bearer token)
    GET /healthz      200 "ok" while serving, 503 while shutting down (never protected; HEAD
                      too, as on /metrics, for probes that use it)
    GET /, /static/*  the dashboard's page and its assets (kvstore.service.dashboard)
    GET /api/*        the dashboard's JSON API
    GET /openapi.json the API's schema (no Swagger UI or ReDoc: they load from a CDN)

With a token, what holds data (``/api/*``, ``/openapi.json``, and ``/metrics`` when protected)
needs ``Authorization: Bearer TOKEN``, taken from that header only: a token in a URL ends up in
history, logs and Referers. The page and its assets are code with no data, open to all, because a
browser cannot add the header to ``<script>`` and ``<link>`` loads: the page reads the token from
``?token=`` once, drops it from the address bar and sends it as that header. No response lets the
browser send its URL on as a Referer. Nothing here can change the store: every route is a GET.

On a loopback address (``local_only``), a request must name a loopback host in its ``Host``
header, else 421: a web page whose own name an attacker re-points at 127.0.0.1 (DNS rebinding)
could otherwise read the dashboard's data, or ``/metrics``, from the operator's browser. A token
does not lift the check: the open ``/metrics`` would be readable that way.

``HttpServer`` runs uvicorn inside the sidecar's event loop (no second process or thread pool).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.errors import InvalidRequest
from kvstore.service.http_guard import GuardedH11Protocol
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.security import is_local_address, token_matches

log = logging.getLogger(__name__)


def create_http_app(metrics: ServiceMetrics, token: str | None = None, protect_metrics: bool = False,
                    dashboard=None, serving=lambda: True, local_only: bool = False) -> FastAPI:
    """The FastAPI app; ``dashboard`` is a ``Dashboard`` (its router is mounted at ``/``) or None.
    ``local_only``: served on loopback alone, so a ``Host`` must be loopback too."""
    app = FastAPI(title="kvstore sidecar", description="Metrics and hit-rate dashboard of one KV-cache store",
                  version="1", openapi_url=None, docs_url=None, redoc_url=None)  # the schema: below, guarded
    app.middleware("http")(_no_referrer)
    if local_only:
        app.middleware("http")(_loopback_host)
    auth = [Depends(_bearer(token))] if token else []

    @app.get("/openapi.json", dependencies=auth, include_in_schema=False)
    def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.api_route("/metrics", methods=["GET", "HEAD"], dependencies=auth if protect_metrics else [],
                   include_in_schema=False)
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def healthz() -> PlainTextResponse:
        if serving():
            return PlainTextResponse("ok")
        return PlainTextResponse("shutting down", status_code=503)

    # GET in the schema; HEAD, for probes that use it, outside it: one route with both methods
    # gives the schema two operations of one id (FastAPI warns each time it builds the schema)
    app.get("/healthz", response_class=PlainTextResponse, summary="200 while the sidecar serves")(healthz)
    app.head("/healthz", response_class=PlainTextResponse, include_in_schema=False)(healthz)

    if dashboard is not None:
        app.include_router(dashboard.page_router)
        app.include_router(dashboard.api_router, dependencies=auth)
    return app


def _bearer(token: str):
    def require_token(request: Request) -> None:
        if not token_matches(request.headers.get("authorization"), token):
            raise HTTPException(401, "send 'Authorization: Bearer TOKEN' with the sidecar's token "
                                     "(the dashboard takes it once as /?token=TOKEN)",
                                headers={"WWW-Authenticate": "Bearer"})
    return require_token


async def _no_referrer(request: Request, call_next) -> Response:
    """Browsers send no Referer from any page or response of ours (the page's URL may hold a token)."""
    response = await call_next(request)
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


async def _loopback_host(request: Request, call_next) -> Response:
    if not is_local_address(f"{_host_of(request.headers.get('host', ''))}:0"):
        return PlainTextResponse("this sidecar's HTTP port answers requests for a loopback host (localhost, "
                                 "127.0.0.1, [::1]) only", status_code=421)
    return await call_next(request)


def _host_of(header: str) -> str:
    """The host of a ``Host`` header, without its port or a trailing dot, lower case (``[::1]:8080``
    -> ``[::1]``, ``LocalHost.:80`` -> ``localhost``)."""
    header = header.lower()
    if header.startswith("["):
        return header[: header.find("]") + 1]
    return (header.rsplit(":", 1)[0] if header.count(":") == 1 else header).rstrip(".")


class HttpServer:
    """uvicorn serving ``app`` on ``host:port`` as a task of the running event loop."""

    def __init__(self, app: FastAPI, address: str, tls: tuple[str, str] | None = None):
        host, port = address.rsplit(":", 1)
        self._host, self._port = host.strip("[]"), int(port)
        ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, http=GuardedH11Protocol,
                                **ssl)
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # the sidecar owns SIGTERM/SIGINT
        self._task: asyncio.Task | None = None
        self.scheme = "https" if tls else "http"

    async def start(self) -> str:
        """Start serving; returns the URL it listens on (the bound port when 0 was asked for).

        Raises ``InvalidRequest`` if the address cannot be bound."""
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        try:
            sock = socket.create_server((self._host, self._port), family=family)
        except OSError as exc:
            raise InvalidRequest(f"cannot serve HTTP on {self._host}:{self._port} ({exc.strerror}): is it in use? "
                                 "give --http-address HOST:PORT, or 'off'") from None
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise OSError("the HTTP server stopped before it started")
            await asyncio.sleep(0.01)
        host, port = sock.getsockname()[:2]
        return f"{self.scheme}://{host if family == socket.AF_INET else f'[{host}]'}:{port}/"

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
