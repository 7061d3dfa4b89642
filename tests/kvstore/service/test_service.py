"""The KVStore service end to end: a real server on port 0 over a real host + disk store.

Narratives assert exact bytes, hits, tiers and counters; every error test checks the status code,
that the message says what would be valid, and that the server goes on serving.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import DEEPSEEK_NUM_LAYERS, DEEPSEEK_V32_COMPONENTS, BlockSpec
from kvstore.results import PutResult
from kvstore.service import servicer as servicer_module
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.service.server import create_server
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from tests.conftest import payloads_for, tiny_namespace

Code = grpc.StatusCode


def rpc_error(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kw)
    return info.value


def round_trip_works(client, namespace=None, first_token=1000):
    """A put, lookup and load of two fresh blocks give back the same bytes."""
    namespace = namespace or tiny_namespace()
    ns_id = client.register_namespace(namespace)
    spec = BlockSpec.of(namespace)
    hashes = namespace_hashes(namespace, np.arange(first_token, first_token + 2 * namespace.block_size))
    payloads = payloads_for(spec, hashes)
    client.put(ns_id, hashes, payloads)
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in hashes]
    loaded = client.load(ns_id, hashes, dsts)
    return loaded.complete and all(np.array_equal(a, b) for a, b in zip(dsts, payloads))


# ---- round trips ---------------------------------------------------------------------------

def test_tiny_blocks_round_trip_byte_exact(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    assert ns_id == namespace.id
    payloads = payloads_for(spec, chain[:5])
    assert client.put(ns_id, chain[:3], payloads[:3]) == PutResult(3, 0, 0)
    assert client.put(ns_id, chain[2:5], payloads[2:5], parent=chain[1]) == PutResult(2, 1, 0)

    hit = client.lookup(ns_id, chain[:7])
    assert (hit.num_blocks, hit.hit_blocks, hit.hit_tokens, hit.tiers) == (7, 5, 20, ("host",) * 5)
    assert hit.lease_id is None

    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(7)]
    loaded = client.load(ns_id, chain[:7], dsts)
    assert (loaded.requested_blocks, loaded.tiers, loaded.nbytes) == (7, ("host",) * 5, 5 * 9216)
    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
    assert not dsts[5].any() and not dsts[6].any(), "buffers past the hit are untouched"


def test_realistic_v32_block_streams_in_bounded_chunks(client, stub):
    namespace = Namespace(model="deepseek-v3.2", model_config_hash="cfg", num_layers=DEEPSEEK_NUM_LAYERS,
                          components=DEEPSEEK_V32_COMPONENTS)
    spec = BlockSpec.of(namespace)
    assert spec.block_bytes == 3_076_352
    ns_id = client.register_namespace(namespace)
    hashes = namespace_hashes(namespace, np.arange(64))
    (payload,) = payloads_for(spec, hashes)
    assert client.put(ns_id, hashes, [payload]).stored == 1

    dst = np.zeros(spec.block_bytes, np.uint8)
    assert client.load(ns_id, hashes, [dst]).tiers == ("host",)
    assert np.array_equal(dst, payload)

    for chunk_bytes, expected in ((0, [1 << 20] * 2 + [3_076_352 - (2 << 20)]), (1 << 30, [1 << 20] * 2 + [979_200]),
                                  (768 << 10, [768 << 10] * 3 + [3_076_352 - 3 * (768 << 10)])):
        messages = list(stub.Get(pb.GetRequest(namespace_id=ns_id, block_hashes=hashes, chunk_bytes=chunk_bytes)))
        assert messages[0].header.tiers == ["host"] and messages[0].header.block_bytes == spec.block_bytes
        chunks = [m.chunk for m in messages[1:]]
        assert [len(c.data) for c in chunks] == expected, "chunks never exceed max_chunk_bytes (1 MiB)"
        assert [c.offset for c in chunks] == list(np.cumsum([0] + expected[:-1]))
        assert b"".join(c.data for c in chunks) == payload.tobytes()


def test_a_streamed_get_sends_each_group_as_it_is_loaded_and_stops_at_a_miss(client, stub, namespace, spec, chain,
                                                                             monkeypatch):
    monkeypatch.setattr(servicer_module, "STREAM_GROUP_BYTES", 2 * spec.block_bytes)  # groups of 2 blocks
    ns_id = client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:5])
    assert client.put(ns_id, chain[:5], payloads).stored == 5
    request = pb.GetRequest(namespace_id=ns_id, block_hashes=chain[:8], stream_as_loaded=True)
    messages = list(stub.Get(request))
    headers = [m.header for m in messages if m.WhichOneof("kind") == "header"]
    assert [list(h.tiers) for h in headers] == [["host"] * 2, ["host"] * 2, ["host"]], "the 4th group is not tried"
    chunks = [m.chunk for m in messages if m.WhichOneof("kind") == "chunk"]
    assert [c.block_index for c in chunks] == [0, 1, 2, 3, 4]
    assert [m.WhichOneof("kind") for m in messages][:4] == ["header", "chunk", "chunk", "header"]
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(8)]
    assert client.load(ns_id, chain[:8], dsts).tiers == ("host",) * 5
    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads)) and not any(d.any() for d in dsts[5:])


def test_register_by_fields_or_json_gives_the_namespace_id(stub):
    namespace = tiny_namespace(cache_salt="tenant-a", extra=(("lora", "adapter-1"), ("mm", "x")))
    fields = pb.Namespace(model=namespace.model, model_config_hash=namespace.model_config_hash, num_layers=2,
                          components=["mla_bf16"], block_size=4, cache_salt="tenant-a",
                          extra=[pb.KeyValue(key="lora", value="adapter-1"), pb.KeyValue(key="mm", value="x")])
    by_fields = stub.RegisterNamespace(pb.RegisterNamespaceRequest(fields=fields))
    by_json = stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json()))
    assert by_fields.namespace_id == by_json.namespace_id == namespace.id
    assert (by_json.block_bytes, by_json.layer_bytes, by_json.num_layers, by_json.block_size) == (9216, 4608, 2, 4)


def test_delete_namespace_removes_its_blocks(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:4], payloads_for(spec, chain[:4]))
    assert client.delete_namespace(ns_id) == 4
    assert client.lookup(ns_id, chain[:4]).hit_blocks == 0


def test_unix_socket(make_store, start_server, tmp_path):
    server = start_server(make_store(disk_dir=tmp_path / "d"), address=f"unix:{tmp_path}/kvstore.sock")
    assert server.port == 0
    with KVStoreClient(server.target) as client:
        assert round_trip_works(client)


# ---- leases -----------------------------------------------------------------------------

def test_lookup_with_lease_then_release(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:3], payloads_for(spec, chain[:3]))
    hit = client.lookup(ns_id, chain[:4], lease_ttl_s=30)
    assert hit.hit_blocks == 3 and hit.lease_id is not None and not hit.lease_refused
    assert client.stats().leases_active == 1
    client.release(hit.lease_id)
    assert client.stats().leases_active == 0
    error = rpc_error(client.release, hit.lease_id)
    assert error.code() == Code.NOT_FOUND and f"lease {hit.lease_id} is unknown" in error.details()


def test_lease_ids_are_unguessable_by_clients_sharing_a_unix_socket_and_across_restarts(make_store, start_server,
                                                                                      tmp_path, namespace, spec,
                                                                                      chain):
    """Over a unix socket every client sending no ``kvstore-client`` metadata has the same identity
    (its peer is "unix:"), so the sidecar's holder check cannot tell them apart. Lease ids were 1,
    2, 3...: one such client ended another's lease by releasing small ids, and a restarted sidecar
    gave a new lease the id an old client still held. Now ids are random 63-bit numbers."""
    leases = []
    for run in range(2):  # a sidecar, then its successor over a new store
        store = make_store(disk_bytes=None)
        ns_id = store.register_namespace(namespace)
        store.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
        server = start_server(store, address=f"unix:{tmp_path}/kvstore{run}.sock")
        with grpc.insecure_channel(server.target) as a, grpc.insecure_channel(server.target) as b:
            lookup = pb.LookupRequest(namespace_id=ns_id, block_hashes=chain[:2], lease_ttl_s=30)
            first, second = (KVStoreStub(a).Lookup(lookup).lease_id for _ in range(2))
            assert 0 < first < 1 << 63 and abs(second - first) > 1 << 20, "neither small nor in sequence"
            for guess in [*range(1, 65), *(lease for lease in leases if lease not in (first, second))]:
                error = rpc_error(KVStoreStub(b).Release, pb.ReleaseRequest(lease_id=guess))
                assert error.code() == Code.NOT_FOUND, f"lease {guess}"
            assert store.lease_alive(first) and store.lease_alive(second), "a guess ended nobody's lease"
            KVStoreStub(a).Release(pb.ReleaseRequest(lease_id=first))
        leases += [first, second]
    assert len(set(leases)) == 4


def test_load_ends_the_lease(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    hit = client.lookup(ns_id, chain[:2], lease_ttl_s=30)
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]
    assert client.load(ns_id, chain[:2], dsts, lease_id=hit.lease_id).complete
    assert client.stats().leases_active == 0


@pytest.mark.parametrize("deleted", [False, True])
def test_a_streamed_get_with_the_lease_serves_every_group_even_after_a_delete_and_ends_it_once(
        client, namespace, spec, chain, monkeypatch, deleted):
    monkeypatch.setattr(servicer_module, "STREAM_GROUP_BYTES", 2 * spec.block_bytes)  # groups of 2 blocks
    ns_id = client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:5])
    client.put(ns_id, chain[:5], payloads)
    hit = client.lookup(ns_id, chain[:7], lease_ttl_s=30)
    if deleted:  # the blocks stay readable to the lease holder alone
        assert client.delete_namespace(ns_id) == 5 and client.lookup(ns_id, chain[:5]).hit_blocks == 0
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(7)]
    assert client.load(ns_id, chain[:7], dsts, hit.lease_id).tiers == ("host",) * 5, "every group, up to the miss"
    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
    assert client.stats().leases_active == 0
    assert rpc_error(client.release, hit.lease_id).code() == Code.NOT_FOUND, "the stream ended the lease"
    assert client.stats().tier("host").blocks == (0 if deleted else 5), "deleted blocks go once unleased"


# ---- caller mistakes ------------------------------------------------------------------------

def test_wrong_payload_size_is_invalid_and_stores_nothing(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    short = [np.zeros(spec.block_bytes - 1, np.uint8)]
    error = rpc_error(client.put, ns_id, chain[:1], short)
    assert error.code() == Code.INVALID_ARGUMENT
    assert "block payload has 9215 bytes, expected exactly 9216" in error.details()
    error = rpc_error(client.load, ns_id, chain[:1], short)
    assert error.code() == Code.INVALID_ARGUMENT and "destination buffer has 9215 bytes" in error.details()
    assert client.lookup(ns_id, chain[:1]).hit_blocks == 0
    assert round_trip_works(client)


def test_unknown_namespace_is_not_found(client, chain):
    unknown = bytes(16)
    for call, args in ((client.lookup, (unknown, chain[:1])), (client.delete_namespace, (unknown,)),
                       (client.put, (unknown, chain[:1], [np.zeros(9216, np.uint8)])),
                       (client.load, (unknown, chain[:1], [np.zeros(9216, np.uint8)]))):
        error = rpc_error(call, *args)
        assert error.code() == Code.NOT_FOUND, call.__name__
        assert f"namespace {unknown.hex()} is not registered; call register_namespace first" == error.details()
    assert round_trip_works(client)


@pytest.mark.parametrize("bad", [b"short", b"x" * 17, b""])
def test_malformed_hashes_are_invalid(client, namespace, chain, bad):
    ns_id = client.register_namespace(namespace)
    error = rpc_error(client.lookup, ns_id, [chain[0], bad])
    assert error.code() == Code.INVALID_ARGUMENT and "block hashes must be 16-byte digests" in error.details()
    error = rpc_error(client.put, ns_id, [bad], [np.zeros(9216, np.uint8)])
    assert error.code() == Code.INVALID_ARGUMENT and "16-byte digests" in error.details()
    assert round_trip_works(client)


@pytest.mark.parametrize("request_", [
    pb.RegisterNamespaceRequest(),
    pb.RegisterNamespaceRequest(canonical_json="{not json"),
    pb.RegisterNamespaceRequest(canonical_json='{"model": "m"}'),
    pb.RegisterNamespaceRequest(fields=pb.Namespace(model="m", num_layers=2, components=["mla_bf17"])),
    pb.RegisterNamespaceRequest(fields=pb.Namespace(model="m", num_layers=0, components=["mla_bf16"])),
])
def test_malformed_namespaces_are_invalid(stub, request_):
    error = rpc_error(stub.RegisterNamespace, request_)
    assert error.code() == Code.INVALID_ARGUMENT
    assert any(word in error.details() for word in ("canonical_json", "valid formats", "must be positive"))


def put_stream(header, chunks):
    yield pb.PutRequest(header=header)
    for index, offset, data in chunks:
        yield pb.PutRequest(chunk=pb.Chunk(block_index=index, offset=offset, data=data))


def test_truncated_put_stream_is_invalid_and_stores_nothing(client, stub, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    header = pb.PutHeader(namespace_id=ns_id, block_hashes=chain[:2], block_bytes=spec.block_bytes)
    payload = payloads_for(spec, chain[:1])[0].tobytes()
    error = rpc_error(stub.Put, put_stream(header, [(0, 0, payload), (1, 0, payload[:5000])]))
    assert error.code() == Code.INVALID_ARGUMENT
    assert error.details() == ("put stream ended early: 14216 of 18432 bytes arrived "
                               "(next expected: block 1 offset 5000)")
    assert client.lookup(ns_id, chain[:2]).hit_blocks == 0, "nothing of a truncated put is stored"
    assert client.stats().stored_blocks == 0
    assert round_trip_works(client)


def test_put_stream_out_of_order_or_without_header_is_invalid(client, stub, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    header = pb.PutHeader(namespace_id=ns_id, block_hashes=chain[:1], block_bytes=spec.block_bytes)
    error = rpc_error(stub.Put, put_stream(header, [(0, 100, b"x")]))
    assert error.code() == Code.INVALID_ARGUMENT and "expected block 0 offset 0" in error.details()
    error = rpc_error(stub.Put, iter([pb.PutRequest(chunk=pb.Chunk(data=b"x"))]))
    assert error.code() == Code.INVALID_ARGUMENT and "must open with a PutHeader" in error.details()
    error = rpc_error(stub.Put, iter([]))
    assert error.code() == Code.INVALID_ARGUMENT and "must open with a PutHeader" in error.details()
    assert round_trip_works(client)


# ---- limits ----------------------------------------------------------------------------

SMALL = ServiceLimits(max_lookup_blocks=8, max_transfer_blocks=2, max_chunk_bytes=4096,
                      max_concurrent_transfers=1, max_message_bytes=64 << 10)


@pytest.fixture
def limited(store, start_server):
    return start_server(store, SMALL)


@pytest.fixture
def limited_stub(limited):
    with grpc.insecure_channel(limited.target) as channel:
        yield KVStoreStub(channel)


def test_batches_over_the_limits_are_resource_exhausted(limited, namespace, spec, chain):
    with KVStoreClient(limited.target, limits=SMALL) as client:
        ns_id = client.register_namespace(namespace)
        error = rpc_error(client.lookup, ns_id, chain[:9])
        assert error.code() == Code.RESOURCE_EXHAUSTED
        assert error.details() == "9 blocks in one call exceed max_lookup_blocks=8; split the call"
        assert client.lookup(ns_id, chain[:8]).num_blocks == 8

        error = rpc_error(client.put, ns_id, chain[:3], payloads_for(spec, chain[:3]))
        assert error.code() == Code.RESOURCE_EXHAUSTED and "max_transfer_blocks=2" in error.details()
        error = rpc_error(client.load, ns_id, chain[:3], [np.zeros(spec.block_bytes, np.uint8)] * 3)
        assert error.code() == Code.RESOURCE_EXHAUSTED and "max_transfer_blocks=2" in error.details()
        assert round_trip_works(client)


def test_chunks_and_messages_over_the_limits_are_resource_exhausted(limited, limited_stub, namespace, spec, chain):
    with KVStoreClient(limited.target, limits=SMALL) as client:
        ns_id = client.register_namespace(namespace)
        header = pb.PutHeader(namespace_id=ns_id, block_hashes=chain[:1], block_bytes=spec.block_bytes)
        error = rpc_error(limited_stub.Put, put_stream(header, [(0, 0, bytes(8192))]))
        assert error.code() == Code.RESOURCE_EXHAUSTED and "max_chunk_bytes=4096" in error.details()
        error = rpc_error(limited_stub.Lookup, pb.LookupRequest(namespace_id=ns_id, block_hashes=[bytes(16)] * 5000))
        assert error.code() == Code.RESOURCE_EXHAUSTED, "gRPC enforces max_message_bytes itself"
        assert round_trip_works(client)


def test_concurrent_streams_over_the_limit_are_refused(limited, limited_stub, namespace, spec, chain):
    with KVStoreClient(limited.target, limits=SMALL) as client:
        ns_id = client.register_namespace(namespace)
        release = threading.Event()

        def held_open():  # a put that holds its transfer slot until released
            yield pb.PutRequest(header=pb.PutHeader(namespace_id=ns_id, block_hashes=chain[:1],
                                                    block_bytes=spec.block_bytes))
            release.wait(30)

        first = limited_stub.Put.future(held_open())
        try:
            error = None
            for _ in range(200):  # until the server has the first stream
                try:
                    client.lookup(ns_id, chain[:1])  # unary calls need no slot
                    client.load(ns_id, chain[:1], [np.zeros(spec.block_bytes, np.uint8)])
                except grpc.RpcError as exc:
                    error = exc
                    break
            assert error is not None and error.code() == Code.RESOURCE_EXHAUSTED
            assert "max_concurrent_transfers=1" in error.details()
        finally:
            release.set()
        assert first.exception(10).code() == Code.INVALID_ARGUMENT, "the held stream ended early"
        assert round_trip_works(client), "the slot is free again"


# ---- store closed, health, reflection, stats ------------------------------------------------------

def test_closed_store_is_unavailable(client, store, namespace, chain):
    ns_id = client.register_namespace(namespace)
    store.close()
    error = rpc_error(client.lookup, ns_id, chain[:1])
    assert error.code() == Code.UNAVAILABLE and "closed" in error.details()


def test_health_is_serving_and_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvstore.v1.KVStore"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in reply.list_services_response.service}
        assert {"kvstore.v1.KVStore", "grpc.health.v1.Health"} <= names


def test_a_probe_answers_whether_a_block_is_held_without_a_lease_or_a_count(server, client, stub, namespace, spec,
                                                                          chain):
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    assert client.holds(ns_id, chain[1]) and not client.holds(ns_id, chain[2])
    stats = client.stats()
    assert (stats.lookups, stats.hit_blocks, stats.leases_active) == (0, 0, 0)
    assert "kvstore_lookups_total{" not in generate_latest(server.metrics.registry).decode(), "nor in Prometheus"
    error = rpc_error(stub.Lookup, pb.LookupRequest(namespace_id=ns_id, block_hashes=chain[:1], lease_ttl_s=30,
                                                    probe=True))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "a probe takes no lease" in error.details()
    assert client.stats().leases_active == 0


def test_stats_reflect_traffic(client, store, namespace, spec, chain):
    before = client.stats()
    assert (before.namespaces, before.puts, before.lookups) == (0, 0, 0)
    assert [t.name for t in before.tiers] == ["host", "disk"]
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:4], payloads_for(spec, chain[:4]))
    client.lookup(ns_id, chain[:6])
    client.load(ns_id, chain[:2], [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)])
    store.flush()  # write-through to disk finishes in the background
    stats = client.stats()
    assert (stats.namespaces, stats.puts, stats.stored_blocks, stats.duplicate_blocks) == (1, 1, 4, 0)
    assert (stats.lookups, stats.lookup_blocks, stats.hit_blocks) == (1, 6, 4)
    host, disk = stats.tier("host"), stats.tier("disk")
    assert (host.blocks, host.hit_blocks, host.loaded_blocks) == (4, 4, 2)
    assert disk.blocks == 4 and disk.bytes_written >= 4 * spec.block_bytes
    assert replace(store.stats(), tiers=stats.tiers) == stats, "the wire carries every counter of the store"
    assert disk.extra["path"] == store.tiers[1].path


def test_a_slow_store_call_does_not_stall_other_calls(client, store, namespace, chain, monkeypatch):
    """Store calls run in worker threads: the event loop answers while one of them blocks."""
    entered, release = threading.Event(), threading.Event()
    real_stats = store.stats

    def blocking_stats():
        entered.set()
        release.wait(30)
        return real_stats()

    monkeypatch.setattr(store, "stats", blocking_stats)
    slow = threading.Thread(target=client.stats)
    slow.start()
    try:
        assert entered.wait(10)
        ns_id = client.register_namespace(namespace)
        assert client.lookup(ns_id, chain[:2]).hit_blocks == 0
        assert slow.is_alive(), "the other calls were answered while the slow one still ran"
    finally:
        release.set()
        slow.join(10)


def test_an_unbindable_address_is_refused_with_a_message(store, tmp_path):
    async def bind():
        return await create_server(f"unix:{tmp_path}/missing-dir/kvstore.sock", store)

    with pytest.raises(InvalidRequest, match="cannot listen on 'unix:.*missing-dir/kvstore.sock': "
                                             "the directory .*/missing-dir does not exist"):
        asyncio.run(bind())
