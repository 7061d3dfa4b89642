"""The chunk size a caller asks for is raised to a floor: min(64 KiB, max_chunk_bytes). Every
message costs the server a write round trip, so chunk_bytes=1 made one of every payload byte (39 s
of the native server's CPU for 68 MiB). Both bytes paths: the native data plane's ReadSlots (a real
C++ server on port 0 over a segment in tmp) and Python's Get (a real sidecar server over a store)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore.keys import namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.service import dataplane
from kvstore.service.client import KVStoreClient
from kvstore.service.dataplane import DataPlaneServer
from kvstore.service.limits import ServiceLimits
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import BlockDataStub, KVStoreStub
from tests.conftest import payloads_for, tiny_namespace

REGION_BYTES = (64 << 10) + 5


@pytest.mark.skipif(not dataplane.available(), reason="the native data plane was not built")
@pytest.mark.parametrize("max_chunk_bytes, asked, sizes", [
    (1 << 20, 1, [64 << 10, 5]),
    (1 << 20, 1000, [64 << 10, 5]),
    (1 << 20, (64 << 10) + 1, [(64 << 10) + 1, 4]),  # above the floor: as asked
    (1 << 20, 0, [REGION_BYTES]),  # 0: the most
    (4096, 1, [4096] * 16 + [5]),  # a maximum below 64 KiB is the floor too
])
def test_readslots_raises_a_small_chunk_size_to_the_floor(tmp_path, max_chunk_bytes, asked, sizes):
    data = np.random.default_rng(5).integers(0, 256, REGION_BYTES, dtype=np.uint8)  # [REGION_BYTES]
    data.tofile(tmp_path / "segment")
    server = DataPlaneServer("127.0.0.1:0", str(tmp_path / "segment"), max_chunk_bytes=max_chunk_bytes)
    try:
        grant = server.grant(1, [(0, REGION_BYTES)], ttl_s=30)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            messages = list(BlockDataStub(channel).ReadSlots(pb.ReadSlotsRequest(grant=grant, chunk_bytes=asked)))
        assert [len(m.data) for m in messages] == sizes
        assert b"".join(m.data for m in messages) == data.tobytes()
    finally:
        server.stop(0)


@pytest.mark.parametrize("limits, asked, sizes", [
    (ServiceLimits(), 1000, [64 << 10, 8192]),
    (ServiceLimits(), (64 << 10) + 1, [(64 << 10) + 1, 8191]),
    (ServiceLimits(), 0, [73_728]),
    (ServiceLimits(max_chunk_bytes=4096), 1000, [4096] * 18),
])
def test_get_raises_a_small_chunk_size_to_the_floor(store, start_server, limits, asked, sizes):
    namespace = tiny_namespace(block_size=32)  # 73,728-byte blocks
    spec = BlockSpec.of(namespace)
    server = start_server(store, limits)
    with KVStoreClient(server.target, timeout_s=30, limits=limits) as client:
        ns_id = client.register_namespace(namespace)
        hashes = namespace_hashes(namespace, np.arange(32))  # one block
        (payload,) = payloads_for(spec, hashes)
        assert client.put(ns_id, hashes, [payload]).stored == 1
    with grpc.insecure_channel(server.target) as channel:
        request = pb.GetRequest(namespace_id=ns_id, block_hashes=hashes, chunk_bytes=asked)
        chunks = [m.chunk for m in list(KVStoreStub(channel).Get(request))[1:]]
    assert [len(c.data) for c in chunks] == sizes
    assert b"".join(c.data for c in chunks) == payload.tobytes()
