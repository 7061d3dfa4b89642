"""Both connectors on what an engine may get wrong, and on loads that read no disk: a start_load that
raises ends no lease it cannot give back, a save with too few pages is refused at once, timeouts past
what a wait can take are refused at construction, and a read from memory gives the disk's back-off
no verdict."""

from __future__ import annotations

import threading
import time

import pytest

from connectors.factory import connector_from_config
from connectors.sidecar_connector import SidecarConnector
from connectors.store_connector import StoreConnector
from kvstore.errors import InvalidRequest
from tests.connectors.test_store_connector import NS, BytePool, make_store

PAST_ANY_WAIT = threading.TIMEOUT_MAX * 2


@pytest.fixture(params=["store", "sidecar"])
def connected(request, tmp_path, sidecars, connectors):
    """(connector, store): a StoreConnector over the store, or a SidecarConnector to a sidecar over it."""
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS) if request.param == "store" else connectors(sidecars(store).target, NS)
    yield connector, store
    if request.param == "store":
        connector.close()
    store.close()


def test_a_start_load_that_raises_leaves_its_lease_to_release(connected, hashes):
    """Before session 34 the lease was taken from the request first: a page outside the pool then
    raised, and neither release nor close could end the lease, which pinned its blocks for its TTL."""
    connector, store = connected
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=1), parent=None)
    connector.flush()
    hit = connector.lookup("b", hashes[:2])
    assert hit.blocks == 2 and store.stats().leases_active == 1
    with pytest.raises(IndexError):
        connector.start_load(hit, hashes, [9, 0], BytePool(2))  # page 9 is outside a 2-page pool
    connector.release("b")
    deadline = time.monotonic() + 10
    while store.stats().leases_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats().leases_active == 0


def test_a_save_with_fewer_pages_than_blocks_is_refused_on_the_engines_thread(connected, hashes):
    """Before session 34 it was dropped later, on the writer's thread, storing nothing."""
    connector, store = connected
    with pytest.raises(ValueError, match="3 blocks to save but 2 pages"):
        connector.save("a", hashes[:3], [0, 1], BytePool(2, seed=1), parent=None)
    connector.save("a", hashes[:3], [0, 1, 2], BytePool(3, seed=1), parent=None)
    connector.flush()
    assert store.stats().stored_blocks == 3


@pytest.mark.parametrize("bad", [float("inf"), PAST_ANY_WAIT, 0, float("nan")])
def test_a_lookup_timeout_no_wait_can_take_is_refused(tmp_path, bad):
    """Before session 34 an infinite lookup_timeout_s was taken: every lookup then raised
    OverflowError in the engine's step (StoreConnector), or timed out at once (SidecarConnector)."""
    store = make_store(tmp_path)
    try:
        with pytest.raises(ValueError, match="lookup_timeout_s must be positive seconds up to"):
            StoreConnector(store, NS, lookup_timeout_s=bad)
        with pytest.raises(ValueError, match="lookup_timeout_s must be positive seconds up to"):
            SidecarConnector("127.0.0.1:1", NS, lookup_timeout_s=bad)
        with pytest.raises(ValueError, match=r"timeout_s must be positive seconds up to .*, or None"):
            SidecarConnector("127.0.0.1:1", NS, timeout_s=bad)
    finally:
        store.close()


@pytest.mark.parametrize("value", ["inf", "1e300"])
def test_a_load_timeout_variable_past_any_wait_is_refused_naming_it(value):
    with pytest.raises(InvalidRequest, match="^KVSTORE_LOAD_TIMEOUT_S=.*positive seconds .* up to"):
        connector_from_config(NS, store=None, environ={"KVSTORE_LOAD_TIMEOUT_S": value})


def test_a_connector_the_factory_cannot_build_closes_the_store_it_opened(tmp_path):
    """Before session 34 each refused call left its store open: a shared-memory segment (a host
    tier's memory) and a writer thread apiece."""
    environ = {"KVSTORE_SHM_DIR": str(tmp_path), "KVSTORE_HOST_CAPACITY": "1MiB", "KVSTORE_HOST_PAGE_BYTES": "64KiB",
               "KVSTORE_DISK_PATH": str(tmp_path / "disk"), "KVSTORE_DISK_CAPACITY": "8MiB"}
    for options in ({"lease_ttl_s": -1}, {"timeout_s": 5.0}):  # a bad value; an option only a sidecar takes
        with pytest.raises((ValueError, TypeError)):
            connector_from_config(NS, environ=environ, **options)
    assert not list(tmp_path.glob("kvstore-*")), "a store was left open"
    connector = connector_from_config(NS, environ=environ)
    assert len(list(tmp_path.glob("kvstore-*"))) == 1
    connector.close()


def test_a_load_from_memory_does_not_close_the_disks_back_off_window(tmp_path, hashes):
    """A host-tier hit whose lease lapsed before the load reads its blocks through the store, not
    from the disk. Before session 34 the StoreConnector took that read as the disk answering and
    closed the window a hung disk had opened: the next request waited out its deadline on it."""
    store = make_store(tmp_path, promote_on_hit=False)
    connector = StoreConnector(store, NS, lease_ttl_s=0.2, load_timeout_s=1)
    try:
        connector.save("a", hashes, range(6), BytePool(6, seed=1), parent=None)
        connector.flush()
        hit = connector.lookup("r", hashes)
        assert hit.blocks == 6 and set(hit.tiers) == {"host"}
        connector._lower_tiers.hung()  # as after a load that hung on the disk: the window opens
        assert connector._lower_tiers.usable(["disk"], 1) == 0
        time.sleep(0.3)
        store.lookup(connector.ns_id, hashes[:1])  # sweeps the lapsed lease
        assert connector.start_load(hit, hashes, range(6), BytePool(6)).wait() == 6
        assert connector._lower_tiers.usable(["disk"], 1) == 0, "a read from memory closed the disk's window"
    finally:
        connector.close()
        store.close()
