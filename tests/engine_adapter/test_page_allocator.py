"""PageAllocator narratives: exact page ids, prefix matches and eviction order."""

from __future__ import annotations

import pytest

from engine_adapter.page_allocator import OutOfPages, PageAllocator

H = [bytes([i]) * 16 for i in range(10)]  # stand-in block hashes: chain A = H[0:3], chain B = H[5:7]


def allocator(num_pages: int, evicted: list) -> PageAllocator:
    return PageAllocator(num_pages, on_evict=lambda h, page, parent: evicted.append((h, page, parent)))


def run_chain(pool: PageAllocator, hashes: list[bytes]) -> list[int]:
    """A request that computes ``hashes`` on fresh pages, registers them and finishes."""
    pages = pool.allocate(len(hashes))
    for i, (page, block_hash) in enumerate(zip(pages, hashes)):
        assert pool.register(page, block_hash, hashes[i - 1] if i else None)
    pool.release(pages)
    return pages


def test_free_pages_first_in_order_then_unregistered_pages_return_to_free():
    pool = allocator(4, evicted := [])
    assert pool.allocate(3) == [0, 1, 2] and pool.num_free == 1
    pool.release([0, 1, 2])
    assert pool.num_free == 4 and pool.num_cached == 0
    assert pool.allocate(2) == [3, 2]  # released tail first
    pool.check_integrity()
    assert evicted == []


def test_finished_chain_stays_cached_and_is_found_by_prefix():
    pool = allocator(4, evicted := [])
    assert run_chain(pool, H[0:3]) == [0, 1, 2]
    assert (pool.num_free, pool.num_cached) == (1, 3)
    assert pool.match_prefix([H[0], H[1], H[4]]) == [0, 1]  # stops at the first miss
    assert pool.match_prefix([H[1]]) == [1] and pool.match_prefix([H[4], H[0]]) == []
    pool.pin([0, 1])
    assert (pool.num_cached, pool.ref_count(0)) == (1, 1)
    assert pool.can_allocate(2) and not pool.can_allocate(3)
    assert pool.can_allocate(1, reusing=[2]) and not pool.can_allocate(2, reusing=[2])
    pool.check_integrity()
    assert evicted == []


def test_eviction_is_least_recently_released_first_and_tail_before_head():
    pool = allocator(5, evicted := [])
    run_chain(pool, H[0:3])  # pages 0, 1, 2
    run_chain(pool, H[5:7])  # pages 3, 4, released later
    assert pool.allocate(1) == [2]
    assert evicted == [(H[2], 2, H[1])]  # chain A's tail, with its parent
    assert pool.allocate(2) == [1, 0]
    assert evicted[1:] == [(H[1], 1, H[0]), (H[0], 0, None)]
    assert pool.allocate(1) == [4] and evicted[-1] == (H[6], 4, H[5])
    assert pool.match_prefix(H[0:3]) == [] and pool.match_prefix(H[5:7]) == [3]
    pool.check_integrity()


def test_a_hit_makes_a_chain_recent_again():
    pool = allocator(5, evicted := [])
    run_chain(pool, H[0:2])  # pages 0, 1
    run_chain(pool, H[5:7])  # pages 2, 3
    pool.pin([0, 1])  # chain A hit again, then finished
    pool.release([0, 1])
    assert pool.allocate(4) == [4, 3, 2, 1]  # the free page, then chain B, then A's tail
    assert [e[0] for e in evicted] == [H[6], H[5], H[1]]
    pool.check_integrity()


def test_dropping_the_cache_frees_cached_pages_only_and_demotes_nothing():
    pool = allocator(6, evicted := [])
    run_chain(pool, H[0:3])  # pages 0, 1, 2: cached
    held = pool.allocate(2)  # pages 3, 4: a running request's
    assert pool.register(held[0], H[5], None)
    pool.pin([1])  # a hit on chain A's middle block, still running
    assert pool.drop_cached() == 2  # pages 0 and 2
    assert (pool.num_free, pool.num_cached) == (3, 0) and evicted == []
    assert pool.match_prefix(H[0:3]) == [] and pool.match_prefix([H[1]]) == [1] and pool.match_prefix([H[5]]) == [3]
    assert sorted(pool.allocate(3)) == [0, 2, 5]  # the dropped pages are free, not evicted
    assert evicted == [] and pool.drop_cached() == 0
    pool.check_integrity()


def test_duplicate_block_stays_private_and_is_freed():
    pool = allocator(3, [])
    first, second = pool.allocate(2)
    assert pool.register(first, H[0], None)
    assert not pool.register(second, H[0], None)  # computed twice at once: the first copy wins
    pool.release([first, second])
    assert (pool.num_free, pool.num_cached) == (2, 1) and pool.match_prefix([H[0]]) == [first]
    pool.check_integrity()


def test_a_demotion_that_raises_still_hands_the_page_out_and_keeps_the_accounting_whole(caplog):
    demoted = []

    def demote(block_hash, page, parent):
        if page == 2:
            raise RuntimeError("device->host copy failed")
        demoted.append(page)

    pool = PageAllocator(4, on_evict=demote)
    run_chain(pool, H[0:3])  # pages 0, 1, 2 cached, page 3 free
    assert pool.allocate(3) == [3, 2, 1]  # the free page, then the tail whose demotion fails, then the next
    assert demoted == [1] and pool.failed_demotions == 1
    assert "demoting evicted page 2 failed" in caplog.text
    assert pool.match_prefix(H[0:3]) == [0]
    assert (pool.num_free, pool.num_cached, pool.num_available) == (0, 1, 1)
    pool.check_integrity()


def test_caller_mistakes():
    pool = allocator(2, [])
    with pytest.raises(OutOfPages, match="asked for 3 pages, 2 free or evictable"):
        pool.allocate(3)
    with pytest.raises(AssertionError, match="release of unreferenced page 0"):
        pool.release([0])
    with pytest.raises(AssertionError, match="pin of free page 1"):
        pool.pin([1])
    with pytest.raises(ValueError, match="positive"):
        PageAllocator(0)
