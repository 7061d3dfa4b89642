"""TieredStore under caller mistakes, backpressure and corrupt disk records.

Caller mistakes raise typed errors and store nothing; backpressure is a count in the result; a
corrupt record is a miss (a shorter hit), never wrong bytes.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kvstore.errors import InvalidRequest, UnknownLease, UnknownNamespace
from kvstore.keys import namespace_hashes
from kvstore.tiers.segment import HEADER_BYTES, MAX_LAYERS
from tests.conftest import payloads_for, tiny_namespace

SLOTS4 = dict(host_bytes=64 << 10, page_bytes=16 << 10)


@pytest.fixture
def store(make_store):
    return make_store(background_writes=False)


@pytest.fixture
def ns_id(store, namespace):
    return store.register_namespace(namespace)


def assert_empty(store, ns_id, hashes):
    assert store.lookup(ns_id, hashes).hit_blocks == 0
    stats = store.stats()
    assert stats.stored_blocks == 0
    assert all(t.blocks == 0 for t in stats.tiers)


# ---- bad input -----------------------------------------------------------------------------


def test_a_wrong_payload_size_rejects_the_whole_batch(store, ns_id, spec, chain):
    payloads = payloads_for(spec, chain[:3])
    payloads[2] = payloads[2][:-1]
    with pytest.raises(InvalidRequest, match=str(spec.block_bytes)):
        store.put(ns_id, chain[:3], payloads)
    assert_empty(store, ns_id, chain[:3])
    store.check_integrity()


@pytest.mark.parametrize("bad", [b"\x00" * 15, b"\x00" * 17, b"", "0" * 16, 12345, None])
def test_malformed_hashes_are_invalid_requests(store, ns_id, spec, chain, bad):
    hashes = [chain[0], bad]
    with pytest.raises(InvalidRequest):
        store.lookup(ns_id, hashes)
    with pytest.raises(InvalidRequest):
        store.put(ns_id, hashes, payloads_for(spec, chain[:2]))
    with pytest.raises(InvalidRequest):
        store.load(ns_id, hashes, [np.zeros(spec.block_bytes, np.uint8) for _ in hashes])
    with pytest.raises(InvalidRequest):
        store.load_layer(ns_id, bad, 0, np.zeros(spec.layer_bytes, np.uint8))
    with pytest.raises(InvalidRequest):
        store.put(ns_id, chain[1:2], payloads_for(spec, chain[1:2]), parent=bad if bad else b"x")
    assert_empty(store, ns_id, chain)
    assert store.stats().lookups == 1  # only assert_empty's own, valid lookup counted


def test_mismatched_counts_are_invalid_requests(store, ns_id, spec, chain):
    with pytest.raises(InvalidRequest, match="2 block hashes but 1"):
        store.put(ns_id, chain[:2], payloads_for(spec, chain[:1]))
    assert_empty(store, ns_id, chain)
    store.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    with pytest.raises(InvalidRequest, match="2 block hashes but 3"):
        store.load(ns_id, chain[:2], [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)])


def test_unknown_namespace(store, spec, chain):
    unknown = tiny_namespace(model="never-registered").id
    dst = np.zeros(spec.block_bytes, np.uint8)
    for call in (
        lambda: store.lookup(unknown, chain),
        lambda: store.put(unknown, chain[:1], [dst]),
        lambda: store.load(unknown, chain[:1], [dst]),
        lambda: store.load_layer(unknown, chain[0], 0, dst[: spec.layer_bytes]),
        lambda: store.delete_namespace(unknown),
    ):
        with pytest.raises(UnknownNamespace, match="register_namespace"):
            call()


def test_read_only_and_wrong_size_destinations(store, ns_id, spec, chain):
    payloads = payloads_for(spec, chain[:2])
    store.put(ns_id, chain[:2], payloads)
    frozen = np.zeros(spec.block_bytes, np.uint8)
    frozen.flags.writeable = False
    for dst in (frozen, bytes(spec.block_bytes)):
        with pytest.raises(InvalidRequest, match="read-only"):
            store.load(ns_id, chain[:1], [dst])
    assert not frozen.any()
    with pytest.raises(InvalidRequest):
        store.load(ns_id, chain[:1], [np.zeros(spec.block_bytes + 1, np.uint8)])
    with pytest.raises(InvalidRequest):
        store.load_layer(ns_id, chain[0], 0, np.zeros(spec.block_bytes, np.uint8))  # a block, not a layer
    with pytest.raises(InvalidRequest, match="out of range"):
        store.load_layer(ns_id, chain[0], spec.num_layers, np.zeros(spec.layer_bytes, np.uint8))
    with pytest.raises(InvalidRequest, match="contiguous"):
        store.load(ns_id, chain[:1], [np.zeros((spec.block_bytes, 2), np.uint8)[:, 0]])
    assert store.stats().tier("host").loaded_blocks == 0


def test_a_failed_load_still_ends_its_lease(store, ns_id, spec, chain):
    store.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    hit = store.lookup(ns_id, chain[:2], lease_ttl_s=60)
    with pytest.raises(InvalidRequest):
        store.load(ns_id, chain[:2], [np.zeros(1, np.uint8)] * 2, lease_id=hit.lease_id)
    assert store.stats().leases_active == 0
    with pytest.raises(UnknownLease):
        store.release(hit.lease_id)


def test_a_load_whose_read_ahead_fails_to_start_leaves_no_block_pinned(make_store, namespace, spec, chain):
    store = make_store(host_bytes=None)
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain[:3], payloads_for(spec, chain[:3]))

    def fails(keys):
        raise MemoryError("no room for read-ahead buffers")

    store.tiers[0].prefetch = fails
    with pytest.raises(MemoryError):
        store.load(ns_id, chain[:3], [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)])
    assert not any(store._leases.is_pinned(ns_id + h) for h in chain[:3]), "pinned blocks could never be evicted"
    store.check_integrity()


def test_duplicate_put_keeps_the_first_bytes(store, ns_id, spec, chain):
    payloads = payloads_for(spec, chain[:3])
    assert store.put(ns_id, chain[:2], payloads[:2]).stored == 2
    different = [np.full(spec.block_bytes, 7, np.uint8) for _ in range(3)]
    result = store.put(ns_id, chain[:3], different)
    assert (result.stored, result.duplicates, result.rejected) == (1, 2, 0)
    stats = store.stats()
    assert (stats.puts, stats.stored_blocks, stats.duplicate_blocks) == (2, 3, 2)
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
    assert store.load(ns_id, chain[:3], dsts).complete
    np.testing.assert_array_equal(dsts[0], payloads[0])
    np.testing.assert_array_equal(dsts[1], payloads[1])
    np.testing.assert_array_equal(dsts[2], different[2])


def test_put_with_everything_pinned_is_rejected_not_raised(make_store, namespace, spec, chain):
    store = make_store(**SLOTS4, disk_bytes=None)
    ns_id = store.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:4])
    assert store.put(ns_id, chain[:4], payloads).stored == 4
    hit = store.lookup(ns_id, chain[:4], lease_ttl_s=60)
    other = namespace_hashes(namespace, np.arange(500, 512))
    result = store.put(ns_id, other, payloads_for(spec, other))
    assert (result.stored, result.duplicates, result.rejected) == (0, 0, 3)
    assert store.stats().rejected_blocks == 3
    assert store.lookup(ns_id, other).hit_blocks == 0
    store.release(hit.lease_id)
    assert store.put(ns_id, other, payloads_for(spec, other)).stored == 3  # room again
    store.check_integrity()


def test_a_block_larger_than_a_host_page_is_refused_at_register(make_store):
    store = make_store(**SLOTS4)
    big = tiny_namespace(num_layers=4)  # 36,864-byte blocks, 16 KiB host pages
    with pytest.raises(InvalidRequest, match="page size"):
        store.register_namespace(big)
    with pytest.raises(UnknownNamespace):
        store.spec(big.id)
    assert store.stats().namespaces == 0


def test_a_namespace_with_more_layers_than_a_disk_record_holds_is_refused_at_register(make_store):
    """Refused later, at the first demotion, its block could not leave the host tier, and every put
    needing room there (any tenant's) failed."""
    store = make_store(host_bytes=8 << 20, page_bytes=4 << 20, write_policy="on_eviction")
    deep = tiny_namespace(num_layers=MAX_LAYERS + 1)
    with pytest.raises(InvalidRequest, match=f"at most {MAX_LAYERS} layers per block"):
        store.register_namespace(deep)
    assert store.stats().namespaces == 0
    assert store.register_namespace(tiny_namespace(num_layers=MAX_LAYERS)) is not None
    assert make_store(host_bytes=8 << 20, page_bytes=4 << 20, disk_bytes=None).register_namespace(deep) == deep.id


# ---- corruption ----------------------------------------------------------------------------


def _flip_disk_byte(disk, key: bytes, payload_offset: int) -> None:
    entry = disk._index[key]
    path = disk._segments[entry.segment].path
    with open(path, "r+b") as f:
        f.seek(entry.offset + HEADER_BYTES + payload_offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("host", [False, True])
def test_a_corrupt_disk_record_is_a_miss_never_wrong_bytes(make_store, namespace, spec, chain, host):
    kw = dict(**SLOTS4, write_policy="on_eviction", promote_on_hit=False) if host else dict(host_bytes=None)
    store = make_store(background_writes=False, **kw)
    ns_id = store.register_namespace(namespace)
    blocks = 8 if host else 5
    payloads = payloads_for(spec, chain[:blocks])
    store.put(ns_id, chain[:blocks], payloads)
    store.flush()
    assert store.lookup(ns_id, chain[:5]).tiers[:4] == ("disk",) * 4  # with a host: 4 demoted tails
    disk = store.tiers[-1]
    _flip_disk_byte(disk, ns_id + chain[2], spec.layer_bytes + 100)  # layer 1 of block 2

    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(5)]
    result = store.load(ns_id, chain[:5], dsts)
    assert result.tiers == ("disk", "disk") and result.nbytes == 2 * spec.block_bytes
    np.testing.assert_array_equal(dsts[0], payloads[0])
    np.testing.assert_array_equal(dsts[1], payloads[1])
    assert not dsts[3].any() and not dsts[4].any()  # past the failed block nothing is touched
    assert store.lookup(ns_id, chain[:5]).hit_blocks == 2
    assert not disk.contains(ns_id + chain[2])
    stats = store.stats()
    assert stats.tier("disk").checksum_failures == 1
    store.check_integrity()


def test_a_corrupt_layer_fails_load_layer_but_the_other_layer_verifies(make_store, namespace, spec, chain):
    store = make_store(host_bytes=None, background_writes=False)
    ns_id = store.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:1])
    store.put(ns_id, chain[:1], payloads)
    disk = store.tiers[0]
    _flip_disk_byte(disk, ns_id + chain[0], spec.layer_bytes + 5)  # layer 1
    layer0 = np.zeros(spec.layer_bytes, np.uint8)
    assert store.load_layer(ns_id, chain[0], 0, layer0) == "disk"
    np.testing.assert_array_equal(layer0, payloads[0][: spec.layer_bytes])
    assert store.load_layer(ns_id, chain[0], 1, np.zeros(spec.layer_bytes, np.uint8)) is None
    assert store.lookup(ns_id, chain[:1]).hit_blocks == 0
    assert store.stats().tier("disk").checksum_failures == 1
    store.check_integrity()


