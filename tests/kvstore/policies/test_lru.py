"""Eviction policies: narratives over small chains that assert the exact victim order."""

from __future__ import annotations

import random

import pytest

from kvstore.errors import InvalidRequest
from kvstore.policies import LRUPolicy, make_policy


def insert_chain(policy, *keys: bytes, parent: bytes | None = None) -> None:
    """Insert keys as one chain, head first (the order a put stores them in)."""
    for key in keys:
        policy.on_insert(key, parent, 100)
        parent = key


def drain(policy, evictable=lambda k: True) -> list[bytes]:
    """Evict everything the policy offers, in order, the way the store's ``_make_room`` does."""
    evicted = []
    victims = policy.victims(evictable)
    try:
        for key in victims:
            policy.on_remove(key)
            evicted.append(key)
    finally:
        victims.close()
    return evicted


def test_tail_goes_before_head_and_colder_chain_first():
    p = LRUPolicy()
    insert_chain(p, b"a0", b"a1", b"a2")  # chain a, older
    insert_chain(p, b"b0", b"b1")  # chain b, newer
    assert len(p) == 5
    assert list(p.victims()) == [b"a2", b"b1"]  # only leaves are offered
    assert list(p.victims()) == [b"a2", b"b1"]  # offering mutates nothing
    assert drain(p) == [b"a2", b"a1", b"a0", b"b1", b"b0"]
    assert len(p) == 0 and list(p.victims()) == []


def test_parent_becomes_candidate_only_after_its_last_child_is_removed():
    p = LRUPolicy()
    insert_chain(p, b"root")
    insert_chain(p, b"x1", b"x2", parent=b"root")  # two branches share the root
    insert_chain(p, b"y1", parent=b"root")
    assert list(p.victims()) == [b"x2", b"y1"]
    p.on_remove(b"x2")
    assert list(p.victims()) == [b"x1", b"y1"]
    p.on_remove(b"x1")
    assert list(p.victims()) == [b"y1"]  # root still has child y1
    p.on_remove(b"y1")
    assert list(p.victims()) == [b"root"]
    assert b"root" in p and b"y1" not in p


def test_on_access_changes_lru_order():
    p = LRUPolicy()
    insert_chain(p, b"a0", b"a1")
    insert_chain(p, b"b0", b"b1")
    insert_chain(p, b"c0")
    assert list(p.victims()) == [b"a1", b"b1", b"c0"]
    p.on_access(b"a1")
    assert list(p.victims()) == [b"b1", b"c0", b"a1"]
    p.on_access(b"c0")
    p.on_access(b"b1")
    assert list(p.victims()) == [b"a1", b"c0", b"b1"]
    p.on_access(b"unknown")  # ignored
    assert list(p.victims()) == [b"a1", b"c0", b"b1"]


def test_access_to_an_inner_block_orders_it_once_it_becomes_a_leaf():
    p = LRUPolicy()
    insert_chain(p, b"a0", b"a1")
    insert_chain(p, b"b0", b"b1")
    p.on_access(b"a0")  # inner block: not a candidate now, but its recency counts later
    assert list(p.victims()) == [b"a1", b"b1"]
    assert drain(p) == [b"a1", b"b1", b"b0", b"a0"]


def test_victims_skips_non_evictable_and_offers_them_next_time():
    p = LRUPolicy()
    insert_chain(p, b"a0", b"a1")
    insert_chain(p, b"b0")
    insert_chain(p, b"c0")
    pinned = {b"a1", b"c0"}
    assert drain(p, lambda k: k not in pinned) == [b"b0"]
    assert list(p.victims()) == [b"a1", b"c0"]  # skipped keys were not lost
    pinned = {b"c0"}
    assert drain(p, lambda k: k not in pinned) == [b"a1", b"a0"]
    assert drain(p) == [b"c0"]


