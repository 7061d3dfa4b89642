"""Disk tier on a real file system that fills up (a small tmpfs): a write the disk cannot take is a
counted, rejected write, whether the segment, the index's write-ahead log or the inodes (a new
segment file) ran out; the tier takes writes again once space is freed, closes cleanly
meanwhile, and a healthy index is never mistaken for a corrupt one."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess

import numpy as np
import pytest

from kvstore.keys import namespace_hashes
from kvstore.tiers.disk import DiskTier

from tests.conftest import payloads_for
from tests.kvstore.tiers.disk_helpers import FP, index_of, key_of, put, reads_exact


class Filler:
    """A file that takes all but a chosen number of bytes of its file system."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, "filler")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)

    def leave(self, free: int) -> None:
        """Grow or shrink this file so that ``free`` bytes of the file system stay free."""
        os.ftruncate(self.fd, 0)
        room = shutil.disk_usage(os.path.dirname(self.path)).free - free
        if room > 0:
            os.posix_fallocate(self.fd, 0, room)

    def close(self) -> None:
        """Give all its space back."""
        if self.fd is not None:
            os.close(self.fd)
            os.unlink(self.path)
            self.fd = None


@pytest.fixture
def full_disk(small_tmpfs):
    """An 8 MiB tmpfs and a ``Filler`` on it (closed after the test)."""
    mount = small_tmpfs(8 << 20)
    filler = Filler(mount)
    yield mount, filler
    filler.close()


def _until_the_index_fails(write, filler: Filler, room: int, caplog) -> list[int]:
    """Call ``write(i)`` for i = 0, 1, ... each time with ``room`` bytes free (one record's), until
    one fails; assert it was the index's write-ahead log that ran out. Returns the i stored."""
    stored = []
    with caplog.at_level(logging.ERROR, logger="kvstore.tiers.disk"):
        for i in range(400):
            filler.leave(room)
            if not write(i):
                break
            stored.append(i)
    failures = [r.getMessage() for r in caplog.records if "write failed" in r.getMessage()]
    assert failures and all("/index/" in f and "No space left" in f for f in failures), failures
    return stored


def test_an_index_write_that_hits_a_full_disk_fails_alone_and_the_tier_recovers_when_space_is_freed(
        full_disk, open_tier, caplog):
    """RocksDB keeps a failed write-ahead-log append as a background error that fails every later
    write, delete and flush: before, one ENOSPC rejected every later disk write until restart, a
    remove's index delete was lost (the block came back after restart as a checksum failure), and
    close raised before it let the directory go."""
    mount, filler = full_disk
    path = os.path.join(mount, "disk")
    tier = open_tier(path, segment_bytes=64 << 20)
    stored = _until_the_index_fails(lambda i: put(tier, i), filler, FP, caplog)
    assert len(stored) >= 3 and tier.stats().io_errors == 1
    assert tier.remove(key_of(stored[0]))  # while the disk is still full
    filler.close()
    assert put(tier, 1000) and reads_exact(tier, 1000)
    assert tier.remove(key_of(stored[1]))
    tier.check_integrity()
    tier.close()
    tier = open_tier(path, segment_bytes=64 << 20)  # this process: the directory was let go
    kept = set(stored[2:]) | {1000}
    assert {index_of(k) for k, _ in tier.items()} == kept
    assert all(reads_exact(tier, i) for i in kept)
    assert tier.stats().checksum_failures == 0
    tier.check_integrity()


def test_a_store_whose_disk_index_hit_a_full_disk_closes_and_lets_the_directory_go(
        full_disk, make_store, namespace, spec, caplog):
    """``TieredStore.close`` flushes and closes each tier; it closes and unlocks the disk tier
    even while the disk is still full."""
    mount, filler = full_disk
    path = os.path.join(mount, "disk")
    store = make_store(host_bytes=None, disk_bytes=64 << 20, disk_dir=path, segment_bytes=64 << 20)
    ns_id = store.register_namespace(namespace)
    hashes = namespace_hashes(namespace, np.arange(400 * namespace.block_size))
    payloads = payloads_for(spec, hashes)

    def write(i: int) -> bool:
        return store.put(ns_id, hashes[i : i + 1], payloads[i : i + 1], parent=hashes[i - 1] if i else None).stored == 1

    stored = _until_the_index_fails(write, filler, store.tiers[0].footprint(spec.block_bytes), caplog)
    store.close()  # the disk is still full
    filler.close()
    tier = DiskTier(path, 64 << 20)
    try:
        assert tier.stats().blocks == len(stored) and tier.stats().extra["index_rebuilds"] == 0
    finally:
        tier.close()


