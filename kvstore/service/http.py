"""The sidecar's HTTP face: Prometheus ``/metrics``, ``/healthz`` and the dashboard.

    GET /metrics    Prometheus text format of ``ServiceMetrics.registry`` (open unless
                    ``protect_metrics``; Prometheus scrapers then send the bearer token)
    GET /healthz    200 "ok" while serving, 503 while shutting down (never protected)
    GET /, /api/*   the dashboard (kvstore.service.dashboard): the page and its JSON API

With a token, every route but ``/healthz`` (and ``/metrics`` unless protected) needs
``Authorization: Bearer TOKEN``; the dashboard page reads the token from ``?token=`` once and
sends it as that header. Nothing here can change the store: every route is a GET.

``HttpServer`` runs uvicorn inside the sidecar's event loop (no second process or thread pool).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.errors import InvalidRequest
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.security import token_matches

log = logging.getLogger(__name__)


def create_http_app(metrics: ServiceMetrics, token: str | None = None, protect_metrics: bool = False,
                    dashboard=None, serving=lambda: True) -> FastAPI:
    """The FastAPI app; ``dashboard`` is a ``Dashboard`` (its router is mounted at ``/``) or None."""
    app = FastAPI(title="kvstore sidecar", description="Metrics and hit-rate dashboard of one KV-cache store",
                  version="1")
    auth = [Depends(_bearer(token))] if token else []

    @app.get("/metrics", dependencies=auth if protect_metrics else [], include_in_schema=False)
    def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_class=PlainTextResponse, summary="200 while the sidecar serves")
    def healthz() -> PlainTextResponse:
        if serving():
            return PlainTextResponse("ok")
        return PlainTextResponse("shutting down", status_code=503)

    if dashboard is not None:
        app.include_router(dashboard.router, dependencies=auth)
    return app


def _bearer(token: str):
    def require_token(request: Request) -> None:
        presented = request.headers.get("authorization")
        if presented is None and "token" in request.query_params:  # the page's first load
            presented = f"Bearer {request.query_params['token']}"
        if not token_matches(presented, token):
            raise HTTPException(401, "send 'Authorization: Bearer TOKEN' with the sidecar's token "
                                     "(or open the page once as /?token=TOKEN)",
                                headers={"WWW-Authenticate": "Bearer"})
    return require_token


class HttpServer:
    """uvicorn serving ``app`` on ``host:port`` as a task of the running event loop."""

    def __init__(self, app: FastAPI, address: str, tls: tuple[str, str] | None = None):
        host, port = address.rsplit(":", 1)
        self._host, self._port = host.strip("[]"), int(port)
        ssl = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, **ssl)
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
