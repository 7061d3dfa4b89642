"""Put streams are judged as early as they can be, and must make progress: a header that names a
chain ``store.put`` would refuse fails before any payload is sent, an empty chunk is refused, and
a stream that trickles is ended (min_stream_bytes_per_s) and frees its transfer slot."""

from __future__ import annotations

import threading

import grpc
import pytest

from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub


def header(ns_id: bytes, hashes, spec, parent: bytes | None = None) -> pb.PutRequest:
    return pb.PutRequest(header=pb.PutHeader(namespace_id=ns_id, block_hashes=hashes, block_bytes=spec.block_bytes,
                                             parent=parent))


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
