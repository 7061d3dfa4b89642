"""A ``KVStoreClient``'s link to its sidecar's native data plane (``kvstore.service.dataplane``):
one ``DataPlaneClient`` per data port the sidecar's grants name, opened on first use, and a
pause in using a port that could not be reached (Get carries the blocks meanwhile)."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import numpy as np

from kvstore.service import dataplane
from kvstore.service.shm import SlotGrant

log = logging.getLogger(__name__)


class DataPlaneLink:
    """The channel to the data plane of the sidecar behind ``target``, at the port its latest grant
    names (a restarted sidecar binds a new one: the old port's channel is closed then), and a
    pause of ``RETRY_AFTER_S`` in using a port once it could not be reached (a firewalled port, a
    restarting sidecar): Get carries the blocks meanwhile."""

    RETRY_AFTER_S = 30.0

    def __init__(self, target: str, root_certificates: bytes | None, token: str | None, client_id: str,
                 streams: int):
        self._host = data_plane_host(target)
        self._credentials = (root_certificates, token, client_id)
        self._streams = streams
        self._clients: dict[int, dataplane.DataPlaneClient] = {}
        self._retry_at: dict[int, float] = {}  # port -> when to try it again
        self._closed = False
        self._lock = threading.Lock()

    def read(self, grant: SlotGrant, views: list[np.ndarray], first_slot: int, timeout_s: float | None) -> bool:
        """True when the slots arrived whole; False (logged) when the stream failed."""
        client = self._client(grant.data_port)
        if client is None:
            return False
        try:
            client.read(grant.data_grant, views, first_slot, timeout_s=timeout_s)
        except dataplane.DataPlaneError as exc:
            if exc.code in (_UNAVAILABLE, _DEADLINE_EXCEEDED, dataplane.NOT_CONNECTED):
                with self._lock:
                    self._retry_at[grant.data_port] = time.monotonic() + self.RETRY_AFTER_S
                    stale = self._clients.pop(grant.data_port, None) if exc.code == dataplane.NOT_CONNECTED else None
                if stale is not None:  # the next try gets a fresh channel, not one still backing off its reconnects
                    _close_in_background([stale])
                log.warning("the sidecar's data plane at %s cannot be reached (%s): Get carries the blocks for "
                            "the next %.0f s", client.target, exc, self.RETRY_AFTER_S)
            else:
                log.debug("reading slots from the data plane failed: %s", exc)
            return False
        return True

    def _client(self, port: int) -> dataplane.DataPlaneClient | None:
        """The client of ``port``, the data port of the latest grant; those of other ports (a
        restarted sidecar's predecessor's) are closed. None while ``port`` is paused or after ``close``."""
        with self._lock:
            if self._closed:
                return None
            stale = [client for p, client in self._clients.items() if p != port]
            self._clients = {p: client for p, client in self._clients.items() if p == port}
            self._retry_at = {p: t for p, t in self._retry_at.items() if p == port}
            client = None if time.monotonic() < self._retry_at.get(port, 0.0) else self._open(port)
        _close_in_background(stale)
        return client

    def _open(self, port: int) -> dataplane.DataPlaneClient:
        """The client of ``port``, opened on first use; caller holds ``_lock``."""
        if port not in self._clients:
            root_certificates, token, client_id = self._credentials
            self._clients[port] = dataplane.DataPlaneClient(f"{self._host}:{port}", token=token,
                                                            root_certificates=root_certificates,
                                                            client_id=client_id, streams=self._streams)
        return self._clients[port]

    def close(self) -> None:
        with self._lock:
            clients, self._clients, self._closed = self._clients, {}, True
        for client in clients.values():
            client.close()


_UNAVAILABLE, _DEADLINE_EXCEEDED = grpc.StatusCode.UNAVAILABLE.value[0], grpc.StatusCode.DEADLINE_EXCEEDED.value[0]


def _close_in_background(clients: list[dataplane.DataPlaneClient]) -> None:
    """Close ``clients`` on a thread of their own: ``close`` waits for the reads still using them."""
    if clients:
        threading.Thread(target=_close_all, args=(clients,), name="kvstore-dataplane-close", daemon=True).start()


def _close_all(clients: list[dataplane.DataPlaneClient]) -> None:
    for client in clients:
        client.close()


def data_plane_host(target: str) -> str:
    """The host part of a channel target, where the sidecar's data plane listens too (127.0.0.1
    behind a unix socket): ``"10.0.0.5:50551"`` -> ``"10.0.0.5"``, ``"dns:///kv:50551"`` -> ``"kv"``."""
    if target.startswith("unix:"):
        return "127.0.0.1"
    for scheme in ("dns:///", "dns:", "ipv4:", "ipv6:"):
        if target.startswith(scheme):
            target = target[len(scheme):]
            break
    return target.rsplit(":", 1)[0] if ":" in target else target
