"""TieredStore narratives over a real host tier and a real disk tier.

The tiny namespace has 9,216-byte blocks. With ``host_bytes=64 KiB`` and ``page_bytes=16 KiB`` the
host tier has exactly 4 one-block slots, so a few puts force evictions whose order we can assert
block by block. On disk each block takes 16 KiB (header page + 3 payload pages).
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from kvstore.errors import InvalidRequest, StoreClosed, UnknownNamespace
from kvstore.keys import namespace_hashes
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from tests.conftest import payloads_for
from tests.kvstore.store_helpers import DISK_BLOCK, SLOTS4, host_resident, load_all, put_chain, tokens


# ---- narrative ---------------------------------------------------------------------------


def test_put_lookup_load_round_trip(make_store, namespace, spec, chain):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    payloads, put = put_chain(store, ns_id, spec, chain[:6])
    assert (put.stored, put.duplicates, put.rejected) == (6, 0, 0)

    assert store.register_namespace(namespace) == ns_id  # idempotent: the blocks stay
    hit = store.lookup(ns_id, chain)
    assert hit.num_blocks == 10 and hit.hit_blocks == 6 and hit.hit_tokens == 24
    assert hit.tiers == ("host",) * 6
    assert hit.lease_id is None and not hit.lease_refused

    result, dsts = load_all(store, ns_id, spec, chain[:6])
    assert result.complete and result.tiers == ("host",) * 6
    assert result.nbytes == 6 * spec.block_bytes
    for dst, payload in zip(dsts, payloads):
        np.testing.assert_array_equal(dst, payload)

    # a longer request stops at the first missing block and leaves later buffers untouched
    result, dsts = load_all(store, ns_id, spec, chain)
    assert result.loaded_blocks == 6 and not result.complete
    assert all(not dst.any() for dst in dsts[6:])
    store.flush()
    store.check_integrity()


def test_holds_answers_as_a_lookup_would_without_counting_or_leasing(make_store, namespace, spec, chain):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:2])
    lease = store.lookup(ns_id, chain[:2], lease_ttl_s=60).lease_id
    before = store.stats()
    assert store.holds(ns_id, chain[1]) and not store.holds(ns_id, chain[2])
    after = store.stats()
    assert (after.lookups, after.hit_blocks, after.leases_active) == (before.lookups, before.hit_blocks, 1)
    store.delete_namespace(ns_id)  # still pinned by the lease: resident, but no longer a hit
    store.register_namespace(namespace)
    assert not store.holds(ns_id, chain[0])
    store.release(lease)
    with pytest.raises(InvalidRequest):
        store.holds(ns_id, b"short")


def test_lookup_of_a_prompt_sharing_a_prefix_hits_exactly_the_shared_blocks(make_store, namespace, spec):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    first = tokens(0, 6)
    put_chain(store, ns_id, spec, namespace_hashes(namespace, first))

    second = first.copy()
    second[13] = 9999  # token 13 lies in block 3: blocks 0..2 are shared
    other = namespace_hashes(namespace, second)
    assert store.lookup(ns_id, other).hit_blocks == 3

    # a prompt that differs in its very first token shares nothing, even with equal later tokens
    third = first.copy()
    third[0] = 7777
    assert store.lookup(ns_id, namespace_hashes(namespace, third)).hit_blocks == 0
    # a partial trailing block is never hashed, so it never counts
    assert len(namespace_hashes(namespace, first[:15])) == 3


def test_torch_and_bytes_buffers_are_accepted(make_store, namespace, spec, chain):
    torch = pytest.importorskip("torch")
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    payload = payloads_for(spec, chain[:1])[0]
    assert store.put(ns_id, chain[:1], [payload.tobytes()]).stored == 1
    dst = torch.zeros(spec.block_bytes // 2, dtype=torch.bfloat16)
    assert store.load(ns_id, chain[:1], [dst]).complete
    np.testing.assert_array_equal(dst.view(torch.uint8).numpy(), payload)


def _without_lookup_counters(stats):
    return replace(
        stats, lookups=0, lookup_blocks=0, hit_blocks=0,
        tiers=tuple(replace(t, hit_blocks=0) for t in stats.tiers),
    )


def test_lookup_is_side_effect_free(make_store, namespace, spec):
    store = make_store(**SLOTS4, background_writes=False)
    ns_id = store.register_namespace(namespace)
    a = namespace_hashes(namespace, tokens(0, 2))
    b = namespace_hashes(namespace, tokens(100, 2))
    put_chain(store, ns_id, spec, a)
    put_chain(store, ns_id, spec, b)  # host: a0 a1 b0 b1; a is the colder chain
    store.flush()
    before = store.stats()

    for _ in range(5):
        assert store.lookup(ns_id, a).tiers == ("host", "host")
    after = store.stats()
    assert after.lookups == before.lookups + 5
    assert after.lookup_blocks == before.lookup_blocks + 10
    assert after.hit_blocks == before.hit_blocks + 10
    assert after.tier("host").hit_blocks == before.tier("host").hit_blocks + 10
    assert _without_lookup_counters(after) == _without_lookup_counters(before)

    # eviction order unchanged: a is still the coldest, so a's tail goes first
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(200, 1)))
    assert host_resident(store, ns_id, a) == [True, False]
    assert host_resident(store, ns_id, b) == [True, True]


def test_load_does_change_eviction_order(make_store, namespace, spec):
    store = make_store(**SLOTS4, background_writes=False)
    ns_id = store.register_namespace(namespace)
    a = namespace_hashes(namespace, tokens(0, 2))
    b = namespace_hashes(namespace, tokens(100, 2))
    put_chain(store, ns_id, spec, a)
    put_chain(store, ns_id, spec, b)
    assert load_all(store, ns_id, spec, a)[0].complete  # a becomes the warmer chain
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(200, 1)))
    assert host_resident(store, ns_id, a) == [True, True]
    assert host_resident(store, ns_id, b) == [True, False]


def test_load_layer_is_byte_exact_from_host_and_from_disk(make_store, namespace, spec, chain):
    store = make_store(**SLOTS4, background_writes=False, promote_on_hit=False)
    ns_id = store.register_namespace(namespace)
    payloads, _ = put_chain(store, ns_id, spec, chain[:6])  # host keeps 4 of 6, disk all
    tiers = store.lookup(ns_id, chain[:6]).tiers
    in_host = tiers.index("host")
    on_disk = tiers.index("disk")
    for block, where in ((in_host, "host"), (on_disk, "disk")):
        for layer in range(spec.num_layers):
            dst = np.zeros(spec.layer_bytes, np.uint8)
            assert store.load_layer(ns_id, chain[block], layer, dst) == where
            offset, length = spec.layer_range(layer)
            np.testing.assert_array_equal(dst, payloads[block][offset : offset + length])
    dst = np.zeros(spec.layer_bytes, np.uint8)
    assert store.load_layer(ns_id, chain[9], 0, dst) is None
    assert not dst.any()


@pytest.mark.parametrize("layer", [0.5, True, "1", None])
def test_load_layer_refuses_a_layer_that_is_not_a_whole_number(make_store, namespace, spec, chain, layer):
    """0.5 passed the range check and raised TypeError from the tier's slice; True was served as layer 1."""
    store = make_store(**SLOTS4, background_writes=False)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:1])
    dst = np.zeros(spec.layer_bytes, np.uint8)
    with pytest.raises(InvalidRequest, match="layer must be a whole number"):
        store.load_layer(ns_id, chain[0], layer, dst)
    assert store.load_layer(ns_id, chain[0], np.int64(1), dst) == "host"  # a numpy integer is one