@pytest.mark.parametrize("bad", [b"short", bytearray(16), None, 7, memoryview(bytes(16))])
def test_a_malformed_hash_after_a_valid_hit_is_still_refused(make_store, namespace, spec, chain, bad):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    with pytest.raises(InvalidRequest, match="16-byte digests"):
        store.lookup(ns_id, [chain[0], chain[1], bad])
    assert store.lookup(ns_id, chain[:2]).hit_blocks == 2


@pytest.mark.parametrize("ttl", [0, -5.0, float("inf"), float("nan"), 3601.0])
def test_a_lease_ttl_must_be_positive_and_bounded(make_store, namespace, spec, chain, ttl):
    """An endless lease would pin its blocks forever: a client could fill a tier for good."""
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain, payloads_for(spec, chain))
    with pytest.raises(InvalidRequest, match=r"lease_ttl_s must be in \(0, 3600\] seconds"):
        store.lookup(ns_id, chain, lease_ttl_s=ttl)
    assert store.stats().leases_active == 0
    assert store.lookup(ns_id, chain, lease_ttl_s=3600.0).lease_id is not None  # the bound itself is fine


@pytest.mark.parametrize("case", ["parent_in_chain", "block_twice"])
def test_a_chain_that_loops_is_rejected_and_stores_nothing(make_store, namespace, spec, chain, case):
    """A cold miss written as ``parent=hashes[loaded - 1]`` with loaded == 0 names the chain's own
    last block as its parent: a loop of blocks that are each other's children, never evictable."""
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    hashes, parent = (chain[:3], chain[2]) if case == "parent_in_chain" else ([chain[0], chain[1], chain[0]], None)
    with pytest.raises(InvalidRequest, match="must be distinct and must not include its parent"):
        store.put(ns_id, hashes, payloads_for(spec, hashes), parent=parent)
    assert store.stats().tier("host").blocks == 0
    assert store.put(ns_id, chain[:3], payloads_for(spec, chain[:3])).stored == 3
    store.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_two_puts_that_would_make_a_loop_are_refused_and_the_tier_stays_evictable(make_store, namespace, spec,
                                                                                   chain, policy):
    """``put([A], parent=B)`` then ``put([B], parent=A)`` would make A and B each other's parent:
    never leaves, never evicted. The second put is refused, so A stays a leaf and goes when the
    tier fills (LRU: first)."""
    store = make_store(background_writes=False, policy=policy, host_bytes=64 << 10, page_bytes=16 << 10,
                       disk_bytes=None)  # 4 slots
    ns_id = store.register_namespace(namespace)
    a, b = chain[0], chain[1]
    assert store.put(ns_id, [a], payloads_for(spec, [a]), parent=b).stored == 1
    with pytest.raises(InvalidRequest, match="would make a block its own ancestor"):
        store.put(ns_id, [b], payloads_for(spec, [b]), parent=a)
    assert store.lookup(ns_id, [b]).hit_blocks == 0
    heads = [namespace_hashes(namespace, np.arange(1000 * i, 1000 * i + 4))[0] for i in range(1, 6)]
    for head in heads:  # five one-block prompts through four slots
        assert store.put(ns_id, [head], payloads_for(spec, [head])).stored == 1
    if policy == "lru":
        assert not store.tiers[0].contains(ns_id + a)
    store.check_integrity()


