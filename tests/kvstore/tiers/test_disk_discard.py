"""Disk tier ``discard``: the books drop a block at once, without I/O and without waiting for a
write in progress; the index delete, the hole and a dead segment's deletion come with the next
write, ``reclaim`` or flush. Real files, a real RocksDB, a real process killed with SIGKILL."""

from __future__ import annotations

import threading


from kvstore.keys import namespace_hashes
from kvstore.tiers import disk_reclaim
from tests.kvstore.store_helpers import DISK_BLOCK, put_chain, tokens
from tests.kvstore.tiers.disk_helpers import FP, NBYTES, TierOwner, key_of, put, reads_exact, segment_paths


def test_a_discard_frees_the_books_at_once_and_the_file_at_the_next_write(open_tier):
    tier = open_tier(capacity=10 * FP, segment_bytes=4 * FP)
    for i in range(10):
        assert put(tier, i)
    tier.flush()
    assert tier.discard(key_of(5))
    assert not tier.contains(key_of(5)) and not reads_exact(tier, 5)
    assert tier.used_bytes == 9 * FP and tier.can_fit(NBYTES)
    assert tier.allocated_bytes() == 10 * FP  # its bytes are still there
    assert not tier.discard(key_of(5))  # once
    assert put(tier, 10)  # the write that takes the room punches the hole (after its own record)
    tier.flush()
    assert tier.allocated_bytes() == 10 * FP and tier.used_bytes == 10 * FP
    assert all(reads_exact(tier, i) == (i != 5) for i in range(11))
    tier.check_integrity()


def test_reclaim_deletes_a_segment_its_discards_emptied_and_the_index_forgets_them(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(6):  # segment 1: 0-3, segment 2 (active): 4, 5
        assert put(tier, i)
    for i in range(4):
        assert tier.discard(key_of(i))
    assert len(segment_paths(tmp_path / "disk")) == 2 and tier.stats().extra["segments"] == 2
    tier.reclaim()
    assert len(segment_paths(tmp_path / "disk")) == 1 and tier.stats().extra["segments"] == 1
    tier.check_integrity()
    tier.close()
    tier = open_tier(segment_bytes=4 * FP)
    assert [tier.contains(key_of(i)) for i in range(6)] == [False] * 4 + [True] * 2
    assert reads_exact(tier, 4) and reads_exact(tier, 5)


def test_a_discard_does_not_wait_for_a_write_in_progress(open_tier, monkeypatch):
    tier = open_tier()
    assert put(tier, 0)
    writing, finish = threading.Event(), threading.Event()
    slow_write = tier._write_record

    def stuck_write(*args):  # a disk that takes its time with this record
        writing.set()
        assert finish.wait(30)
        slow_write(*args)

    monkeypatch.setattr(tier, "_write_record", stuck_write)
    writer = threading.Thread(target=put, args=(tier, 1))
    writer.start()
    try:
        assert writing.wait(10)
        discarded = []
        discarder = threading.Thread(target=lambda: discarded.append(tier.discard(key_of(0))))
        discarder.start()
        discarder.join(5)
        assert discarded == [True], "discard waited for the write in progress"
        assert not tier.contains(key_of(0)) and not finish.is_set()
    finally:
        finish.set()
        writer.join(30)
    assert reads_exact(tier, 1) and not reads_exact(tier, 0)
    tier.flush()
    assert tier.allocated_bytes() == FP
    tier.check_integrity()


def test_where_holes_cannot_be_punched_a_discard_counts_its_bytes_until_the_segment_goes(open_tier, tmp_path,
                                                                                         monkeypatch):
    monkeypatch.setattr(disk_reclaim, "punch_hole", lambda fd, offset, length: False)
    tier = open_tier(capacity=8 * FP, segment_bytes=4 * FP)  # the probe at open finds no hole punching
    for i in range(6):  # segment 1: 0-3, segment 2 (active): 4, 5
        assert put(tier, i)
    for i in (4, 5, 0, 1, 2):
        assert tier.discard(key_of(i))
        assert tier.used_bytes == 6 * FP  # dead, not free: their segments still hold them
    assert tier.discard(key_of(3))  # segment 1 has nothing live left: none of it counts from now on
    assert tier.used_bytes == 2 * FP and len(segment_paths(tmp_path / "disk")) == 2
    tier.reclaim()  # and its file goes
    assert len(segment_paths(tmp_path / "disk")) == 1 and tier.used_bytes == 2 * FP
    tier.check_integrity()


def test_where_holes_cannot_be_punched_a_full_store_evicts_only_what_it_needs(make_store, namespace, spec,
                                                                              monkeypatch):
    monkeypatch.setattr(disk_reclaim, "punch_hole", lambda fd, offset, length: False)
    store = make_store(host_bytes=None, disk_bytes=8 * DISK_BLOCK, segment_bytes=4 * DISK_BLOCK)
    ns_id = store.register_namespace(namespace)
    prompts = [namespace_hashes(namespace, tokens(1000 * i, 1)) for i in range(10)]
    for prompt in prompts[:8]:
        assert put_chain(store, ns_id, spec, prompt)[1].stored == 1
    assert put_chain(store, ns_id, spec, prompts[8])[1].stored == 1
    assert store.stats().tiers[0].evictions == 4  # the oldest segment's four blocks, then it fits
    assert [store.lookup(ns_id, p).hit_blocks for p in prompts[:9]] == [0] * 4 + [1] * 5
    assert put_chain(store, ns_id, spec, prompts[9])[1].stored == 1
    assert store.stats().tiers[0].evictions == 4
    store.flush()
    store.check_integrity()


def test_killed_before_the_next_write_a_discarded_block_comes_back_intact(tmp_path, open_tier):
    path = tmp_path / "disk"
    with TierOwner(path) as owner:
        assert owner.put(0, 1, 2) == [True] * 3
        assert owner.discard(1, 7) == [True, False]
        owner.kill()
    tier = open_tier(path)
    assert all(reads_exact(tier, i) for i in range(3))  # the right bytes, back from eviction
    tier.check_integrity()


def test_killed_after_the_next_write_a_discarded_block_stays_gone(tmp_path, open_tier):
    path = tmp_path / "disk"
    with TierOwner(path) as owner:
        assert owner.put(0, 1, 2) == [True] * 3
        assert owner.discard(1) == [True]
        assert owner.put(3) == [True]  # commits the index delete with its own entry
        owner.kill()
    tier = open_tier(path)
    assert [reads_exact(tier, i) for i in range(4)] == [True, False, True, True]
    assert tier.allocated_bytes() == 3 * FP  # the hole was punched before the kill
    tier.check_integrity()
