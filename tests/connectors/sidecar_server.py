"""A real sidecar for connector and engine tests: ``create_server`` over a real store, on its own
event loop in a background thread (as another process would run it), on port 0 or a unix socket."""

from __future__ import annotations

import asyncio
import socket
import threading

from kvstore.service.limits import ServiceLimits
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.server import create_server, start_data_plane
from kvstore.service.staging import StagingArea


class Sidecar:
    """With a staging area for shared-memory puts unless ``staging=False``, the native data plane
    with ``data_plane=True`` and a bearer token with ``token``; ``metrics`` records its traffic."""

    def __init__(self, store, limits: ServiceLimits = ServiceLimits(), address: str = "127.0.0.1:0",
                 staging: bool = True, data_plane: bool = False, token: str | None = None):
        self.store = store
        self.metrics = ServiceMetrics(store)
        self.staging = StagingArea(8 << 20, page_bytes=1 << 20) if staging else None
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sidecar-loop", daemon=True)
        self._thread.start()
        self.data_plane = start_data_plane("127.0.0.1:0", store, limits, None, None) if data_plane else None
        self.server, port = self._run(create_server(address, store, limits, metrics=self.metrics,
                                                    staging=self.staging, data_plane=self.data_plane, token=token))
        self._run(self.server.start())
        self.target = address if address.startswith("unix:") else f"127.0.0.1:{port}"

    def _run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self._run(self.server.stop(grace=1))
        self._run(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()
        if self.data_plane is not None:
            self.data_plane.stop()
        if self.staging is not None:
            self.staging.close()


def unused_address() -> str:
    """A loopback address nothing listens on (a sidecar that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"