def test_a_block_re_put_after_its_children_stayed_is_no_loop(make_store, namespace, spec, chain):
    """The common case the loop check walks for: a block dropped while its children stayed, stored
    again under its true parent."""
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain[:4], payloads_for(spec, chain[:4]))
    store.delete_namespace(ns_id)
    store.put(ns_id, chain[2:4], payloads_for(spec, chain[2:4]), parent=chain[1])  # children first
    assert store.put(ns_id, chain[1:2], payloads_for(spec, chain[1:2]), parent=chain[0]).stored == 1
    store.check_integrity()


def test_a_loop_already_on_disk_is_removed_at_restart_not_adopted(make_store, tmp_path, namespace, spec, chain):
    """Blocks written as each other's ancestors before ``put`` refused loops: adopting them would
    leave blocks no policy can ever evict. They are removed; the rest of the tier is adopted."""
    from kvstore.checksum import layer_checksums
    from kvstore.tiers.base import BlockMeta
    from kvstore.tiers.disk import DiskTier

    ns_id = namespace.id
    a, b, c, head = (ns_id + h for h in chain[:4])
    parents = {a: b, b: a, c: a, head: None}  # a <-> b loop, c hangs off it, head is a clean chain
    disk = DiskTier(str(tmp_path / "disk"), 4 << 20, segment_bytes=1 << 20, durable=False)
    for key, parent in parents.items():
        payload = payloads_for(spec, [key[16:]])[0]
        disk.write(key, payload, BlockMeta(spec.block_bytes, spec.num_layers,
                                           layer_checksums(payload, spec.num_layers), parent))
    disk.close()

    store = make_store(host_bytes=None, disk_dir=tmp_path / "disk", background_writes=False)
    tier = store.tiers[0]
    assert not tier.contains(a) and not tier.contains(b)
    assert tier.contains(head) and tier.contains(c)  # an orphan now: a leaf, evictable
    store.register_namespace(namespace)
    assert store.lookup(ns_id, [chain[3]]).hit_blocks == 1
    store.check_integrity()