def test_load_layer_zero_from_disk_with_promotion_does_not_promote_a_partial_block(make_store, namespace, spec, chain):
    """Only a whole-block load may be promoted: layer 0 alone is not a block."""
    store = make_store(**SLOTS4, background_writes=False, write_policy="on_eviction")
    ns_id = store.register_namespace(namespace)
    payloads, _ = put_chain(store, ns_id, spec, chain[:5])  # chain[3] demoted to disk
    assert store.lookup(ns_id, chain[:5]).tiers[3] == "disk"
    dst = np.zeros(spec.layer_bytes, np.uint8)
    assert store.load_layer(ns_id, chain[3], 0, dst) == "disk"
    np.testing.assert_array_equal(dst, payloads[3][: spec.layer_bytes])
    assert store.lookup(ns_id, chain[:5]).tiers[3] == "disk"
    assert store.stats().tier("host").promotions_in == 0
    store.check_integrity()


# ---- write policies ------------------------------------------------------------------------


def test_write_through_puts_every_block_on_disk_after_flush(make_store, namespace, spec, chain):
    store = make_store(**SLOTS4)  # background writer on
    ns_id = store.register_namespace(namespace)
    payloads, put = put_chain(store, ns_id, spec, chain[:3])
    assert put.stored == 3
    store.flush()
    disk = store.tiers[1]
    assert store.stats().tier("disk").blocks == 3
    for block_hash, payload in zip(chain[:3], payloads):
        dst = np.zeros(spec.block_bytes, np.uint8)
        assert disk.read(ns_id + block_hash, dst)
        np.testing.assert_array_equal(dst, payload)
    assert store.lookup(ns_id, chain[:3]).tiers == ("host",) * 3  # the top copy is named
    store.check_integrity()


