"""KVStoreClient against sidecars it must not trust blindly: one whose Get stream disagrees with
the call (another version), and one restarted behind the same socket with a new data port."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.service import dataplane
from kvstore.service.chunk_codec import encode_chunk
from kvstore.service.client import KVStoreClient
from kvstore.service.dataplane import DataPlaneError
from kvstore.service.limits import ServiceLimits
from kvstore.service.server import start_data_plane
from kvstore.service.servicer import SERVICE_NAME
from kvstore.service.v1 import kvstore_pb2 as pb
from tests.conftest import payloads_for
from tests.kvstore.service.conftest import ServerThread

BLOCK_BYTES = 1024
HASHES = [bytes([i]) * 16 for i in range(2)]


@contextlib.contextmanager
def sidecar_answering_get(messages: list[bytes]):
    """A gRPC server on a free port whose Get streams ``messages`` (serialized GetResponses)
    whatever it is asked, as a sidecar of another version might; yields its target."""
    handler = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(messages),
                                                   request_deserializer=pb.GetRequest.FromString,
                                                   response_serializer=bytes)
    server = grpc.server(ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"Get": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def header(tiers: int, block_bytes: int = BLOCK_BYTES, requested: int = len(HASHES)) -> bytes:
    get_header = pb.GetHeader(requested_blocks=requested, tiers=["host"] * tiers, block_bytes=block_bytes)
    return pb.GetResponse(header=get_header).SerializeToString()


def chunks(blocks: int, block_bytes: int = BLOCK_BYTES) -> list[bytes]:
    return [encode_chunk(i, 0, memoryview(bytes([7]) * block_bytes)) for i in range(blocks)]


@pytest.mark.parametrize("messages, error", [
    ([header(2, BLOCK_BYTES // 2), *chunks(2, BLOCK_BYTES // 2)],
     "announced 2 blocks of 512 bytes for a call of 2 blocks of 1024 bytes"),
    ([header(1, requested=1), *chunks(1)], "announced 1 blocks of 1024 bytes for a call of 2 blocks"),
    ([header(3), *chunks(3)], "announced 3 blocks for a call of 2"),
    ([*chunks(2)], "did not start with a GetHeader"),
    ([], "did not start with a GetHeader"),
], ids=["half-size blocks", "another request's count", "more blocks than asked", "no header", "empty stream"])
def test_a_get_stream_that_disagrees_with_the_call_raises_never_reports_buffers_filled(messages, error):
    """The client took the sizes and counts of the sidecar's Get header on trust: blocks of half the
    buffers' size came back as complete loads with the buffers half written, and blocks past the
    call landed in buffers the caller never gave. Now such a stream raises, naming the mismatch."""
    dsts = [np.zeros(BLOCK_BYTES, np.uint8) for _ in HASHES]
    with sidecar_answering_get(messages) as target, KVStoreClient(target, timeout_s=10, data_plane=False) as client:
        with pytest.raises(InvalidRequest, match=error):
            client.load(b"\x00" * 16, HASHES, dsts)


@pytest.mark.skipif(not dataplane.available(),
                    reason="the native data plane was not built (make installs g++ and libgrpc++-dev)")
def test_a_grant_on_a_restarted_sidecars_new_data_port_closes_the_old_ports_client(store, tmp_path, namespace,
                                                                                   spec, chain):
    """A sidecar restarted behind the same unix socket binds a new data port. The client kept one
    data-plane client (a native channel, its threads) per port it had ever been granted, so every
    restart leaked one. Now the first grant naming the new port closes the old port's client."""
    address, ns_id = f"unix:{tmp_path}/kvstore.sock", store.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:2])
    store.put(ns_id, chain[:2], payloads)
    data_planes, clients = [], []
    with KVStoreClient(address, timeout_s=30, shared_memory=False) as remote:
        try:
            for _ in range(2):  # the sidecar, then its successor (the first's data port stays taken: a new one)
                data_planes.append(start_data_plane("127.0.0.1:0", store, ServiceLimits(), None, None))
                server = ServerThread(store, address=address, data_plane=data_planes[-1])
                try:
                    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]
                    assert remote.load_shm(ns_id, chain[:2], dsts).tiers == ("host", "host")
                    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
                    assert data_planes[-1].counters().bytes_sent == 2 * spec.block_bytes, "through the data plane"
                    clients.append(dict(remote._data_plane._clients))
                finally:
                    server.stop()
            ports = [data_plane.port for data_plane in data_planes]
            assert list(clients[0]) == [ports[0]] and list(clients[1]) == [ports[1]], "the old port's was dropped"
            for closer in [t for t in threading.enumerate() if t.name == "kvstore-dataplane-close"]:
                closer.join(10)
            with pytest.raises(DataPlaneError, match="the client is closed"):
                clients[0][ports[0]].read(b"\x00" * 16, [np.empty(1, np.uint8)])
        finally:
            for data_plane in data_planes:
                data_plane.stop()