def test_keys_not_removed_stay_candidates_after_a_partial_walk():
    p = LRUPolicy()
    insert_chain(p, b"a0", b"a1")
    insert_chain(p, b"b0")
    insert_chain(p, b"c0")
    victims = p.victims()
    assert next(victims) == b"a1"
    p.on_remove(b"a1")  # the caller evicts the first offer ...
    assert next(victims) == b"a0"  # ... is offered the freed parent (least recent), keeps it
    assert next(victims) == b"b0"  # ... looks at one more and stops
    victims.close()
    assert list(p.victims()) == [b"a0", b"b0", b"c0"]


def test_parent_freed_during_a_walk_is_offered_in_the_same_walk():
    p = LRUPolicy()
    insert_chain(p, b"a0", b"a1")
    insert_chain(p, b"b0")
    seen = []
    for key in p.victims():
        seen.append(key)
        if key == b"a1":
            p.on_remove(key)
    assert seen == [b"a1", b"a0", b"b0"]
    assert list(p.victims()) == [b"a0", b"b0"]


def test_remove_of_unknown_key_is_ignored():
    p = LRUPolicy()
    insert_chain(p, b"a0")
    p.on_remove(b"nope")
    p.on_remove(b"a0")
    p.on_remove(b"a0")
    assert len(p) == 0 and list(p.victims()) == []


def test_child_arriving_before_its_parent_keeps_the_parent_off_the_list():
    """A lower tier receives demoted blocks tail first (the upper tier evicts tails first)."""
    p = LRUPolicy()
    p.on_insert(b"a2", b"a1", 100)
    p.on_insert(b"a1", b"a0", 100)
    p.on_insert(b"a0", None, 100)
    assert list(p.victims()) == [b"a2"]
    assert drain(p) == [b"a2", b"a1", b"a0"]
    assert len(p) == 0 and p._orphans == {}


def test_parent_removed_and_reinserted_under_a_resident_child():
    """A parent dropped (corrupt, deleted) and stored again still has its resident child."""
    p = LRUPolicy()
    insert_chain(p, b"a0", b"a1", b"a2")
    p.on_remove(b"a1")
    assert list(p.victims()) == [b"a0", b"a2"]  # a0 lost its only resident child; it is older
    p.on_insert(b"a1", b"a0", 100)
    assert list(p.victims()) == [b"a2"]
    assert drain(p) == [b"a2", b"a1", b"a0"]
    assert len(p) == 0 and p._orphans == {}


def test_many_accesses_keep_the_heap_bounded():
    p = LRUPolicy()
    keys = [bytes([i]) for i in range(16)]
    for key in keys:
        p.on_insert(key, None, 100)
    rng = random.Random(3)
    last = {}
    for step in range(50_000):
        key = rng.choice(keys)
        p.on_access(key)
        last[key] = step
        assert len(p._heap) <= 4 * len(keys) + 1024 + 1
    assert list(p.victims()) == sorted(keys, key=lambda k: last.get(k, -1))


def test_many_walks_over_pinned_keys_keep_the_heap_bounded():
    p = LRUPolicy()
    insert_chain(p, b"a0", b"a1")
    insert_chain(p, b"b0")
    for _ in range(5_000):
        assert list(p.victims(lambda k: False)) == []
    assert len(p._heap) <= 2
    assert list(p.victims()) == [b"a1", b"b0"]


def test_make_policy():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert make_policy("lru") is not make_policy("lru")
    with pytest.raises(InvalidRequest, match="lru"):
        make_policy("nope")


def test_a_reinserted_key_is_ordered_by_its_new_life_not_a_stale_heap_item():
    """Removed then re-inserted, a key must not be offered by the heap item of its first life."""
    policy = LRUPolicy()
    policy.on_insert(b"k1", None, 1)
    policy.on_insert(b"k2", None, 1)
    policy.on_remove(b"k1")
    policy.on_insert(b"k1", None, 1)  # newest now
    assert list(policy.victims()) == [b"k2", b"k1"]