def test_on_eviction_demotes_only_the_victim(make_store, namespace, spec, chain):
    store = make_store(**SLOTS4, write_policy="on_eviction", promote_on_hit=False)
    ns_id = store.register_namespace(namespace)
    payloads, _ = put_chain(store, ns_id, spec, chain[:4])
    store.flush()
    stats = store.stats()
    assert stats.tier("host").blocks == 4 and stats.tier("disk").blocks == 0

    put_chain(store, ns_id, spec, chain[4:5], parent=chain[3])
    store.flush()
    stats = store.stats()
    assert stats.tier("disk").demotions_in == 1 and stats.tier("disk").blocks == 1
    assert stats.tier("host").evictions == 1
    assert store.lookup(ns_id, chain[:5]).tiers == ("host", "host", "host", "disk", "host")
    result, dsts = load_all(store, ns_id, spec, chain[:5])
    assert result.tiers == ("host", "host", "host", "disk", "host")
    for dst, payload in zip(dsts, payloads):
        np.testing.assert_array_equal(dst, payload)
    store.check_integrity()


# ---- eviction and promotion ----------------------------------------------------------------


def test_host_eviction_takes_chain_tails_before_heads(make_store, namespace, spec):
    store = make_store(**SLOTS4, background_writes=False)
    ns_id = store.register_namespace(namespace)
    a = namespace_hashes(namespace, tokens(0, 4))
    b = namespace_hashes(namespace, tokens(100, 2))
    put_chain(store, ns_id, spec, a)
    put_chain(store, ns_id, spec, b)
    # b0 took a3's slot, b1 took a2's (the coldest leaf each time); everything is still on disk
    assert store.lookup(ns_id, a).tiers == ("host", "host", "disk", "disk")
    assert store.lookup(ns_id, b).tiers == ("host", "host")
    assert store.stats().tier("host").evictions == 2


def test_tail_goes_first_even_when_it_is_the_most_recently_used(make_store, namespace, spec):
    store = make_store(**SLOTS4, background_writes=False)
    ns_id = store.register_namespace(namespace)
    a = namespace_hashes(namespace, tokens(0, 4))
    put_chain(store, ns_id, spec, a)
    assert load_all(store, ns_id, spec, a[3:])[0].complete  # a3 is now the warmest block
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(100, 1)))
    # plain LRU would drop a0 and strand a1..a3; the chain policy only offers leaves
    assert host_resident(store, ns_id, a) == [True, True, True, False]


@pytest.mark.parametrize("policy", ["lru", "hit_density", "adaptive"])
def test_a_chain_longer_than_the_tier_keeps_its_head_and_stores_no_orphan(make_store, namespace, spec, policy):
    """Before, each block evicted its own parent (the only leaf): 6 of 6 stored, only 3 reachable
    and 1 slot held by a block no lookup could reach."""
    store = make_store(**SLOTS4, disk_bytes=None, background_writes=False, policy=policy)
    ns_id = store.register_namespace(namespace)
    chain = namespace_hashes(namespace, tokens(0, 6))
    _, result = put_chain(store, ns_id, spec, chain)
    assert (result.stored, result.rejected) == (4, 2)
    assert store.lookup(ns_id, chain).hit_blocks == 4 and host_resident(store, ns_id, chain) == [True] * 4 + [False] * 2
    store.check_integrity()


