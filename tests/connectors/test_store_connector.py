"""StoreConnector over a real TieredStore (host + disk in a temp dir) and a byte page pool."""

import logging
import os
import threading
import time

import numpy as np
import pytest
import torch

from connectors.base import ConnectorHit, LoadFailed
from connectors.store_connector import StoreConnector
from kvstore.errors import InvalidRequest, StoreClosed
from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.segment import HEADER_BYTES
from tests.kvstore.store_helpers import hold_store_lock, until

NS = Namespace("tiny", "cfg", num_layers=3, components=("mla_bf16", "indexer_bf16"), block_size=4)
SPEC = BlockSpec.of(NS)


class BytePool:
    """Per layer one uint8 tensor [pages, layer_bytes]: the PageBytes the connector needs."""

    def __init__(self, pages: int, seed: int | None = None):
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        self.layers = [torch.randint(0, 256, (pages, SPEC.layer_bytes), dtype=torch.uint8, generator=gen)
                       if gen else torch.zeros(pages, SPEC.layer_bytes, dtype=torch.uint8)
                       for _ in range(SPEC.num_layers)]

    def layer_page_bytes(self, layer, page):
        return self.layers[layer][page]


def make_store(tmp_path, **options):
    return TieredStore([HostTier(1 << 20, page_bytes=64 << 10, shm_dir=str(tmp_path)),
                        DiskTier(str(tmp_path / "disk"), 8 << 20)], background_writes=False, **options)


@pytest.fixture
def hashes():
    return namespace_hashes(NS, np.arange(4 * 6))  # 6 blocks


def test_save_then_layerwise_load_round_trips_every_byte(tmp_path, hashes):
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    source = BytePool(8, seed=1)
    connector.save("a", hashes, [2, 3, 4, 5, 6, 7], source, parent=None)
    connector.flush()
    hit = connector.lookup("b", hashes)
    assert hit.blocks == 6 and hit.tokens == 24 and set(hit.tiers) == {"host"}
    target = BytePool(8)
    handle = connector.start_load(hit, hashes, [7, 6, 5, 4, 3, 2], target)
    for layer in range(SPEC.num_layers):
        handle.wait_layer(layer)
        for src_page, dst_page in zip([2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2]):
            assert torch.equal(target.layer_page_bytes(layer, dst_page), source.layer_page_bytes(layer, src_page))
    assert handle.wait() == 6
    assert store.stats().leases_active == 0, "the load ends the lookup's lease"
    connector.close()
    store.close()


def test_hits_come_from_disk_after_a_restart(tmp_path, hashes):
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    source = BytePool(6, seed=2)
    connector.save("a", hashes[:3], [0, 1, 2], source, parent=None)
    connector.save("a", hashes[3:], [3, 4, 5], source, parent=hashes[2])
    connector.close()
    store.close()
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    hit = connector.lookup("b", hashes)
    assert hit.blocks == 6 and set(hit.tiers) == {"disk"}
    target = BytePool(6)
    assert connector.start_load(hit, hashes, range(6), target).wait() == 6
    assert all(torch.equal(target.layers[l], source.layers[l]) for l in range(SPEC.num_layers))
    connector.close()
    store.close()


def test_a_corrupt_block_fails_the_load_instead_of_serving_wrong_bytes(tmp_path, hashes):
    store = TieredStore([DiskTier(str(tmp_path / "disk"), 8 << 20)])  # the only copy is on disk
    connector = StoreConnector(store, NS)
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=3), parent=None)
    connector.flush()
    disk = store.tiers[0]
    entry = disk._index[connector.ns_id + hashes[1]]
    path = os.path.join(disk.path, "segments", f"{entry.segment:08d}.seg")
    with open(path, "r+b") as f:
        f.seek(entry.offset + HEADER_BYTES + 10)
        byte = f.read(1)
        f.seek(entry.offset + HEADER_BYTES + 10)
        f.write(bytes([byte[0] ^ 0xFF]))
    hit = connector.lookup("b", hashes[:2])
    assert hit.blocks == 2
    handle = connector.start_load(hit, hashes, [0, 1], BytePool(2))
    with pytest.raises(LoadFailed):
        handle.wait_layer(0)
    assert handle.wait() == 0 and store.stats().leases_active == 0
    assert connector.lookup("c", hashes[:2]).blocks == 1, "the corrupt block is gone; the hit is shorter"
    connector.close()
    store.close()


