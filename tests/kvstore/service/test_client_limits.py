"""Per-client limits: one client cannot take every stream or lease; the error names the limit."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import numpy as np
import pytest

from kvstore.keys import namespace_hashes
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ClientLeases, LimitExceeded, ServiceLimits, TransferSlots
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from tests.conftest import payloads_for
from tests.kvstore.store_helpers import hold_store_lock, until


def test_lease_limit_is_per_client_and_frees_on_release(store, start_server, namespace, spec, chain):
    server = start_server(store, ServiceLimits(max_leases_per_client=2))
    with KVStoreClient(server.target, timeout_s=10) as greedy, KVStoreClient(server.target, timeout_s=10) as other:
        ns_id = greedy.register_namespace(namespace)
        greedy.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
        leases = [greedy.lookup(ns_id, chain[:2], lease_ttl_s=30).lease_id for _ in range(2)]
        with pytest.raises(grpc.RpcError) as info:
            greedy.lookup(ns_id, chain[:2], lease_ttl_s=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_leases_per_client=2" in info.value.details()
        with pytest.raises(grpc.RpcError):
            greedy.get_slots(ns_id, chain[:2], lease_ttl_s=30)  # the fast path counts too
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]
        loaded = greedy.load_shm(ns_id, chain[:2], dsts)  # raised RESOURCE_EXHAUSTED until session 34
        assert loaded.complete and loaded.tiers == ("host", "host"), "Get, which takes no lease, served it"
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads_for(spec, chain[:2])))

        assert other.lookup(ns_id, chain[:2], lease_ttl_s=30).lease_id is not None, "another client is unaffected"
        assert greedy.lookup(ns_id, chain[:2]).hit_blocks == 2, "lookups without a lease are never limited"
        greedy.release(leases[0])
        assert greedy.lookup(ns_id, chain[:2], lease_ttl_s=30).lease_id is not None


def test_client_leases_count_until_their_ttl_passes():
    leases = ClientLeases(per_client=1)
    leases.add("a", 1, ttl_s=0.05)
    with pytest.raises(LimitExceeded, match="max_leases_per_client=1"):
        leases.check("a")
    time.sleep(0.1)
    leases.check("a")  # expired: no longer counted
    assert leases.held("a") == 0


def test_client_leases_forget_expired_leases_of_clients_that_never_call_again():
    leases = ClientLeases(per_client=8)
    for n in range(100):  # a hundred short-lived clients, gone without releasing
        leases.add(f"gone-{n}", n, ttl_s=0.01)
    time.sleep(0.05)
    leases.check("live")
    assert len(leases._owner) == 100 - ClientLeases.PURGE_PER_CALL, "bounded work per call"
    for n in range(10):
        leases.add("live", 1000 + n, ttl_s=30)
    assert set(leases._owner) == set(range(1000, 1010)) and list(leases._expiry) == ["live"]


def test_client_leases_released_early_leave_no_backlog():
    leases = ClientLeases(per_client=8)
    for n in range(1000):
        leases.add("busy", n, ttl_s=30)
        leases.drop(n)  # a Get or Release ended it long before its TTL
    assert len(leases._deadlines) <= 2 + ClientLeases.PURGE_PER_CALL and not leases._owner


def test_client_leases_count_a_lease_being_taken_until_its_call_ends():
    leases = ClientLeases(per_client=2)
    with leases.taking("a"):
        with leases.taking("a"):
            with pytest.raises(LimitExceeded, match="max_leases_per_client=2"):
                with leases.taking("a"):
                    pass
            leases.add("a", 1, ttl_s=30)
        with leases.taking("b"):
            pass  # another client is unaffected
    assert leases.held("a") == 1, "the taken lease stays counted; the place that took none is free again"
    with leases.taking("a"):
        pass


@pytest.mark.parametrize("rpc", ["Lookup", "GetSlots"])
def test_leases_asked_for_at_once_do_not_overshoot_the_per_client_cap(store, start_server, namespace, spec, chain,
                                                                      rpc):
    """Every call is under way (past the cap check, awaiting the store) before the first is granted."""
    server = start_server(store, ServiceLimits(max_leases_per_client=2))
    with KVStoreClient(server.target, timeout_s=10) as client, grpc.insecure_channel(server.target) as channel:
        ns_id = client.register_namespace(namespace)
        client.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
        call = getattr(KVStoreStub(channel), rpc)
        request = getattr(pb, f"{rpc}Request")(namespace_id=ns_id, block_hashes=chain[:2], lease_ttl_s=60)
        unstick = hold_store_lock(store)
        try:
            calls = [call.future(request, metadata=[("kvstore-client", "racer")], timeout=30) for _ in range(6)]
            time.sleep(0.3)
        finally:
            unstick.set()
        refused = [c.exception().code() for c in calls if c.exception() is not None]
        assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4
        assert store.stats().leases_active == 2


def test_transfer_slots_refuse_past_the_per_client_and_global_limits():
    slots = TransferSlots(limit=3, per_client=2)
    with slots.hold("a"), slots.hold("a"):
        with pytest.raises(LimitExceeded, match="max_streams_per_client=2"):
            with slots.hold("a"):
                pass
        with slots.hold("b"):
            with pytest.raises(LimitExceeded, match="max_concurrent_transfers=3"):
                with slots.hold("c"):
                    pass
    assert slots.active == 0
    with slots.hold("a"), slots.hold("a"):
        pass  # all were given back


def test_transfers_are_capped_in_bytes_and_the_client_loads_within_the_cap(store, start_server, namespace, spec,
                                                                           chain):
    """The client picks the block size, so a block count alone does not bound the memory a Get or
    Put holds: max_transfer_bytes does, also for ReserveSlots. ``load_shm`` batches within it."""
    limits = ServiceLimits(max_transfer_bytes=3 * spec.block_bytes)
    server = start_server(store, limits)
    with KVStoreClient(server.target, timeout_s=10, limits=limits, shared_memory=False, data_plane=False) as client:
        ns_id = client.register_namespace(namespace)
        payloads = payloads_for(spec, chain[:4])
        with pytest.raises(grpc.RpcError) as put:
            client.put(ns_id, chain[:4], payloads)
        client.put(ns_id, chain[:3], payloads[:3])
        with pytest.raises(grpc.RpcError) as get:
            client.load(ns_id, chain[:3] + chain[:1], [np.zeros(spec.block_bytes, np.uint8) for _ in range(4)])
        client.put(ns_id, chain[3:4], payloads[3:], parent=chain[2])
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(4)]
        assert client.load_shm(ns_id, chain[:4], dsts).loaded_blocks == 4, "Get in calls of 3 blocks, then 1"
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
    for error in (put.value, get.value):
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (f"4 blocks of {spec.block_bytes} bytes in one call ({4 * spec.block_bytes} bytes) exceed "
                f"max_transfer_bytes={3 * spec.block_bytes}; send at most 3 a call") in error.details()


def test_max_transfer_bytes_is_read_from_the_environment_and_named_when_no_block_fits():
    limits = ServiceLimits.from_env({"KVSTORE_MAX_TRANSFER_BYTES": "64KiB"})
    assert limits.max_transfer_bytes == 64 << 10 and limits.transfer_blocks(9216) == 7
    with pytest.raises(LimitExceeded, match="raise max_transfer_bytes for blocks this size"):
        limits.check_transfer(1, 65 << 10)


# ---- streams that stall -------------------------------------------------------------------

IDLE = ServiceLimits(stream_idle_timeout_s=1.0, max_concurrent_transfers=1)


@pytest.fixture
def idle_limited(store, start_server, namespace, spec):
    """A server that allows one stream at a time, idle for 1 s at most; 32 blocks stored."""
    server = start_server(store, IDLE)
    hashes = namespace_hashes(namespace, np.arange(32 * namespace.block_size))
    with KVStoreClient(server.target, timeout_s=10) as client:
        ns_id = client.register_namespace(namespace)
        client.put(ns_id, hashes, payloads_for(spec, hashes))
    return server, ns_id, hashes


def loads_now(target: str, ns_id: bytes, hashes, spec) -> bool:
    """Whether another client's Get gets a transfer slot now."""
    with KVStoreClient(target, timeout_s=10) as client:
        try:
            return client.load(ns_id, hashes[:1], [np.zeros(spec.block_bytes, np.uint8)]).complete
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            return False