@pytest.mark.parametrize("write_policy", ["on_eviction", "write_through"])
@pytest.mark.parametrize("policy", ["lru", "hit_density", "adaptive"])
def test_with_two_tiers_every_resident_block_of_a_long_chain_stays_reachable(make_store, namespace, spec, policy,
                                                                             write_policy):
    """A chain longer than both tiers, sent again and again. Before, the host dropped (or demoted)
    a parent whose child it then stored, and the disk, counting only its own children, took that
    parent for a leaf and evicted its last copy: the child and all after it were held but never
    hit (a 300-block prompt sent 4 times hit 0 of 582 reachable blocks with LRU, write-through)."""
    store = make_store(**SLOTS4, disk_bytes=8 * DISK_BLOCK, background_writes=False, policy=policy,
                       write_policy=write_policy)
    ns_id = store.register_namespace(namespace)
    chain = namespace_hashes(namespace, tokens(0, 16))
    for _ in range(4):
        hit = store.lookup(ns_id, chain).hit_blocks
        resident = {h for h in chain if any(tier.contains(ns_id + h) for tier in store.tiers)}
        assert hit == len(resident), f"{len(resident) - hit} resident blocks no lookup reaches"
        if hit:
            result, dsts = load_all(store, ns_id, spec, chain[:hit])
            assert result.loaded_blocks == hit
        put_chain(store, ns_id, spec, chain)
    assert store.lookup(ns_id, chain).hit_blocks >= 8  # the disk alone holds 8
    store.check_integrity()


def test_a_put_never_evicts_its_parent_and_rejects_what_would_hang_below_a_rejected_block(make_store, namespace, spec):
    """Host full, every block but one leased: the one evictable leaf is the put's own parent."""
    store = make_store(**SLOTS4, disk_bytes=None, background_writes=False)
    ns_id = store.register_namespace(namespace)
    leased = namespace_hashes(namespace, tokens(0, 3))
    head = namespace_hashes(namespace, tokens(100, 1))
    put_chain(store, ns_id, spec, leased)
    put_chain(store, ns_id, spec, head)
    lease = store.lookup(ns_id, leased, lease_ttl_s=60).lease_id
    rest = namespace_hashes(namespace, tokens(104, 3), parent=head[0])
    _, result = put_chain(store, ns_id, spec, rest, parent=head[0])
    assert (result.stored, result.rejected) == (0, 3)
    assert host_resident(store, ns_id, head + rest) == [True, False, False, False]
    store.release(lease)
    store.check_integrity()


@pytest.mark.parametrize("promote", [True, False])
def test_a_disk_hit_is_promoted_only_when_asked(make_store, namespace, spec, promote):
    store = make_store(**SLOTS4, background_writes=False, promote_on_hit=promote)
    ns_id = store.register_namespace(namespace)
    a = namespace_hashes(namespace, tokens(0, 4))
    b = namespace_hashes(namespace, tokens(100, 1))
    payloads, _ = put_chain(store, ns_id, spec, a)
    put_chain(store, ns_id, spec, b)
    assert store.lookup(ns_id, a).tiers == ("host", "host", "host", "disk")

    result, dsts = load_all(store, ns_id, spec, a)
    assert result.tiers == ("host", "host", "host", "disk")
    np.testing.assert_array_equal(dsts[3], payloads[3])
    expected = "host" if promote else "disk"
    assert store.lookup(ns_id, a).tiers == ("host", "host", "host", expected)
    stats = store.stats()
    assert stats.tier("host").promotions_in == (1 if promote else 0)
    assert stats.tier("disk").loaded_blocks == 1
    if promote:  # the promoted copy is byte-exact too
        dst = np.zeros(spec.block_bytes, np.uint8)
        assert store.tiers[0].read(ns_id + a[3], dst)
        np.testing.assert_array_equal(dst, payloads[3])
    store.check_integrity()