def test_lookup_replaces_the_previous_lease_and_release_is_idempotent(tmp_path, hashes):
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=4), parent=None)
    connector.flush()
    connector.lookup("r", hashes)
    connector.lookup("r", hashes)
    assert store.stats().leases_active == 1
    connector.release("r")
    connector.release("r")
    assert store.stats().leases_active == 0
    assert connector.lookup("r", [namespace_hashes(NS, np.arange(100, 104))[0]]).blocks == 0
    connector.close()
    store.close()


def test_a_read_only_connector_loads_but_never_saves(tmp_path, hashes):
    store = make_store(tmp_path)
    writer = StoreConnector(store, NS)
    writer.save("a", hashes[:2], [0, 1], BytePool(2, seed=5), parent=None)
    writer.flush()
    reader = StoreConnector(store, NS, read_only=True)
    reader.save("b", hashes[2:4], [0, 1], BytePool(2, seed=6), parent=hashes[1])
    reader.demote(hashes[4], 0, BytePool(1, seed=7), parent=hashes[3])
    reader.flush()
    assert store.stats().stored_blocks == 2
    hit = reader.lookup("c", hashes)
    assert hit.blocks == 2 and reader.start_load(hit, hashes, [0, 1], BytePool(2)).wait() == 2
    for c in (writer, reader):
        c.close()
    store.close()


def test_demoting_a_block_the_store_holds_saves_nothing_and_one_it_lacks_is_saved(tmp_path, hashes):
    """A device eviction used to copy every layer of the page out for a duplicate the store dropped."""
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    source = BytePool(3, seed=8)
    connector.save("a", hashes[:2], [0, 1], source, parent=None)
    connector.flush()
    before = store.stats()
    connector.demote(hashes[1], 1, source, parent=hashes[0])
    connector.flush()
    after = store.stats()
    assert after.puts == before.puts, "no save of a block the store holds"
    assert after.lookups == before.lookups, "asking is not a lookup: the hit rate is not skewed"
    connector.demote(hashes[2], 2, source, parent=hashes[1])
    connector.flush()
    assert store.stats().stored_blocks == 3
    hit = connector.lookup("b", hashes)
    target = BytePool(3)
    assert hit.blocks == 3 and connector.start_load(hit, hashes, [0, 1, 2], target).wait() == 3
    assert torch.equal(target.layer_page_bytes(1, 2), source.layer_page_bytes(1, 2))
    unstick = hold_store_lock(store)  # busy past the engine's wait: demoted as if missing
    try:
        connector.demote(hashes[0], 0, source, parent=None)
    finally:
        unstick.set()
    connector.flush()
    assert store.stats().puts == after.puts + 2 and store.stats().duplicate_blocks == before.duplicate_blocks + 1
    connector.close()
    store.close()


def stall_reads(tier) -> threading.Event:
    """Make ``tier``'s reads hang until the returned event is set, as a disk that stops answering."""
    unstick, read = threading.Event(), tier.read

    def stalled(*args, **kwargs):
        unstick.wait(30)
        return read(*args, **kwargs)

    tier.read = stalled
    return unstick


@pytest.mark.parametrize("stuck", ["disk read", "store lock"])
def test_a_load_stuck_in_the_store_is_given_up_at_its_deadline_and_never_writes_late(tmp_path, hashes, stuck):
    """A disk read that hangs, or the store's lock held by a thread stuck in I/O: the engine's
    wait ends at ``load_timeout_s`` with ``LoadFailed``, and once the store answers again the
    load writes nothing into the pages the engine has meanwhile recomputed."""
    store = make_store(tmp_path)
    writer = StoreConnector(store, NS)
    writer.save("a", hashes, range(6), BytePool(6, seed=8), parent=None)
    writer.close()
    if stuck == "disk read":  # the blocks are on disk only, as after a restart
        store.close()
        store = make_store(tmp_path)
    connector = StoreConnector(store, NS, load_timeout_s=0.3)
    hit = connector.lookup("b", hashes)
    assert hit.blocks == 6 and set(hit.tiers) == {"disk" if stuck == "disk read" else "host"}
    if stuck == "disk read":
        unstick = stall_reads(store.tiers[1])
    else:
        unstick = hold_store_lock(store)
    target = BytePool(6)
    started = time.monotonic()
    handle = connector.start_load(hit, hashes, range(6), target)
    with pytest.raises(LoadFailed, match="deadline"):
        handle.wait_layer(0)
    assert 0.27 <= time.monotonic() - started < 5
    assert handle.wait() == 0
    for layer in target.layers:  # the engine recomputes into the same pages
        layer.fill_(0xAB)
    if stuck == "disk read":
        assert until(lambda: store.stats().leases_active == 0), "a load given up on ends its lease at once"
        assert connector.lookup("c", hashes).blocks == 0, "right after a disk read hung, hits stop at memory"
    unstick.set()
    assert until(lambda: store.stats().leases_active == 0), "the lease ends once the lock is free"
    handle._thread.join(10)  # the load has done all it will: a page it wrote late would show now
    assert not handle._thread.is_alive()
    assert all(bool((layer == 0xAB).all()) for layer in target.layers), "a late load overwrote recomputed pages"
    fresh = StoreConnector(store, NS)  # this connector skips the disk for its back-off window; the store serves
    again = fresh.lookup("d", hashes)
    assert fresh.start_load(again, hashes, range(6), BytePool(6)).wait() == 6, "the store serves again"
    fresh.close()
    connector.close()
    store.close()


