"""The stand-in stub built from the service descriptor (what the plugin uses under LMCache's older
grpcio) speaks the same wire as the generated one, against a real sidecar."""

from __future__ import annotations

import grpc
import numpy as np

from connectors.lmcache import stubs
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from tests.conftest import payloads_for
from tests.connectors.sidecar_server import Sidecar


def test_the_descriptor_stub_binds_every_rpc_of_the_generated_stub():
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        generated = set(vars(KVStoreStub(channel)))
        built = set(vars(stubs.descriptor_stubs(pb).KVStoreStub(channel)))
    assert built == generated and "GetSlots" in built


def test_the_descriptor_stub_puts_and_gets_through_a_real_sidecar(make_store, namespace, spec, chain):
    sidecar = Sidecar(make_store())
    try:
        with grpc.insecure_channel(sidecar.target) as channel:
            stub = stubs.descriptor_stubs(pb).KVStoreStub(channel)
            register = pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json())
            ns_id = stub.RegisterNamespace(register).namespace_id
            payload = payloads_for(spec, chain[:1])[0]
            header = pb.PutHeader(namespace_id=ns_id, block_hashes=chain[:1], block_bytes=spec.block_bytes)
            chunk = pb.Chunk(block_index=0, offset=0, data=payload.tobytes())
            put = stub.Put(iter([pb.PutRequest(header=header), pb.PutRequest(chunk=chunk)]))  # stream-unary
            assert put.stored == 1
            replies = list(stub.Get(pb.GetRequest(namespace_id=ns_id, block_hashes=chain[:1])))  # unary-stream
    finally:
        sidecar.stop()
    assert replies[0].header.tiers == ["host"]
    assert np.array_equal(np.frombuffer(b"".join(r.chunk.data for r in replies[1:]), np.uint8), payload)


def test_loading_where_the_runtimes_are_new_enough_keeps_the_generated_stubs():
    assert stubs.load() is pb
    from kvstore.service.v1 import kvstore_pb2_grpc

    assert kvstore_pb2_grpc.KVStoreStub is KVStoreStub