# ---- restart -------------------------------------------------------------------------------


def test_restart_finds_everything_on_disk(make_store, namespace, spec, chain, tmp_path):
    disk_dir = tmp_path / "persist"
    first = make_store(**SLOTS4, disk_dir=disk_dir)
    ns_id = first.register_namespace(namespace)
    payloads, _ = put_chain(first, ns_id, spec, chain)
    first.close()

    second = make_store(**SLOTS4, disk_dir=disk_dir, background_writes=False, promote_on_hit=False)
    with pytest.raises(UnknownNamespace):
        second.lookup(ns_id, chain)  # unknown until registered again
    assert second.register_namespace(namespace) == ns_id
    assert second.lookup(ns_id, chain).tiers == ("disk",) * 10
    result, dsts = load_all(second, ns_id, spec, chain)
    assert result.tiers == ("disk",) * 10
    for dst, payload in zip(dsts, payloads):
        np.testing.assert_array_equal(dst, payload)
    second.check_integrity()


def test_restart_keeps_chain_structure_for_eviction(make_store, namespace, spec, chain, tmp_path):
    disk_dir = tmp_path / "persist"
    first = make_store(host_bytes=None, disk_dir=disk_dir)
    ns_id = first.register_namespace(namespace)
    put_chain(first, ns_id, spec, chain)
    first.close()

    second = make_store(host_bytes=None, disk_bytes=10 * DISK_BLOCK, disk_dir=disk_dir)
    second.register_namespace(namespace)
    assert second.lookup(ns_id, chain).hit_blocks == 10
    new = namespace_hashes(namespace, tokens(1000, 3))
    assert second.put(ns_id, new, payloads_for(spec, new)).stored == 3
    # the old chain lost its last three blocks, not its head
    assert second.lookup(ns_id, chain).hit_blocks == 7
    assert [second.tiers[0].contains(ns_id + h) for h in chain] == [True] * 7 + [False] * 3
    second.check_integrity()


def test_restart_with_a_smaller_disk_trims_tails(make_store, namespace, spec, chain, tmp_path):
    disk_dir = tmp_path / "persist"
    first = make_store(host_bytes=None, disk_dir=disk_dir)
    ns_id = first.register_namespace(namespace)
    put_chain(first, ns_id, spec, chain)
    first.close()

    second = make_store(host_bytes=None, disk_bytes=6 * DISK_BLOCK, disk_dir=disk_dir)
    second.register_namespace(namespace)
    assert second.lookup(ns_id, chain).tiers == ("disk",) * 6
    assert second.stats().tier("disk").blocks == 6
    second.check_integrity()


# ---- close ---------------------------------------------------------------------------------


def test_close_is_idempotent_and_finishes_background_writes(make_store, namespace, spec, chain, tmp_path):
    disk_dir = tmp_path / "persist"
    store = make_store(disk_dir=disk_dir)
    ns_id = store.register_namespace(namespace)
    payloads, _ = put_chain(store, ns_id, spec, chain)
    segment_path = store.tiers[0].segment_path
    store.close()
    store.close()
    assert not os.path.exists(segment_path)
    with pytest.raises(StoreClosed):
        load_all(store, ns_id, spec, chain[:1])

    reopened = make_store(host_bytes=None, disk_dir=disk_dir)
    reopened.register_namespace(namespace)
    result, dsts = load_all(reopened, ns_id, spec, chain)
    assert result.complete
    np.testing.assert_array_equal(dsts[-1], payloads[-1])


def test_context_manager_closes(tmp_path, namespace, spec, chain):
    host = HostTier(64 << 10, 16 << 10, shm_dir=str(tmp_path))
    disk = DiskTier(str(tmp_path / "disk"), 1 << 20)
    with TieredStore([host, disk]) as store:
        ns_id = store.register_namespace(namespace)
        assert store.put(ns_id, chain[:2], payloads_for(spec, chain[:2])).stored == 2
    assert not os.path.exists(host.segment_path)
    with pytest.raises(StoreClosed):
        disk.read(ns_id + chain[0], np.zeros(spec.block_bytes, np.uint8))
    store.close()  # still idempotent after the context manager closed it


