"""Disk tier recovery at open: an index a read finds corrupt is rebuilt, never taken for the truth
shortened; bytes no live record covers are freed, or where they cannot be, counted dead with
their record headers zeroed; an open never fails for good over either."""

from __future__ import annotations

import errno
import glob
import os
import shutil

import pytest

from kvstore.tiers import disk, disk_reclaim, disk_recovery
from kvstore.tiers.disk_files import allocated_bytes

from tests.kvstore.tiers.disk_helpers import (
    FP, corrupt_index_block, index_of, key_of, put, reads_exact, tier_with_index_in_one_sst, without_hole_punching,
)


def failing_index(monkeypatch, method: str, message: str) -> None:
    """Indexes the disk tier opens from now on raise rocksdict's plain ``Exception(message)`` from
    ``method``, as RocksDB reports a failing file system; the rest works."""
    real_open_index = disk.open_index

    class Failing:
        def __init__(self, db):
            self._db = db

        def __getattr__(self, name):
            if name == method:
                def fail(*args):
                    raise Exception(message)
                return fail
            return getattr(self._db, name)

    monkeypatch.setattr(disk, "open_index", lambda index_dir: Failing(real_open_index(index_dir)))


# ---- a corrupt index: rebuilt before anything acts on it --------------------------------------

@pytest.mark.parametrize("where", ["entries", "metadata"])
def test_an_index_block_failing_its_checksum_is_rebuilt_and_frees_no_good_record(open_tier, tmp_path, where):
    """Before, a bad block among the entries ended the index's iteration silently: the open took
    the entries before it for the whole index and punched out the records of the rest (189 of 300
    here). A bad block holding the format key failed every open."""
    path = tmp_path / "disk"
    corrupt_index_block(tier_with_index_in_one_sst(path, 300), where)
    allocated = allocated_bytes(str(path / "segments"))
    tier = open_tier(path)
    assert tier.stats().extra["index_rebuilds"] == 1 and tier.stats().blocks == 300
    assert all(reads_exact(tier, i) for i in range(300))
    assert allocated_bytes(str(path / "segments")) == allocated  # nothing punched out
    assert len(glob.glob(f"{path}/index.corrupt-*")) == 1  # set aside, not deleted
    tier.check_integrity()
    tier.close()
    tier = open_tier(path)
    assert tier.stats().extra["index_rebuilds"] == 0 and tier.stats().blocks == 300


def test_an_index_read_failing_for_a_cause_outside_it_fails_the_open_and_leaves_it(open_tier, tmp_path,
                                                                                    monkeypatch):
    """An I/O error is no corruption: the index is kept (not set aside and rebuilt), the open says why."""
    tier = open_tier()
    for i in range(5):
        assert put(tier, i)
    tier.close()
    failing_index(monkeypatch, "get", "IO error: While pread offset 0 len 4096: 000009.sst: Input/output error")
    with pytest.raises(OSError, match="could not be read.*Input/output error") as caught:
        disk.DiskTier(str(tmp_path / "disk"), 64 << 20)
    assert caught.value.errno == errno.EIO
    assert sorted(os.listdir(tmp_path / "disk")) == ["header.key", "index", "segments", "tier.lock"]
    monkeypatch.undo()
    tier = open_tier()
    assert tier.stats().extra["index_rebuilds"] == 0 and all(reads_exact(tier, i) for i in range(5))


def test_an_index_rebuild_its_file_system_cannot_take_fails_the_open_saying_so(open_tier, tmp_path, monkeypatch):
    """Until session 34 a full disk during the rebuild's write was rocksdict's plain Exception: a
    traceback from `kvstore serve` and `kvstore fsck --repair`. The segments stay; a later open
    with room rebuilds again."""
    tier = open_tier()
    for i in range(5):
        assert put(tier, i)
    tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")
    failing_index(monkeypatch, "write", "IO error: No space left on device: While appending to file: 000004.log")
    with pytest.raises(OSError, match="could not be written.*No space left.*Free space on its file system") as caught:
        disk.DiskTier(str(tmp_path / "disk"), 64 << 20)
    assert caught.value.errno == errno.ENOSPC
    monkeypatch.undo()
    tier = open_tier()
    assert tier.stats().extra["index_rebuilds"] == 1 and all(reads_exact(tier, i) for i in range(5))


# ---- bytes no live record covers -------------------------------------------------------------

def removed_before_its_record_was_freed(open_tier, monkeypatch) -> None:
    """Blocks 0-3 stored, block 1 removed with its index delete committed, and the process stopped
    (closed here) before the record was punched out or its header zeroed."""
    tier = open_tier()
    for i in range(4):
        assert put(tier, i)
    with monkeypatch.context() as killed:
        killed.setattr(disk_reclaim.DiskReclaim, "_punch", lambda self, holes: None)
        assert tier.remove(key_of(1))
        tier.close()


def test_a_punch_failing_at_open_counts_the_bytes_dead_and_zeroes_the_header(open_tier, tmp_path, monkeypatch):
    """Before, the punch's OSError (EIO, ENOSPC) escaped the open, at every restart."""
    removed_before_its_record_was_freed(open_tier, monkeypatch)

    def fails(fd, offset, length):
        raise OSError(errno.EIO, "injected: fallocate failed")

    monkeypatch.setattr(disk_recovery, "punch_hole", fails)
    tier = open_tier()
    assert tier.stats().io_errors == 1
    assert tier.used_bytes == 4 * FP  # the record it could not free counts
    assert {index_of(k) for k, _ in tier.items()} == {0, 2, 3}
    assert all(reads_exact(tier, i) for i in (0, 2, 3))
    tier.check_integrity()
    tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")
    tier = open_tier()
    assert tier.stats().extra["index_rebuilds"] == 1
    assert {index_of(k) for k, _ in tier.items()} == {0, 2, 3}  # its header was zeroed: not rebuilt


def test_a_record_removed_before_a_crash_is_not_rebuilt_where_no_hole_can_be_punched(open_tier, tmp_path,
                                                                                      monkeypatch):
    """Before, the open only counted such a record dead: an index rebuild later brought the block
    back (a deleted namespace's block, say)."""
    without_hole_punching(monkeypatch)
    removed_before_its_record_was_freed(open_tier, monkeypatch)
    tier = open_tier()
    assert tier.used_bytes == 4 * FP and tier.stats().io_errors == 0
    tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")
    tier = open_tier()
    assert tier.stats().extra["index_rebuilds"] == 1
    assert {index_of(k) for k, _ in tier.items()} == {0, 2, 3}
    assert all(reads_exact(tier, i) for i in (0, 2, 3))
    tier.check_integrity()