def reopened_with_three_blocks_on_disk(make_store, namespace, spec, chain):
    """A store whose disk alone holds ``chain[:3]`` (the host tier is fresh), its namespace id and
    its disk tier; skips the test where the file system has no O_DIRECT (no read-ahead run)."""
    store = make_store(host_bytes=64 << 10, page_bytes=16 << 10, background_writes=False)
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain[:3], payloads_for(spec, chain[:3]))
    store.flush()
    store.close()
    store = make_store(host_bytes=64 << 10, page_bytes=16 << 10, background_writes=False)
    store.register_namespace(namespace)
    if not store.tiers[1].direct_io:
        pytest.skip("this file system has no O_DIRECT: no read-ahead run")
    return store, ns_id, store.tiers[1]


def test_a_load_stopped_by_an_error_ends_the_read_ahead_it_started(make_store, namespace, spec, chain):
    """Promoting block 0 raises: the disk's read-ahead of blocks 1, 2 must not stay open (its
    buffers and the segments they read, deleted or not, held until this thread's next read)."""
    store, ns_id, disk = reopened_with_three_blocks_on_disk(make_store, namespace, spec, chain)

    def fails(*args, **kwargs):
        raise OSError("injected: the host tier cannot take the promoted block")

    store.tiers[0].write = fails
    with pytest.raises(OSError, match="injected"):
        store.load(ns_id, chain[:3], [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)])
    assert disk._runs.current() is None, "the read-ahead run stayed open"
    assert not any(store._leases.is_pinned(ns_id + h) for h in chain[:3])


