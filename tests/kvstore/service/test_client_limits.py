"""Per-client limits: one client cannot take every stream or lease; the error names the limit."""

from __future__ import annotations

import time

import grpc
import pytest

from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ClientLeases, LimitExceeded, ServiceLimits, TransferSlots
from tests.conftest import payloads_for


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