def test_opening_a_healthy_tier_on_a_full_disk_fails_clearly_and_leaves_the_index_alone(full_disk, open_tier):
    """Before, RocksDB's ENOSPC at open was taken for corruption: the index was moved to
    index.corrupt-TIME (never cleaned up), the open failed with a private _CorruptIndex, and the
    next open rebuilt everything from the segments."""
    mount, filler = full_disk
    path = os.path.join(mount, "disk")
    tier = open_tier(path, segment_bytes=1 << 20)
    for i in range(10):
        assert put(tier, i)
    tier.close()
    filler.leave(0)
    for _ in range(2):  # the failed open let the directory go: the second is refused for the same reason
        with pytest.raises(OSError, match=f"{path}.*No space left on device") as caught:
            DiskTier(path, 64 << 20)
        assert caught.value.errno == errno.ENOSPC
        assert sorted(os.listdir(path)) == ["header.key", "index", "segments", "tier.lock"]
    filler.close()
    tier = open_tier(path, segment_bytes=1 << 20)
    assert tier.stats().extra["index_rebuilds"] == 0 and tier.stats().blocks == 10
    assert all(reads_exact(tier, i) for i in range(10))



def test_running_out_of_inodes_rejects_writes_as_io_errors_until_segments_die(small_tmpfs, open_tier):
    """A new segment file needs an inode: before, the ENOSPC of creating it escaped ``write``."""
    mount = small_tmpfs(64 << 20)
    subprocess.run(["mount", "-o", "remount,nr_inodes=40", mount], check=True)
    tier = open_tier(os.path.join(mount, "disk"), segment_bytes=2 * FP)
    results = [put(tier, i) for i in range(120)]
    stored = results.index(False)
    assert 0 < stored and results == [True] * stored + [False] * (120 - stored)
    assert tier.stats().io_errors == 120 - stored and tier.stats().blocks == stored
    tier.check_integrity()
    assert all(reads_exact(tier, i) for i in range(stored))
    for i in range(4):  # two sealed segments die and give their inodes back
        assert tier.remove(key_of(i))
    assert put(tier, 1000) and reads_exact(tier, 1000)
    tier.check_integrity()


def test_a_write_refused_for_space_that_evictions_freed_in_the_books_only_frees_it_for_the_retry(full_disk,
                                                                                                 open_tier):
    """The store evicts by ``discard``: the bytes stay on the file system until a reclaim. A write
    that then finds the file system full gives them back before it reports failure, so the
    store's next try succeeds instead of failing the same way until a flush."""
    mount, filler = full_disk
    tier = open_tier(os.path.join(mount, "disk"), capacity=6 * FP, segment_bytes=8 * FP)
    for i in range(6):
        assert put(tier, i)
    tier.flush()
    filler.leave(FP // 2)  # the tier is full, and so is its file system
    assert tier.discard(key_of(0)) and tier.can_fit(FP // 2)
    assert not put(tier, 6), "there was no room on the file system for it"
    assert put(tier, 6), "the failed write gave back the evicted record's bytes"
    assert all(reads_exact(tier, i) for i in range(1, 7))
    tier.check_integrity()


def test_a_capacity_above_what_the_file_system_can_give_is_warned_of_at_open(small_tmpfs, caplog):
    """Such a tier fills its file system, and then its index cannot open again (RocksDB writes at
    every open) until space is freed there: the open says so, naming both sizes. A tier that fits,
    counting what it already holds as its own, opens without the warning."""
    mount = small_tmpfs(8 << 20)
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk_files"):
        DiskTier(os.path.join(mount, "big"), 64 << 20, segment_bytes=4 * FP).close()
    assert "its capacity, 64.0 MiB, is more than its file system can give it" in caplog.text
    assert "with what the tier holds now" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvstore.tiers.disk_files"):
        tier = DiskTier(os.path.join(mount, "fits"), 6 << 20, segment_bytes=4 * FP)
        for i in range(200):
            assert put(tier, i)
        used = tier.used_bytes
        tier.close()
        assert used > shutil.disk_usage(mount).free  # more than the free space left beside it
        DiskTier(os.path.join(mount, "fits"), 6 << 20, segment_bytes=4 * FP).close()
    assert "more than its file system can give it" not in caplog.text