def test_a_closed_store_refuses_work_with_store_closed(make_store, namespace, chain):
    from kvstore.errors import StoreClosed

    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    store.close()
    for call in (lambda: store.lookup(ns_id, chain), lambda: store.put(ns_id, [], []),
                 lambda: store.register_namespace(namespace), lambda: store.delete_namespace(ns_id)):
        with pytest.raises(StoreClosed):
            call()


def test_loading_a_chain_never_evicts_its_own_later_blocks(make_store, namespace, spec):
    """Promoting block i of a disk hit into a full host demotes host blocks to a full disk; the
    disk victim must never be block i+1 of the chain being loaded."""
    from tests.kvstore.store_helpers import SLOTS4, load_all, put_chain, tokens

    store = make_store(**SLOTS4, disk_bytes=4 * (16 << 10), write_policy="on_eviction", background_writes=False)
    ns_id = store.register_namespace(namespace)
    first = namespace_hashes(namespace, tokens(0, 4))
    payloads, _ = put_chain(store, ns_id, spec, first)
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(500, 4)))  # pushes the first chain to disk
    assert store.lookup(ns_id, first).tiers == ("disk",) * 4
    result, dsts = load_all(store, ns_id, spec, first)
    assert result.complete and result.tiers == ("disk",) * 4
    for got, expected in zip(dsts, payloads):
        np.testing.assert_array_equal(got, expected)
    store.check_integrity()


def test_record_access_refreshes_recency_for_reads_outside_load(make_store, namespace, spec):
    """The sidecar's shared-memory path copies without ``load``; ``record_access`` keeps LRU true."""
    from tests.kvstore.store_helpers import SLOTS4, host_resident, put_chain, tokens

    store = make_store(**SLOTS4, background_writes=False)
    ns_id = store.register_namespace(namespace)
    old = namespace_hashes(namespace, tokens(0, 2))
    put_chain(store, ns_id, spec, old)
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(100, 2)))
    assert store.record_access(ns_id, old, "host") == 2  # read via shared memory: now the most recent
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(200, 2)))
    assert host_resident(store, ns_id, old) == [True, True]
    assert store.stats().tier("host").loaded_blocks == 2
    with pytest.raises(InvalidRequest, match="no tier named"):
        store.record_access(ns_id, old, "gpu")


def test_on_eviction_drops_a_promoted_blocks_disk_copy_before_any_block_held_only_on_disk(make_store, namespace, spec):
    """A promotion leaves the disk copy in place (a later host eviction then costs no write), but
    while the host holds the block that copy is redundant: when the disk needs room it goes first,
    not the least recently used block that lives nowhere else."""
    store = make_store(**SLOTS4, disk_bytes=4 * DISK_BLOCK, write_policy="on_eviction", background_writes=False)
    ns_id = store.register_namespace(namespace)
    x = namespace_hashes(namespace, tokens(0, 1))
    a = namespace_hashes(namespace, tokens(100, 3))
    put_chain(store, ns_id, spec, x)
    put_chain(store, ns_id, spec, a)
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(200, 4)))  # pushes x and a to disk
    assert store.lookup(ns_id, x).tiers == ("disk",) and store.lookup(ns_id, a).tiers == ("disk",) * 3

    x_payload = payloads_for(spec, x)[0]
    result, dsts = load_all(store, ns_id, spec, x)  # promoted: host and disk both hold x now
    assert result.tiers == ("disk",) and host_resident(store, ns_id, x) == [True]
    assert store.tiers[1].contains(ns_id + x[0])
    a_disk = [store.tiers[1].contains(ns_id + h) for h in a]

    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(300, 1)))  # demotes a host block to a full disk
    assert not store.tiers[1].contains(ns_id + x[0])  # the redundant copy made the room
    assert [store.tiers[1].contains(ns_id + h) for h in a] == a_disk  # blocks held only on disk stay
    result, dsts = load_all(store, ns_id, spec, x)
    assert result.tiers == ("host",)
    np.testing.assert_array_equal(dsts[0], x_payload)
    store.check_integrity()