def test_load_timeout_must_be_positive_or_none(tmp_path):
    store = make_store(tmp_path)
    with pytest.raises(ValueError, match="load_timeout_s"):
        StoreConnector(store, NS, load_timeout_s=0)
    assert StoreConnector(store, NS, load_timeout_s=None).load_timeout_s is None
    store.close()


@pytest.mark.parametrize("ttl", [0, -1.0, 3600.5, 7200.0, float("nan")])
def test_a_lease_ttl_the_store_would_refuse_is_refused_at_construction(tmp_path, hashes, ttl):
    """(Accepted, the store refused it at every lookup, inside the engine's step: a wedged engine.)"""
    store = make_store(tmp_path)
    with pytest.raises(ValueError, match=r"lease_ttl_s must be in \(0, 3600\] seconds \(the store's longest lease\)"):
        StoreConnector(store, NS, lease_ttl_s=ttl)
    connector = StoreConnector(store, NS, lease_ttl_s=3600.0)  # the longest lease the store grants
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=3), parent=None)
    connector.flush()
    assert connector.lookup("b", hashes[:2]).blocks == 2
    connector.release("b")
    connector.close()
    store.close()


def closed(*args, **kwargs):
    """Fault injection: what a store call raises once the store is closed."""
    raise StoreClosed("the store is closed")


def test_a_failing_store_is_a_miss_warned_about_once_until_it_answers_again(tmp_path, hashes, caplog):
    """(A closed store's StoreClosed escaped every Engine.step; a sidecar that is down was a miss.)"""
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=3), parent=None)
    connector.flush()
    warning = "the store cannot look up blocks (StoreClosed: the store is closed); lookups are misses until it answers"
    with caplog.at_level(logging.INFO, logger="connectors.store_connector"):
        store.lookup, lookup = closed, store.lookup
        assert connector.lookup("b", hashes) == ConnectorHit("b", 0, NS.block_size, ())
        assert connector.lookup("c", hashes).blocks == 0
        store.lookup = lookup
        assert connector.lookup("d", hashes).blocks == 2
        connector.release("d")
        store.close()  # for good
        assert connector.lookup("e", hashes).blocks == 0
    assert [record.getMessage() for record in caplog.records] == [warning, "the store answers lookups again", warning]
    connector.close()


def test_a_lookup_the_store_refuses_as_a_callers_mistake_still_raises(tmp_path, hashes):
    """Only a closed store is a miss: malformed hashes are a bug to surface, not a miss to hide."""
    connector = StoreConnector(make_store(tmp_path), NS)
    with pytest.raises(InvalidRequest, match="16-byte digests"):
        connector.lookup("a", [b"short"] + list(hashes))
    assert connector.lookup("b", hashes).blocks == 0
    connector.close()


def test_a_store_error_ending_a_lease_is_logged_not_raised_and_other_errors_are_not_swallowed(tmp_path, hashes,
                                                                                              caplog):
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=3), parent=None)
    connector.flush()

    store.try_release, release = closed, store.try_release
    assert connector.lookup("b", hashes).blocks == 2
    with caplog.at_level(logging.DEBUG, logger="connectors.store_connector"):
        connector.release("b")
    assert "failed (StoreClosed: the store is closed); its TTL ends it" in caplog.text
    store.try_release = lambda *args: 1 / 0  # a bug, not the store failing: it surfaces
    assert connector.lookup("c", hashes).blocks == 2
    with pytest.raises(ZeroDivisionError):
        connector.release("c")
    store.try_release = release
    connector.close()
    store.close()


