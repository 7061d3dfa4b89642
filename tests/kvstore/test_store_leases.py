"""TieredStore leases and namespaces: what protects a hit from eviction, and what keeps tenants,
models and formats apart (including deleting a namespace while one of its blocks is leased).

``SLOTS4`` gives the host tier exactly 4 one-block slots for the tiny 9,216-byte block.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvstore.errors import UnknownLease
from kvstore.keys import namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.results import PutResult
from tests.conftest import payloads_for, tiny_namespace
from tests.kvstore.store_helpers import SLOTS4, hold_store_lock, host_resident, load_all, put_chain, tokens


# ---- leases -------------------------------------------------------------------------------


def test_a_lease_pins_the_hit_until_load_ends_it(make_store, namespace, spec):
    store = make_store(**SLOTS4, background_writes=False)
    ns_id = store.register_namespace(namespace)
    a = namespace_hashes(namespace, tokens(0, 2))
    payloads, _ = put_chain(store, ns_id, spec, a)
    hit = store.lookup(ns_id, a, lease_ttl_s=60)
    assert hit.lease_id is not None and hit.tiers == ("host", "host")
    assert store.stats().leases_active == 1

    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(100, 6)))
    assert host_resident(store, ns_id, a) == [True, True]

    result, dsts = load_all(store, ns_id, spec, a, lease_id=hit.lease_id)
    assert result.tiers == ("host", "host")
    np.testing.assert_array_equal(dsts[1], payloads[1])
    assert store.stats().leases_active == 0
    with pytest.raises(UnknownLease):
        store.release(hit.lease_id)

    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(200, 4)))
    assert host_resident(store, ns_id, a) == [False, False]  # unpinned: evictable again
    store.check_integrity()


def test_leased_views_lend_the_host_tiers_leading_run_and_only_under_the_lease(make_store, namespace, spec, chain):
    store = make_store(**SLOTS4, background_writes=False, promote_on_hit=False)
    ns_id = store.register_namespace(namespace)
    payloads, _ = put_chain(store, ns_id, spec, chain[:6])  # the host tier keeps 4 of 6, the disk all
    hit = store.lookup(ns_id, chain[:6], lease_ttl_s=60)
    in_host = hit.tiers.index("disk")  # the leading host run ends at the first disk-only block
    views = store.leased_views(ns_id, chain[:6], hit.lease_id)
    assert [name for name, _ in views] == ["host"] * in_host and in_host > 0
    for (_, view), payload in zip(views, payloads):
        np.testing.assert_array_equal(view, payload)
        assert not view.flags.writeable
    assert store.leased_views(ns_id, chain[1:6], hit.lease_id)[0][1] is not None  # any leased block
    other = namespace_hashes(namespace, tokens(300, 2))
    put_chain(store, ns_id, spec, other)
    assert store.leased_views(ns_id, other, hit.lease_id) == [], "blocks the lease does not pin are not lent"
    assert store.lease_alive(hit.lease_id)
    store.release(hit.lease_id)
    assert not store.lease_alive(hit.lease_id)
    assert store.leased_views(ns_id, chain[:6], hit.lease_id) == []


def test_a_lease_past_its_ttl_is_dead_once_the_store_expires_it(make_store, namespace, spec, chain):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:2])
    hit = store.lookup(ns_id, chain[:2], lease_ttl_s=0.05)
    assert store.lease_alive(hit.lease_id)
    time.sleep(0.1)
    store.lookup(ns_id, chain[:1])  # any lookup ends leases past their TTL
    assert not store.lease_alive(hit.lease_id)


def test_a_lookup_waits_for_a_held_lock_at_most_wait_s_then_misses(make_store, namespace, spec, chain):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:2])
    unstick = hold_store_lock(store)
    started = time.monotonic()
    busy = store.lookup(ns_id, chain[:2], lease_ttl_s=60, wait_s=0.2)
    assert 0.18 <= time.monotonic() - started < 3
    assert busy.hit_blocks == 0 and busy.lease_id is None
    unstick.set()
    hit = store.lookup(ns_id, chain[:2], lease_ttl_s=60, wait_s=0.2)
    assert hit.hit_blocks == 2
    assert store.stats().counters["busy_lookups"] == 1 and store.stats().lookups == 1


def test_try_release_hands_back_a_lease_it_could_not_end_for_a_held_lock(make_store, namespace, spec, chain):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:2])
    hit = store.lookup(ns_id, chain[:2], lease_ttl_s=60)
    unstick = hold_store_lock(store)
    assert store.try_release(hit.lease_id, 0.05) is False
    unstick.set()
    assert store.stats().leases_active == 1, "a release that could not run left the lease alone"
    assert store.try_release(hit.lease_id, 0.05) is True
    assert store.stats().leases_active == 0
    with pytest.raises(UnknownLease):
        store.try_release(hit.lease_id, 0.05)


def test_release_ends_a_lease_once(make_store, namespace, spec, chain):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:2])
    hit = store.lookup(ns_id, chain, lease_ttl_s=60)
    assert hit.hit_blocks == 2
    store.release(hit.lease_id)
    assert store.stats().leases_active == 0
    with pytest.raises(UnknownLease):
        store.release(hit.lease_id)
    with pytest.raises(UnknownLease):
        store.release(123456)
    # no hit, no lease, and not a refusal either
    miss = store.lookup(ns_id, chain[5:], lease_ttl_s=60)
    assert miss.hit_blocks == 0 and miss.lease_id is None and not miss.lease_refused


def test_lease_expiry_by_ttl_frees_the_pins(make_store, namespace, spec):
    now = [1000.0]
    store = make_store(**SLOTS4, background_writes=False, clock=lambda: now[0])
    ns_id = store.register_namespace(namespace)
    a = namespace_hashes(namespace, tokens(0, 2))
    put_chain(store, ns_id, spec, a)
    hit = store.lookup(ns_id, a, lease_ttl_s=5)
    now[0] += 4.9
    stats = store.stats()
    assert stats.leases_active == 1 and stats.lease_expiries == 0
    now[0] += 0.2
    stats = store.stats()
    assert stats.leases_active == 0 and stats.lease_expiries == 1
    with pytest.raises(UnknownLease):
        store.release(hit.lease_id)
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(100, 4)))
    assert host_resident(store, ns_id, a) == [False, False]
    # a load that names the expired lease is still served (the lease was only protection)
    assert load_all(store, ns_id, spec, a, lease_id=hit.lease_id)[0].tiers == ("disk", "disk")
    store.check_integrity()


def test_max_leases_refuses_further_leases(make_store, namespace, spec, chain):
    store = make_store(background_writes=False, max_leases=2)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:3])
    first = store.lookup(ns_id, chain, lease_ttl_s=60)
    second = store.lookup(ns_id, chain[:1], lease_ttl_s=60)
    third = store.lookup(ns_id, chain, lease_ttl_s=60)
    assert first.lease_id is not None and second.lease_id is not None and first.lease_id != second.lease_id
    assert third.lease_id is None and third.lease_refused and third.hit_blocks == 3
    store.release(first.lease_id)
    fourth = store.lookup(ns_id, chain, lease_ttl_s=60)
    assert fourth.lease_id is not None and not fourth.lease_refused



def test_max_leased_blocks_refuses_a_lease_past_the_blocks_leases_hold(make_store, namespace, spec, chain):
    """The hit is still answered; only its lease is refused. A lookup repeating one hash leases
    that block once per repeat, so it cannot hold more keys than the cap by repeating."""
    store = make_store(background_writes=False, max_leased_blocks=4)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:3])
    first = store.lookup(ns_id, chain, lease_ttl_s=60)
    assert first.lease_id is not None and first.hit_blocks == 3
    second = store.lookup(ns_id, chain, lease_ttl_s=60)
    assert second.lease_id is None and second.lease_refused and second.hit_blocks == 3
    assert store.lookup(ns_id, chain[:1], lease_ttl_s=60).lease_id is not None  # 4 blocks leased: the cap
    store.release(first.lease_id)
    repeated = store.lookup(ns_id, chain[:1] * 4, lease_ttl_s=60)
    assert repeated.lease_id is None and repeated.lease_refused
    assert store.lookup(ns_id, chain[:1] * 3, lease_ttl_s=60).lease_id is not None


# ---- namespaces ----------------------------------------------------------------------------


@pytest.mark.parametrize("change", [
    dict(model="other-mla"),
    dict(components=("mla_fp8_ds",)),
    dict(cache_salt="tenant-b"),
])
def test_namespaces_never_see_each_others_blocks(make_store, namespace, spec, change):
    store = make_store(background_writes=False)
    other = tiny_namespace(**change)
    a_id, b_id = store.register_namespace(namespace), store.register_namespace(other)
    assert a_id != b_id
    same_tokens = tokens(0, 3)
    a_hashes = namespace_hashes(namespace, same_tokens)
    b_hashes = namespace_hashes(other, same_tokens)
    assert not set(a_hashes) & set(b_hashes)
    put_chain(store, a_id, spec, a_hashes)
    assert store.lookup(b_id, b_hashes).hit_blocks == 0
    # even with A's very hash bytes, B's directory is separate
    assert store.lookup(b_id, a_hashes).hit_blocks == 0
    b_spec = BlockSpec.of(other)
    b_payloads = payloads_for(b_spec, a_hashes)
    assert store.put(b_id, a_hashes, b_payloads).stored == 3  # not a duplicate of A's blocks
    result, dsts = load_all(store, b_id, b_spec, a_hashes)
    assert result.complete
    for dst, payload in zip(dsts, b_payloads):
        np.testing.assert_array_equal(dst, payload)
    assert load_all(store, a_id, spec, a_hashes)[0].complete
    store.flush()
    store.check_integrity()


def test_delete_namespace_removes_its_blocks_from_every_tier(make_store, namespace, spec, chain):
    store = make_store(**SLOTS4, background_writes=False)
    other = tiny_namespace(cache_salt="keep-me")
    ns_id, keep_id = store.register_namespace(namespace), store.register_namespace(other)
    put_chain(store, ns_id, spec, chain[:6])
    keep = namespace_hashes(other, tokens(0, 1))
    keep_payloads, _ = put_chain(store, keep_id, spec, keep)
    store.flush()
    assert store.stats().tier("disk").blocks == 7

    assert store.delete_namespace(ns_id) == 6
    store.flush()
    stats = store.stats()
    assert stats.tier("host").blocks == 1 and stats.tier("disk").blocks == 1
    assert store.lookup(ns_id, chain).hit_blocks == 0
    assert not any(store.tiers[1].contains(ns_id + h) for h in chain)
    result, dsts = load_all(store, keep_id, spec, keep)
    assert result.complete
    np.testing.assert_array_equal(dsts[0], keep_payloads[0])
    store.check_integrity()


def delete_under_a_lease(make_store, namespace, spec, stored, leased):
    """A store holding ``stored``, with a lease on ``leased``, whose namespace was then deleted:
    (store, ns_id, payloads, lookup result, blocks delete_namespace reported)."""
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    payloads, _ = put_chain(store, ns_id, spec, stored)
    hit = store.lookup(ns_id, leased, lease_ttl_s=60)
    return store, ns_id, payloads, hit, store.delete_namespace(ns_id)


def test_delete_namespace_under_a_lease_defers_until_release(make_store, namespace, spec, chain):
    store, ns_id, payloads, hit, removed = delete_under_a_lease(make_store, namespace, spec, chain[:4], chain[:2])
    assert removed == 4
    # the unleased blocks are gone at once; the leased ones still hold their bytes
    assert [store.tiers[0].contains(ns_id + h) for h in chain[:4]] == [True, True, False, False]
    assert [store.tiers[1].contains(ns_id + h) for h in chain[:4]] == [True, True, False, False]
    result, dsts = load_all(store, ns_id, spec, chain[:2], lease_id=hit.lease_id)
    assert result.complete
    np.testing.assert_array_equal(dsts[1], payloads[1])
    # the load ended the lease, and with it the deferred removal ran
    stats = store.stats()
    assert stats.tier("host").blocks == 0 and stats.tier("disk").blocks == 0
    assert store.lookup(ns_id, chain).hit_blocks == 0
    store.check_integrity()


def test_delete_namespace_under_a_lease_completes_when_the_lease_expires(make_store, namespace, spec, chain):
    now = [0.0]
    store = make_store(background_writes=False, clock=lambda: now[0])
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:3])
    store.lookup(ns_id, chain[:3], lease_ttl_s=5)
    store.delete_namespace(ns_id)
    assert store.stats().tier("host").blocks == 3
    now[0] = 10.0
    stats = store.stats()
    assert stats.lease_expiries == 1
    assert stats.tier("host").blocks == 0 and stats.tier("disk").blocks == 0
    assert store.lookup(ns_id, chain).hit_blocks == 0
    store.check_integrity()


def test_a_deleted_but_still_leased_block_is_no_longer_a_hit(make_store, namespace, spec, chain):
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:3])
    hit = store.lookup(ns_id, chain[:3], lease_ttl_s=60)
    store.delete_namespace(ns_id)
    assert store.tiers[0].contains(ns_id + chain[0]), "the leased bytes stay for the lease holder"
    again = store.lookup(ns_id, chain[:3], lease_ttl_s=60)
    assert again.hit_blocks == 0 and again.lease_id is None, "nobody new may find or re-lease it"
    store.release(hit.lease_id)
    assert store.stats().tier("host").blocks == 0
    store.check_integrity()


def test_a_lease_past_its_ttl_cannot_be_released_even_before_a_sweep(make_store, namespace, spec, chain):
    now = [0.0]
    store = make_store(background_writes=False, clock=lambda: now[0])
    ns_id = store.register_namespace(namespace)
    put_chain(store, ns_id, spec, chain[:2])
    hit = store.lookup(ns_id, chain[:2], lease_ttl_s=5)
    now[0] = 6.0  # nothing has swept the lease table since it expired
    with pytest.raises(UnknownLease, match="expired"):
        store.release(hit.lease_id)
    assert store.stats().lease_expiries == 1


@pytest.mark.parametrize("lookup_meanwhile", [False, True], ids=["alone", "lookup-meanwhile"])
def test_delete_namespace_during_a_put_removes_the_blocks_being_written(make_store, namespace, spec, chain,
                                                                       lookup_meanwhile):
    """A put whose tier write is under way when the namespace is deleted must not leave its
    blocks behind as hits once it finishes, also when other calls (a lookup ends expired leases
    and removes the deleted blocks they pinned) run in between."""
    store = make_store(background_writes=False)
    ns_id = store.register_namespace(namespace)
    host, writing, finish = store.tiers[0], threading.Event(), threading.Event()
    real_write = host.write

    def slow_write(key, payload, meta):
        writing.set()
        assert finish.wait(10), "the test never let the write finish"
        return real_write(key, payload, meta)

    host.write = slow_write
    put = threading.Thread(target=put_chain, args=(store, ns_id, spec, chain[:1]))
    put.start()
    try:
        assert writing.wait(10)
        assert store.delete_namespace(ns_id) == 0  # nothing was published yet
        if lookup_meanwhile:
            assert store.lookup(ns_id, chain[:1]).hit_blocks == 0
    finally:
        finish.set()
        put.join(10)
    host.write = real_write
    assert store.lookup(ns_id, chain[:1]).hit_blocks == 0
    assert not host.contains(ns_id + chain[0])
    put_chain(store, ns_id, spec, chain[:1])  # the namespace itself stays usable
    assert store.lookup(ns_id, chain[:1]).hit_blocks == 1
    store.check_integrity()


def test_a_deleted_but_leased_block_put_again_is_rejected_until_its_lease_ends(make_store, namespace, spec, chain):
    """Not a duplicate: the copy there goes with its lease, so the caller must be told to retry."""
    store, ns_id, _, hit, _ = delete_under_a_lease(make_store, namespace, spec, chain[:2], chain[:2])
    assert put_chain(store, ns_id, spec, chain[:2])[1] == PutResult(0, 0, 2)
    store.release(hit.lease_id)
    assert store.lookup(ns_id, chain[:2]).hit_blocks == 0
    assert put_chain(store, ns_id, spec, chain[:2])[1] == PutResult(2, 0, 0)
    assert store.lookup(ns_id, chain[:2]).hit_blocks == 2
    store.check_integrity()


def test_a_deleted_but_leased_block_is_loaded_only_by_its_lease_holder(make_store, namespace, spec, chain):
    store, ns_id, payloads, hit, _ = delete_under_a_lease(make_store, namespace, spec, chain[:3], chain[:3])
    stranger, _ = load_all(store, ns_id, spec, chain[:3])  # no lease: as if it had never been stored
    assert stranger.loaded_blocks == 0
    assert store.load_layer(ns_id, chain[0], 0, np.zeros(spec.layer_bytes, np.uint8)) is None
    holder, dsts = load_all(store, ns_id, spec, chain[:3], lease_id=hit.lease_id)
    assert holder.loaded_blocks == 3
    np.testing.assert_array_equal(dsts[2], payloads[2])
    assert store.stats().tier("host").blocks == 0  # gone with the lease
    store.check_integrity()


@pytest.mark.parametrize("reader", ["load_layer", "load"])
def test_a_delete_landing_as_a_read_begins_is_a_miss_for_a_reader_without_the_lease(make_store, namespace, spec,
                                                                                     chain, monkeypatch, reader):
    """Another client's lease pins the blocks; delete_namespace lands just after the reader's
    check that they are readable, as it is about to pin a block. Both read it anyway (its genuine
    bytes, but a deleted block is readable only by its lease holders; load_layer checked in one
    hold of the lock and pinned in another); the check now happens where the block is pinned."""
    store = make_store()
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    store.flush()  # the write-through copies done: nothing else holds the blocks
    other = store.lookup(ns_id, chain[:2], lease_ttl_s=60)
    real_bits = store._bits
    deleted = []

    def delete_first(key):  # the read has passed its first check and is about to pin the block
        if not deleted:
            deleted.append("deleting")  # before the call: it may look blocks up itself
            deleted[0] = store.delete_namespace(ns_id)
        return real_bits(key)

    monkeypatch.setattr(store, "_bits", delete_first)
    if reader == "load_layer":
        assert store.load_layer(ns_id, chain[0], 0, np.zeros(spec.layer_bytes, np.uint8)) is None
    else:
        assert load_all(store, ns_id, spec, chain[:2])[0].loaded_blocks == 0
    assert deleted == [2]
    store.release(other.lease_id)
    assert store.stats().tier("host").blocks == 0 and store.stats().tier("disk").blocks == 0
    store.check_integrity()