def test_a_full_load_whose_last_disk_block_was_promoted_meanwhile_ends_its_read_ahead(make_store, namespace,
                                                                                      spec, chain):
    """Another thread loads (and so promotes) block 2 while this load reads block 1 from disk: this
    load then takes block 2 from memory and completes, and its read-ahead run must still end (it
    held span buffers and segment descriptors, deleted segments included, past ``close``)."""
    import threading

    store, ns_id, disk = reopened_with_three_blocks_on_disk(make_store, namespace, spec, chain)
    read = disk.read

    def read_then_promote_block_2(key, dst, *args, **kwargs):
        done = read(key, dst, *args, **kwargs)
        if key == ns_id + chain[1]:
            other = threading.Thread(target=store.load, args=(ns_id, chain[2:3], [np.zeros(spec.block_bytes, np.uint8)]))
            other.start()
            other.join()
        return done
    disk.read = read_then_promote_block_2
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
    result = store.load(ns_id, chain[:3], dsts)
    assert result.tiers == ("disk", "disk", "host"), "the timing this test needs did not happen"
    assert all((d == p).all() for d, p in zip(dsts, payloads_for(spec, chain[:3])))
    assert disk._runs.current() is None, "the read-ahead run stayed open after a full load"


def test_a_tier_whose_flush_raises_at_close_is_still_closed(make_store, tmp_path, namespace):
    """Its directory lock must be let go: before, a reopen in the same process was refused."""
    from kvstore.tiers.disk import DiskTier

    store = make_store(host_bytes=None, background_writes=False)
    store.register_namespace(namespace)

    def fails():
        raise OSError("injected: fdatasync failed")

    store.tiers[0].flush = fails
    with pytest.raises(OSError, match="injected"):
        store.close()
    DiskTier(str(tmp_path / "disk"), 4 << 20).close()


def test_checking_a_closed_store_says_it_is_closed(make_store, namespace):
    from kvstore.errors import StoreClosed

    store = make_store()
    store.register_namespace(namespace)
    store.close()
    with pytest.raises(StoreClosed, match="closed"):
        store.check_integrity()


def test_a_disk_error_after_a_verified_read_still_serves_the_block_unpromoted(make_store, namespace, spec, chain,
                                                                              monkeypatch):
    """Promoting a block read from disk re-read its record header (``DiskTier.meta``), whose EIO
    escaped ``load`` after the block had been served."""
    store = make_store(host_bytes=64 << 10, page_bytes=16 << 10, background_writes=False)
    ns_id = store.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:1])
    store.put(ns_id, chain[:1], payloads)
    store.close()
    store = make_store(host_bytes=64 << 10, page_bytes=16 << 10, background_writes=False)  # a fresh host tier
    store.register_namespace(namespace)
    disk = store.tiers[1]
    read = disk.read

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "injected: Input/output error")

    def read_then_the_device_fails(*args, **kwargs):
        done = read(*args, **kwargs)
        monkeypatch.setattr(os, "pread", eio)
        monkeypatch.setattr(os, "preadv", eio)
        return done

    disk.read = read_then_the_device_fails
    dst = np.zeros(spec.block_bytes, np.uint8)
    result = store.load(ns_id, chain[:1], [dst])
    monkeypatch.undo()
    assert result.tiers == ("disk",)
    np.testing.assert_array_equal(dst, payloads[0])
    assert store.lookup(ns_id, chain[:1]).tiers == ("disk",)  # not promoted
    assert store.stats().tier("disk").io_errors == 1
    store.check_integrity()
