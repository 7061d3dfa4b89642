"""SidecarConnector's layer-by-layer loads: a layer copied out of shared memory is signalled only
when no slot can have been reused under it (within half the slots' lease TTL of the GetSlots
call), the rest only after a successful release."""

import threading

import pytest
import torch

from connectors.base import LoadFailed
from tests.connectors.test_store_connector import NS, SPEC, BytePool


def _held_release(connector, answer: bool = True):
    """Make ``connector``'s slot releases wait for the returned event, then answer ``answer``
    (False: the sidecar said the lease had expired)."""
    go, release = threading.Event(), connector.client.release_grant

    def held(grant, copied):
        assert go.wait(30)
        return release(grant, copied) and answer
    connector.client.release_grant = held
    return go


def _layers_ready_within(handle, seconds: float) -> int:
    """How many leading layers ``handle`` reports in place within ``seconds`` (wait_layer on a thread)."""
    ready = []

    def wait_layers():
        try:
            for layer in range(SPEC.num_layers):
                handle.wait_layer(layer)
                ready.append(layer)
        except LoadFailed:
            pass
    waiter = threading.Thread(target=wait_layers, daemon=True)
    waiter.start()
    waiter.join(seconds)
    return len(ready)


def test_a_mapped_hit_is_signalled_layer_by_layer_before_its_slots_are_released(make_store, sidecars, connectors,
                                                                                hashes):
    """Copies within half the lease's TTL of the GetSlots call need not wait for the release:
    the lease cannot have ended under them, so layer 0 of the suffix can compute meanwhile."""
    sidecar = sidecars(make_store())
    producer, consumer = connectors(sidecar.target, NS), connectors(sidecar.target, NS)
    source = BytePool(8, seed=5)
    producer.save("a", hashes, [2, 3, 4, 5, 6, 7], source, parent=None)
    producer.flush()
    go = _held_release(consumer)
    target = BytePool(8)
    handle = consumer.start_load(consumer.lookup("b", hashes), hashes, [7, 6, 5, 4, 3, 2], target)
    assert _layers_ready_within(handle, 10) == SPEC.num_layers, "a layer waited for the slots' release"
    for layer in range(SPEC.num_layers):
        for src_page, dst_page in zip([2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2]):
            assert torch.equal(target.layer_page_bytes(layer, dst_page), source.layer_page_bytes(layer, src_page))
    assert sidecar.store.stats().leases_active == 2, "the lookup's and the slots' leases are still held"
    go.set()
    assert handle.wait() == 6
    assert sidecar.store.stats().leases_active == 0


def test_only_layers_copied_within_half_the_ttl_of_asking_for_the_slots_are_signalled_early(
        make_store, sidecars, connectors, hashes, monkeypatch):
    """A clock that GetSlots moves 2.5 s and each layer's copy 1 s: with a 10 s lease, layers end
    copying at 3.5, 4.5 and 5.5 s after the call was made, so exactly the first two are proven.
    Reading the clock after GetSlots, checking it before a copy or trusting more than half the
    TTL would signal the third."""
    from connectors import sidecar_connector

    sidecar = sidecars(make_store())
    producer, consumer = connectors(sidecar.target, NS), connectors(sidecar.target, NS, lease_ttl_s=10.0)
    producer.save("a", hashes, [0, 1, 2, 3, 4, 5], BytePool(6, seed=8), parent=None)
    producer.flush()
    now = [1000.0]
    monkeypatch.setattr(sidecar_connector, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])}))
    get_slots, scatter = consumer.client.get_slots, sidecar_connector.scatter_layer

    def slow_get_slots(*args, **kwargs):
        grant = get_slots(*args, **kwargs)
        now[0] += 2.5
        return grant

    def slow_scatter(spec, pool, layer, pages, payloads):
        scatter(spec, pool, layer, pages, payloads)
        now[0] += 1  # one second a layer
    consumer.client.get_slots = slow_get_slots
    monkeypatch.setattr(sidecar_connector, "scatter_layer", slow_scatter)
    go = _held_release(consumer)
    handle = consumer.start_load(consumer.lookup("b", hashes), hashes, [0, 1, 2, 3, 4, 5], BytePool(6))
    assert _layers_ready_within(handle, 1.0) == 2
    go.set()
    assert _layers_ready_within(handle, 10) == SPEC.num_layers and handle.wait() == 6


@pytest.mark.parametrize("expired", [False, True])
def test_layers_copied_too_late_in_the_lease_wait_for_a_successful_release(make_store, sidecars, connectors, hashes,
                                                                          expired):
    sidecar = sidecars(make_store())
    producer, consumer = connectors(sidecar.target, NS), connectors(sidecar.target, NS)
    producer.save("a", hashes, [0, 1, 2, 3, 4, 5], BytePool(6, seed=6), parent=None)
    producer.flush()
    consumer._proven_until = lambda asked: asked  # every copy ends after the proven window
    go = _held_release(consumer, answer=not expired)
    handle = consumer.start_load(consumer.lookup("b", hashes), hashes, [0, 1, 2, 3, 4, 5], BytePool(6))
    assert _layers_ready_within(handle, 0.5) == 0, "a layer was signalled before its copy was proven intact"
    go.set()
    if expired:  # a slot may have been reused under the copy: the engine recomputes
        with pytest.raises(LoadFailed, match="expired during the copy"):
            handle.wait_layer(0)
        assert handle.wait() == 0
    else:
        assert _layers_ready_within(handle, 10) == SPEC.num_layers and handle.wait() == 6


def test_a_lease_reported_expired_after_proven_layers_still_fails_the_load(make_store, sidecars, connectors, hashes):
    """Cannot happen on one host (the proof), but if the sidecar says so within the load's deadline,
    the engine's check after its forward (``wait``) still turns the load into a recompute."""
    sidecar = sidecars(make_store())
    producer, consumer = connectors(sidecar.target, NS), connectors(sidecar.target, NS)
    producer.save("a", hashes, [0, 1, 2, 3, 4, 5], BytePool(6, seed=7), parent=None)
    producer.flush()
    go = _held_release(consumer, answer=False)
    handle = consumer.start_load(consumer.lookup("b", hashes), hashes, [0, 1, 2, 3, 4, 5], BytePool(6))
    assert _layers_ready_within(handle, 10) == SPEC.num_layers
    go.set()
    assert handle.wait() == 0
