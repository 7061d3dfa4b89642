"""Disk tier ownership: one process owns a tier directory (``DIR/tier.lock``); a second opener, in
another process or this one, is refused and changes nothing; a dead owner blocks nobody; and an
index that fails to open for any reason but corruption is left alone, never rebuilt."""

from __future__ import annotations

import os

import pytest
from rocksdict import Options, Rdict

from kvstore.errors import NotPermitted
from kvstore.tiers.disk_files import DirectoryLock

from tests.kvstore.tiers.disk_helpers import TierOwner, key_of, put, reads_exact


def test_second_process_is_refused_and_the_owners_acknowledged_writes_survive(tmp_path, open_tier):
    path = tmp_path / "disk"
    with TierOwner(path) as owner:
        assert owner.put(0, 1, 2) == [True] * 3
        with pytest.raises(NotPermitted, match=f"{path} is in use: another kvstore process"):
            open_tier(path)
        assert sorted(os.listdir(path)) == ["header.key", "index", "segments", "tier.lock"]  # nothing moved aside
        assert owner.put(3, 4, 5) == [True] * 3  # durable: acknowledged means on disk
        owner.close()
    tier = open_tier(path)
    assert tier.stats().extra["index_rebuilds"] == 0
    assert all(reads_exact(tier, i) for i in range(6)) and tier.stats().blocks == 6
    tier.check_integrity()


def test_second_open_in_the_same_process_is_refused_until_the_first_closes(tmp_path, open_tier):
    first = open_tier()
    assert put(first, 0)
    with pytest.raises(NotPermitted, match="in use"):
        open_tier()
    assert put(first, 1) and reads_exact(first, 0) and reads_exact(first, 1)
    first.close()
    second = open_tier()
    assert second.stats().extra["index_rebuilds"] == 0
    assert reads_exact(second, 0) and reads_exact(second, 1)


def test_a_sigkilled_owner_does_not_block_the_next_open(tmp_path, open_tier):
    path = tmp_path / "disk"
    with TierOwner(path) as owner:
        assert owner.put(0, 1, 2) == [True] * 3
        owner.kill()
    tier = open_tier(path)  # the kernel dropped the dead owner's lock
    assert tier.stats().extra["index_rebuilds"] == 0
    assert all(reads_exact(tier, i) for i in range(3))
    assert put(tier, 3) and reads_exact(tier, 3)


def test_a_tier_cannot_open_under_a_shared_lock(tmp_path, open_tier):
    """fsck's check holds the lock shared: no tier may change the directory under it."""
    open_tier().close()
    check = DirectoryLock(str(tmp_path / "disk"), shared=True)
    with pytest.raises(NotPermitted, match="in use"):
        open_tier()
    check.release()
    assert open_tier().stats().blocks == 0


def test_an_index_locked_by_rocksdb_is_left_alone_and_the_failed_open_lets_go(tmp_path, open_tier):
    """RocksDB's own LOCK error is no corruption: the open fails, the index stays where it is, and
    the directory lock taken before it is released."""
    tier = open_tier()
    assert put(tier, 0) and put(tier, 1)
    tier.close()
    index = Rdict(str(tmp_path / "disk" / "index"), options=Options(raw_mode=True))
    try:
        with pytest.raises(OSError, match="could not be opened .*left as it is"):
            open_tier()
        assert sorted(os.listdir(tmp_path / "disk")) == ["header.key", "index", "segments", "tier.lock"]
        assert index.get(b"b" + key_of(0)) is not None  # the entries are still in the live index
    finally:
        index.close()
    tier = open_tier()
    assert tier.stats().extra["index_rebuilds"] == 0
    assert reads_exact(tier, 0) and reads_exact(tier, 1)
