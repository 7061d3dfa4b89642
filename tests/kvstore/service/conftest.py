"""A real grpc.aio server over a real store (host tier in tmp, disk tier in tmp), on port 0.

The server runs on its own event loop in a background thread, so the tests talk to it through
the blocking ``KVStoreClient`` (or the raw stub, to send what the client never would).
"""

from __future__ import annotations

import asyncio
import subprocess
import threading

import grpc
import numpy as np
import pytest

from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.server import create_server
from kvstore.service.staging import StagingArea
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub

# Room for a few 3,076,352-byte V3.2 blocks; pages and segments hold one block each.
STORE_SIZES = dict(host_bytes=16 << 20, page_bytes=4 << 20, disk_bytes=64 << 20, segment_bytes=16 << 20)


class ServerThread:
    """``create_server`` + ``start`` on a private event loop; ``stop`` shuts it all down.

    ``server_kw`` go to ``create_server`` (metrics, staging, durable_puts, token, tls)."""

    def __init__(self, store, limits: ServiceLimits = ServiceLimits(), address: str = "127.0.0.1:0", **server_kw):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-server-loop", daemon=True)
        self._thread.start()
        self.metrics = server_kw.setdefault("metrics", ServiceMetrics(store))
        self.server, self.port = self.run(create_server(address, store, limits, **server_kw))
        self.run(self.server.start())
        self.target = address if address.startswith("unix:") else f"127.0.0.1:{self.port}"

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.run(self.server.stop(grace=1))
        self.run(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


@pytest.fixture
def store(make_store):
    return make_store(**STORE_SIZES)


@pytest.fixture
def start_server():
    """Factory: start a server over a store (optionally with limits or an address); stopped after."""
    servers = []

    def start(store, limits: ServiceLimits = ServiceLimits(), address: str = "127.0.0.1:0",
              **server_kw) -> ServerThread:
        servers.append(ServerThread(store, limits, address, **server_kw))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(store, start_server) -> ServerThread:
    return start_server(store)


def connected_client(server: ServerThread):
    """A fixture's body: a ``KVStoreClient`` of ``server``, closed after the test."""
    with KVStoreClient(server.target, timeout_s=30) as c:
        yield c


def connected_stub(server: ServerThread):
    """A fixture's body: the raw stub over a channel to ``server``, closed after the test."""
    with grpc.insecure_channel(server.target) as channel:
        yield KVStoreStub(channel)


@pytest.fixture
def client(server):
    yield from connected_client(server)


@pytest.fixture
def stub(server):
    yield from connected_stub(server)


SEGMENT_BYTES = 8 << 20


@pytest.fixture(scope="module")
def segment(tmp_path_factory):
    """A segment file of random bytes for a native data plane to serve: (its path, its bytes)."""
    path = tmp_path_factory.mktemp("dp") / "segment"
    data = np.random.default_rng(7).integers(0, 256, SEGMENT_BYTES, dtype=np.uint8)  # [SEGMENT_BYTES]
    data.tofile(path)
    return str(path), data


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and localhost (openssl)."""
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return str(cert), str(key)


@pytest.fixture
def staging(tmp_path):
    """A small staging area (1 MiB of 64 KiB pages) for same-host puts."""
    area = StagingArea(1 << 20, shm_dir=str(tmp_path), page_bytes=64 << 10)
    yield area
    area.close()


@pytest.fixture
def staged_server(store, start_server, staging):
    return start_server(store, staging=staging)


@pytest.fixture
def staged_client(staged_server):
    yield from connected_client(staged_server)


@pytest.fixture
def staged_stub(staged_server):
    yield from connected_stub(staged_server)
