"""Put streams are judged as early as they can be, and must make progress: a header that names a
chain ``store.put`` would refuse fails before any payload is sent, an empty chunk is refused, and
a stream that trickles is ended (min_stream_bytes_per_s) and frees its transfer slot."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from kvstore.keys import namespace_hashes
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits, StreamPace, StreamTooSlow
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from tests.conftest import payloads_for


def header(ns_id: bytes, hashes, spec, parent: bytes | None = None) -> pb.PutRequest:
    return pb.PutRequest(header=pb.PutHeader(namespace_id=ns_id, block_hashes=hashes, block_bytes=spec.block_bytes,
                                             parent=parent))


def chunk(block_index: int, offset: int, data: bytes) -> pb.PutRequest:
    return pb.PutRequest(chunk=pb.Chunk(block_index=block_index, offset=offset, data=data))


def register(stub, namespace) -> bytes:
    return stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json())).namespace_id


@pytest.mark.parametrize("hashes, parent, message", [
    (lambda c: [b"abc"], None, "block hashes must be 16-byte digests"),
    (lambda c: [c[0], c[0]], None, "a put's blocks must be distinct"),
    (lambda c: c[1:2], b"p", "parent must be a 16-byte block hash"),
    (lambda c: c[:2], "chain[1]", "must not include its parent"),
])
def test_a_put_header_naming_a_chain_put_would_refuse_fails_before_any_chunk(server, namespace, spec, chain,
                                                                              hashes, parent, message):
    """The client sends the header and waits: the answer comes at once (it came only after every
    chunk had arrived, or at the idle timeout for a client waiting on it)."""
    parent = chain[1] if parent == "chain[1]" else parent
    resume = threading.Event()

    def requests():
        yield header(ns_id, hashes(chain), spec, parent)
        resume.wait(30)

    with grpc.insecure_channel(server.target) as channel:
        stub = KVStoreStub(channel)
        ns_id = register(stub, namespace)
        put = stub.Put.future(requests())
        try:
            error = put.exception(5)
        finally:
            resume.set()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()


def test_an_empty_chunk_is_invalid_and_stores_nothing(client, server, namespace, spec, chain):
    """An empty chunk sits "in place" but moves nothing (it once counted as progress, resetting the
    idle timer): refused even when every byte follows it."""
    payload = payloads_for(spec, chain[:1])[0].tobytes()
    with grpc.insecure_channel(server.target) as channel:
        stub = KVStoreStub(channel)
        ns_id = register(stub, namespace)
        requests = [header(ns_id, chain[:1], spec), chunk(0, 0, b""), chunk(0, 0, payload)]
        with pytest.raises(grpc.RpcError) as info:
            stub.Put(iter(requests), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "an empty chunk at block 0 offset 0" in info.value.details()
    assert client.lookup(ns_id, chain[:1]).hit_blocks == 0


def test_a_put_that_trickles_is_ended_and_frees_its_slot(store, start_server, namespace, spec):
    """One byte a message, each well inside the 1 s idle timeout: ended once its waits pass the
    idle timeout by more than its bytes pay for, then another client gets the only slot."""
    server = start_server(store, ServiceLimits(stream_idle_timeout_s=1.0, max_concurrent_transfers=1))
    hashes = namespace_hashes(namespace, np.arange(namespace.block_size))
    stop = threading.Event()

    def trickle():
        yield header(ns_id, hashes, spec)
        for offset in range(spec.block_bytes):
            if stop.wait(0.2):
                return
            yield chunk(0, offset, b"x")

    with grpc.insecure_channel(server.target) as channel:
        stub = KVStoreStub(channel)
        ns_id = register(stub, namespace)
        started = time.monotonic()
        put = stub.Put.future(trickle(), metadata=[("kvstore-client", "trickler")])
        try:
            error = put.exception(10)
        finally:
            stop.set()
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "min_stream_bytes_per_s=1048576: the stream waited" in error.details()
        assert time.monotonic() - started < 3, "ended about when its waits passed the idle timeout"
    with KVStoreClient(server.target, timeout_s=10) as other:  # the slot is free: a miss, not RESOURCE_EXHAUSTED
        assert other.load(ns_id, hashes, [np.zeros(spec.block_bytes, np.uint8)]).loaded_blocks == 0


def test_a_get_read_too_slowly_is_ended_and_ends_its_lease(store, start_server, namespace, spec):
    """Each message taken inside the idle timeout, but 9 KiB a 0.1 s: far below the floor rate.

    The server can write several messages ahead into the flow-control window, so one of its
    waits can span several of our reads (0.7 s and more was seen): the idle timeout is kept well
    above that, or it, not the floor rate, would end the stream."""
    limits = ServiceLimits(stream_idle_timeout_s=3.0, max_concurrent_transfers=1, max_transfer_blocks=64)
    server = start_server(store, limits)
    hashes = namespace_hashes(namespace, np.arange(64 * namespace.block_size))
    with KVStoreClient(server.target, timeout_s=10) as client:
        ns_id = client.register_namespace(namespace)
        for start in range(0, 64, 32):
            client.put(ns_id, hashes[start : start + 32], payloads_for(spec, hashes[start : start + 32]),
                       parent=hashes[start - 1] if start else None)
    # no BDP probing: the flow-control window stays small, so the server's writes wait on our reads
    with grpc.insecure_channel(server.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = KVStoreStub(channel)
        lease_id = stub.Lookup(pb.LookupRequest(namespace_id=ns_id, block_hashes=hashes, lease_ttl_s=60)).lease_id
        stream = stub.Get(pb.GetRequest(namespace_id=ns_id, block_hashes=hashes, lease_id=lease_id,
                                        stream_as_loaded=True))  # 64 blocks of 9,216 bytes, a message each
        with pytest.raises(grpc.RpcError) as info:
            for _ in stream:
                time.sleep(0.1)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "min_stream_bytes_per_s=1048576: the stream waited" in info.value.details()
        assert stub.Stats(pb.StatsRequest()).leases_active == 0, "its lease ended with it"


def test_a_stream_pace_allows_waits_past_the_idle_timeout_as_its_bytes_pay_for():
    pace = StreamPace(ServiceLimits(stream_idle_timeout_s=1.0, min_stream_bytes_per_s=1000))
    pace.waited_s = 2.5
    pace.moved(1500)  # 1 s + 1.5 s paid for
    with pytest.raises(StreamTooSlow, match="min_stream_bytes_per_s=1000: the stream waited 2.5 s on its client "
                                            "for 1501 bytes"):
        pace.waited_s = 2.502
        pace.moved(1)
    limits = ServiceLimits.from_env({"KVSTORE_MIN_STREAM_BYTES_PER_S": "64KiB"})
    assert limits.min_stream_bytes_per_s == 64 << 10