def test_a_lease_that_ends_mid_copy_fails_the_load_from_that_layer_on(tmp_path, hashes):
    """Host blocks are copied straight out of shared memory the lease pins; if the lease ends
    while a layer is being copied (past its TTL here) a slot may have been reused under the copy,
    so that layer and the rest fail, while the layers copied under a live lease stay good."""
    store = make_store(tmp_path)
    source = BytePool(6, seed=10)
    writer = StoreConnector(store, NS)
    writer.save("a", hashes, range(6), source, parent=None)
    writer.close()

    class ExpiringPool(BytePool):
        """Copying layer 1 outlasts the lease, and another lookup then expires it."""

        def layer_page_bytes(self, layer, page):
            if layer == 1 and page == 0:
                time.sleep(0.4)
                store.lookup(connector.ns_id, hashes[:1])
            return super().layer_page_bytes(layer, page)

    connector = StoreConnector(store, NS, lease_ttl_s=0.2)
    hit = connector.lookup("b", hashes)
    assert set(hit.tiers) == {"host"}
    target = ExpiringPool(6)
    handle = connector.start_load(hit, hashes, range(6), target)
    handle.wait_layer(0)
    assert all(torch.equal(target.layers[0][p], source.layers[0][p]) for p in range(6))
    with pytest.raises(LoadFailed, match="lease on 6 blocks ended during the copy"):
        handle.wait_layer(1)
    assert handle.wait() == 0
    connector.close()
    store.close()


def test_host_hits_count_as_loads_from_the_host_tier(tmp_path, hashes):
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS)
    connector.save("a", hashes, range(6), BytePool(6, seed=11), parent=None)
    connector.flush()
    before = store.stats().tier("host").loaded_blocks
    hit = connector.lookup("b", hashes[:4])
    assert connector.start_load(hit, hashes, range(4), BytePool(6)).wait() == 4
    assert store.stats().tier("host").loaded_blocks - before == 4
    connector.close()
    store.close()


def test_lookups_and_releases_never_wait_long_on_a_held_store_lock(tmp_path, hashes):
    """The engine's thread looks up and releases; a thread stuck in disk I/O under the store's lock
    costs a lookup ``lookup_timeout_s`` (then a miss) and a release nothing (it ends later)."""
    store = make_store(tmp_path)
    connector = StoreConnector(store, NS, lookup_timeout_s=0.2)
    connector.save("a", hashes, range(6), BytePool(6, seed=14), parent=None)
    connector.flush()
    assert connector.lookup("r", hashes).blocks == 6
    unstick = hold_store_lock(store)
    started = time.monotonic()
    connector.release("r")
    assert time.monotonic() - started < 1, "release waited on the store's lock"
    started = time.monotonic()
    assert connector.lookup("s", hashes).blocks == 0
    assert 0.18 <= time.monotonic() - started < 3
    started = time.monotonic()
    assert all(connector.lookup(f"s{i}", hashes).blocks == 0 for i in range(10))
    assert time.monotonic() - started < 0.5, "lookups kept waiting on a lock found held"
    unstick.set()
    assert store.stats().counters["busy_lookups"] == 1, "skipped lookups did not even ask the store"
    assert until(lambda: store.stats().leases_active == 0), "the handed-off release ends the lease"
    assert until(lambda: connector.lookup("t", hashes).blocks == 6, 5), "lookups resume after the back-off window"
    connector.close()
    store.close()


def test_the_disk_back_off_stays_open_through_a_cancel_and_a_late_answer(tmp_path, hashes):
    """Two loads stuck on a hung disk: one runs out its deadline (the window opens), the other is
    cancelled (no verdict), then the disk answers long after: neither closes the window, so the
    next request is not made to wait on the disk again."""
    store = make_store(tmp_path)
    writer = StoreConnector(store, NS)
    writer.save("a", hashes, range(6), BytePool(6, seed=15), parent=None)
    writer.close()
    store.close()
    store = make_store(tmp_path, promote_on_hit=False)  # the blocks are on disk only, and stay there
    unstick = stall_reads(store.tiers[1])
    connector = StoreConnector(store, NS, load_timeout_s=0.3)
    first, second = connector.lookup("a", hashes), connector.lookup("b", hashes)
    assert first.blocks == second.blocks == 6
    timed_out = connector.start_load(first, hashes, range(6), BytePool(6))
    cancelled = connector.start_load(second, hashes, range(6), BytePool(6))
    with pytest.raises(LoadFailed, match="deadline"):
        timed_out.wait_layer(0)
    cancelled.cancel()
    assert connector.lookup("c", hashes).blocks == 0, "a cancel closed the window"
    unstick.set()  # the hung reads answer at last
    assert until(lambda: store.stats().leases_active == 0)
    time.sleep(0.1)
    assert connector.lookup("d", hashes).blocks == 0, "an answer after the deadline closed the window"
    connector.close()
    store.close()