def test_a_put_that_stalls_after_its_header_fails_deadline_exceeded_and_frees_its_slot(idle_limited, spec):
    server, ns_id, hashes = idle_limited
    resume = threading.Event()

    def stalled():
        yield pb.PutRequest(header=pb.PutHeader(namespace_id=ns_id, block_hashes=hashes[:1],
                                                block_bytes=spec.block_bytes))
        resume.wait(30)

    with grpc.insecure_channel(server.target) as channel:
        put = KVStoreStub(channel).Put.future(stalled(), metadata=[("kvstore-client", "stuck")])
        try:
            error = put.exception(10)
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, "ended by the server, not by our deadline"
            assert "stream_idle_timeout_s=1: the client sent no chunk" in error.details()
            assert loads_now(server.target, ns_id, hashes, spec)
        finally:
            resume.set()


def test_a_get_whose_client_stops_reading_fails_deadline_exceeded_and_ends_its_lease(idle_limited, spec):
    server, ns_id, hashes = idle_limited
    # no BDP probing: the flow-control window stays small, so the server's writes block
    with grpc.insecure_channel(server.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
        stub = KVStoreStub(channel)
        lease_id = stub.Lookup(pb.LookupRequest(namespace_id=ns_id, block_hashes=hashes, lease_ttl_s=60)).lease_id
        stream = stub.Get(pb.GetRequest(namespace_id=ns_id, block_hashes=hashes, lease_id=lease_id, chunk_bytes=1024,
                                        stream_as_loaded=True))  # 32 blocks, one chunk each (1024 is raised to the floor): ~300 KB
        next(stream)
        assert not loads_now(server.target, ns_id, hashes, spec), "the stalled Get holds the only slot"
        deadline = time.monotonic() + 10
        while not loads_now(server.target, ns_id, hashes, spec):
            assert time.monotonic() < deadline, "the stalled Get never gave its slot back"
            time.sleep(0.1)
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "stream_idle_timeout_s=1: the client took no Get message" in info.value.details()
        stats = stub.Stats(pb.StatsRequest())
        assert stats.leases_active == 0, "its lease ended with it"


def test_namespaces_are_capped_and_registering_one_again_is_free(store, start_server, namespace):
    server = start_server(store, ServiceLimits(max_namespaces=2))
    with KVStoreClient(server.target, timeout_s=10) as client:
        first = client.register_namespace(namespace)
        client.register_namespace(dataclasses.replace(namespace, cache_salt="tenant-b"))
        with pytest.raises(grpc.RpcError) as info:
            client.register_namespace(dataclasses.replace(namespace, cache_salt="tenant-c"))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_namespaces=2" in info.value.details()
        assert client.register_namespace(namespace) == first
    assert len(store.namespaces()) == 2


def test_namespaces_registered_at_once_do_not_overshoot_the_cap(store, start_server, namespace):
    server = start_server(store, ServiceLimits(max_namespaces=2))
    with grpc.insecure_channel(server.target) as channel:
        register = KVStoreStub(channel).RegisterNamespace
        unstick = hold_store_lock(store)  # every registration is under way before the first completes
        try:
            calls = [register.future(pb.RegisterNamespaceRequest(
                canonical_json=dataclasses.replace(namespace, cache_salt=f"tenant-{i}").canonical_json()), timeout=30)
                for i in range(5)]
            time.sleep(0.3)
        finally:
            unstick.set()
        refused = [call.exception() for call in calls if call.exception() is not None]
    assert [error.code() for error in refused] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 3
    assert len(store.namespaces()) == 2


def test_a_registration_its_client_gave_up_on_still_counts_against_the_cap(store, start_server, namespace):
    """The given-up call's registration goes on (its thread cannot be stopped): the next call must
    see it before checking the cap."""
    server = start_server(store, ServiceLimits(max_namespaces=1))
    requests = [pb.RegisterNamespaceRequest(canonical_json=dataclasses.replace(namespace, cache_salt=salt)
                                            .canonical_json()) for salt in ("first", "second")]
    with grpc.insecure_channel(server.target) as channel:
        register = KVStoreStub(channel).RegisterNamespace
        unstick = hold_store_lock(store)
        try:
            with pytest.raises(grpc.RpcError) as gave_up:
                register(requests[0], timeout=0.3)
            assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            second = register.future(requests[1], timeout=30)
            time.sleep(0.2)
        finally:
            unstick.set()
        assert second.exception() is not None and second.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(store.namespaces()) == 1


def test_a_get_refused_before_it_streams_still_ends_its_lease(store, server, namespace, spec, chain):
    with KVStoreClient(server.target, timeout_s=10) as client, grpc.insecure_channel(server.target) as channel:
        ns_id = client.register_namespace(namespace)
        client.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
        stub = KVStoreStub(channel)
        lease_id = stub.Lookup(pb.LookupRequest(namespace_id=ns_id, block_hashes=chain[:2], lease_ttl_s=600)).lease_id
        with pytest.raises(grpc.RpcError) as info:  # a wrong destination size: refused before anything loads
            list(stub.Get(pb.GetRequest(namespace_id=ns_id, block_hashes=chain[:2], lease_id=lease_id,
                                                        block_bytes=spec.block_bytes + 1)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert not store.lease_alive(lease_id) and client.stats().leases_active == 0, "ended as the call promises"


@pytest.mark.parametrize("rpc", ["Lookup", "GetSlots"])
def test_a_lease_taken_for_a_call_its_client_gave_up_on_is_ended(store, server, namespace, spec, chain, rpc,
                                                                 monkeypatch):
    """The store's lock held (disk I/O under it) past the client's deadline: the lease the store
    grants afterwards belongs to no one who could release it, so it ends at once, not at its TTL."""
    granted = []
    real_lookup = store.lookup

    def recorded(*args, **kw):
        result = real_lookup(*args, **kw)
        granted.append(result.lease_id)
        return result

    monkeypatch.setattr(store, "lookup", recorded)
    with KVStoreClient(server.target, timeout_s=10) as client, grpc.insecure_channel(server.target) as channel:
        ns_id = client.register_namespace(namespace)
        client.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
        request = getattr(pb, f"{rpc}Request")(namespace_id=ns_id, block_hashes=chain[:2], lease_ttl_s=600)
        unstick = hold_store_lock(store)
        try:
            with pytest.raises(grpc.RpcError) as info:
                getattr(KVStoreStub(channel), rpc)(request, timeout=0.3)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            time.sleep(0.2)  # the service has seen the cancellation; the store call still waits for the lock
        finally:
            unstick.set()
        assert until(lambda: granted and granted[-1] is not None), "the store call went on: a hit, so a lease"
        assert until(lambda: store.stats().leases_active == 0), "and that lease was ended"
        assert not store.lease_alive(granted[-1])
