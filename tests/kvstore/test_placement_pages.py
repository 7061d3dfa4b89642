"""A host tier cuts each page into slots of one size. A block of a size with no free slot and no
free page needs one page emptied: the store evicts one page's blocks (with their descendants),
not victims in policy order until some page happens to empty, which took most of the tier.

Namespace A: 1 layer, 4 KiB slots, 16 per 64 KiB page; namespace B: 4 layers, 8 KiB slots."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from kvstore import Namespace
from kvstore.policies import POLICIES
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

PAGE, PAGES, SLOTS_PER_PAGE = 64 << 10, 8, 16


def key(*parts) -> bytes:
    return hashlib.blake2b(repr(parts).encode(), digest_size=16).digest()


def open_store(tmp_path, policy: str, disk: bool = False):
    tiers = [HostTier(PAGES * PAGE, page_bytes=PAGE, shm_dir=str(tmp_path))]
    if disk:
        tiers.append(DiskTier(str(tmp_path / "disk"), 64 << 20))
    store = TieredStore(tiers, policy=policy)
    a = store.register_namespace(Namespace("a", "x", 1, ("mla_bf16",), block_size=1))
    b = store.register_namespace(Namespace("b", "x", 4, ("mla_bf16",), block_size=1))
    return store, a, b


def fill_with_chains(store, ns, seed: int) -> None:
    """Chains of 1 to 6 blocks over 80 prompts, Pareto-popular: more than the tier holds."""
    rng, nbytes = random.Random(seed), store.spec(ns).block_bytes
    for _ in range(400):
        prompt = int(rng.paretovariate(1.0) * 5) % 80
        keys = [key(prompt, j) for j in range(rng.randint(1, 6))]
        store.put(ns, keys, [np.full(nbytes, prompt % 256, np.uint8)] * len(keys))


def put_one_of_b(store, b):
    before = store.stats().tiers[0].evictions
    result = store.put(b, [key("b")], [np.full(store.spec(b).block_bytes, 7, np.uint8)])
    return result, store.stats().tiers[0].evictions - before


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_block_of_a_new_size_evicts_exactly_one_page_of_single_blocks(tmp_path, policy):
    store, a, b = open_store(tmp_path, policy)
    try:
        nbytes = store.spec(a).block_bytes
        for i in range(PAGES * SLOTS_PER_PAGE):
            store.put(a, [key(i)], [np.full(nbytes, i % 256, np.uint8)])
        assert store.stats().tiers[0].blocks == PAGES * SLOTS_PER_PAGE
        result, evicted = put_one_of_b(store, b)
        assert (result.stored, evicted) == (1, SLOTS_PER_PAGE)  # before: 206 of 256 in a larger tier
        store.check_integrity()
    finally:
        store.close()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_page_of_chains_goes_with_its_descendants_not_half_the_tier(tmp_path, policy, seed):
    """Chains cross pages: a page's blocks go with their descendants elsewhere (a chain loses its
    tail first), and the block is stored. Before: 66 to 115 of the 128 blocks went."""
    store, a, b = open_store(tmp_path, policy)
    try:
        fill_with_chains(store, a, seed)
        result, evicted = put_one_of_b(store, b)
        assert result.stored == 1
        assert evicted < PAGES * SLOTS_PER_PAGE // 2
        assert store.lookup(b, [key("b")]).hit_blocks == 1
        store.check_integrity()
    finally:
        store.close()


def test_no_page_that_can_be_emptied_refuses_the_block_and_evicts_nothing(tmp_path):
    """A reader leases one block on every page: no page can be emptied. Before, every other block
    was evicted and the put refused all the same."""
    store, a, b = open_store(tmp_path, "lru")
    try:
        nbytes = store.spec(a).block_bytes
        keys = [key(i) for i in range(PAGES * SLOTS_PER_PAGE)]
        for i, k in enumerate(keys):
            store.put(a, [k], [np.full(nbytes, i % 256, np.uint8)])
        leases = [store.lookup(a, [keys[page * SLOTS_PER_PAGE]], 60).lease_id for page in range(PAGES)]
        assert all(leases)
        result, evicted = put_one_of_b(store, b)
        assert (result.stored, result.rejected, evicted) == (0, 1, 0)
        assert store.stats().tiers[0].blocks == PAGES * SLOTS_PER_PAGE
    finally:
        store.close()


def test_with_a_disk_tier_below_the_page_s_blocks_are_demoted_and_still_hit(tmp_path):
    store, a, b = open_store(tmp_path, "adaptive", disk=True)
    try:
        nbytes = store.spec(a).block_bytes
        keys = [key(i) for i in range(PAGES * SLOTS_PER_PAGE)]
        for i, k in enumerate(keys):
            store.put(a, [k], [np.full(nbytes, i % 256, np.uint8)])
        result, evicted = put_one_of_b(store, b)
        assert (result.stored, evicted) == (1, SLOTS_PER_PAGE)
        assert store.lookup(b, [key("b")]).tiers == ("host",)
        for i, k in enumerate(keys):  # the page's blocks were demoted, not lost
            hit = store.lookup(a, [k], 10)
            assert hit.hit_blocks == 1
            dst = np.zeros(nbytes, np.uint8)
            assert store.load(a, [k], [dst], hit.lease_id).loaded_blocks == 1 and dst[0] == i % 256
        store.check_integrity()
    finally:
        store.close()
