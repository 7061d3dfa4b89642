"""Disk tier faults on disk: every flipped bit, truncation, missing file or broken index gives a miss
or a clear error, never wrong bytes, never a crash."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import replace

import numpy as np
import pytest

from kvstore.checksum import layer_checksums
from kvstore.tiers import disk_reclaim
from kvstore.tiers.segment import HEADER_BYTES, scan_segment

from tests.kvstore.tiers.disk_helpers import (
    LAYERS, NBYTES, FP, key_of, index_of, payload_of, meta_of, put, reads_exact, locate, flip_byte,
    header_key_of, without_hole_punching,
)


# ---- on-disk faults: never wrong bytes -----------------------------------------------------

@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_bit_flip_in_payload_is_a_counted_miss(open_tier, tmp_path, where):
    tier = open_tier()
    for i in range(5):
        assert put(tier, i)
    seg, offset = locate(tmp_path / "disk", key_of(2))
    position = {"first": 0, "middle": NBYTES // 2 + 17, "last": NBYTES - 1}[where]
    flip_byte(seg, offset + HEADER_BYTES + position, 0x40)

    assert not tier.read(key_of(2), np.zeros(NBYTES, np.uint8))
    assert not tier.contains(key_of(2))
    assert tier.stats().checksum_failures == 1
    assert not tier.read(key_of(2), np.zeros(NBYTES, np.uint8))  # now a plain miss
    assert tier.stats().checksum_failures == 1
    assert all(reads_exact(tier, i) for i in (0, 1, 3, 4))
    tier.check_integrity()
    tier.close()
    tier = open_tier()  # the drop is persistent
    assert not tier.contains(key_of(2)) and tier.stats().blocks == 4
    tier.check_integrity()


def test_bit_flip_only_fails_the_layers_it_touches(open_tier, tmp_path):
    tier = open_tier()
    assert put(tier, 1)
    layer = NBYTES // LAYERS
    seg, offset = locate(tmp_path / "disk", key_of(1))
    flip_byte(seg, offset + HEADER_BYTES + 2 * layer + 5)  # inside layer 2
    payload = payload_of(1)
    dst = np.zeros(2 * layer, np.uint8)
    assert tier.read(key_of(1), dst, first_layer=0, num_layers=2)  # layers 0-1 verify on their own
    assert np.array_equal(dst, payload[: 2 * layer])
    assert not tier.read(key_of(1), np.zeros(layer, np.uint8), first_layer=2, num_layers=1)
    assert tier.stats().checksum_failures == 1 and not tier.contains(key_of(1))
    tier.check_integrity()


@pytest.mark.parametrize("field_offset", [0, 20, 50, 60, 110])  # magic, key, nbytes, seq, checksums
def test_corrupted_record_header_is_a_miss(open_tier, tmp_path, field_offset):
    tier = open_tier()
    for i in range(3):
        assert put(tier, i)
    seg, offset = locate(tmp_path / "disk", key_of(1))
    flip_byte(seg, offset + field_offset)
    assert tier.meta(key_of(1)) is None
    assert not tier.read(key_of(1), np.zeros(NBYTES, np.uint8))
    assert tier.stats().checksum_failures == 1 and not tier.contains(key_of(1))
    assert reads_exact(tier, 0) and reads_exact(tier, 2)
    tier.check_integrity()


def test_corrupted_header_found_after_restart_and_skipped_by_rebuild(open_tier, tmp_path):
    tier = open_tier()
    for i in range(4):
        assert put(tier, i)
    tier.close()
    seg, offset = locate(tmp_path / "disk", key_of(2))
    flip_byte(seg, offset + 30)
    tier = open_tier()
    assert not tier.read(key_of(2), np.zeros(NBYTES, np.uint8))
    assert tier.stats().checksum_failures == 1
    tier.close()

    seg, offset = locate(tmp_path / "disk", key_of(1))
    flip_byte(seg, offset + 30)
    shutil.rmtree(tmp_path / "disk" / "index")
    tier = open_tier()
    assert tier.stats().extra["index_rebuilds"] == 1
    assert {index_of(k) for k, _ in tier.items()} == {0, 3}
    assert reads_exact(tier, 0) and reads_exact(tier, 3)
    tier.check_integrity()


def test_a_record_copied_over_another_is_never_served(open_tier, tmp_path):
    """Valid bytes of the wrong block (a misdirected write) must not pass for the right one."""
    tier = open_tier()
    for i in range(3):
        assert put(tier, i)
    seg_a, off_a = locate(tmp_path / "disk", key_of(0))
    seg_b, off_b = locate(tmp_path / "disk", key_of(1))
    with open(seg_b, "rb") as f:
        record_b = os.pread(f.fileno(), FP, off_b)
    with open(seg_a, "r+b") as f:
        os.pwrite(f.fileno(), record_b, off_a)
    assert tier.meta(key_of(0)) is None  # block 1's header describes no block 0
    assert not tier.read(key_of(0), np.zeros(NBYTES, np.uint8))
    assert tier.stats().checksum_failures == 1
    assert reads_exact(tier, 1) and reads_exact(tier, 2)
    tier.check_integrity()


def test_truncated_segment_while_open_and_after_restart(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(7):  # segment 1: 0-3, segment 2 (active): 4-6
        assert put(tier, i)
    seg2, off6 = locate(tmp_path / "disk", key_of(6))
    os.truncate(seg2, off6 + HEADER_BYTES + 1000)  # cut inside the payload of block 6
    assert not tier.read(key_of(6), np.zeros(NBYTES, np.uint8))
    seg1, off2 = locate(tmp_path / "disk", key_of(2))
    os.truncate(seg1, off2 + 100)  # cut inside the header of block 2: blocks 2 and 3 are gone
    assert not tier.read(key_of(3), np.zeros(NBYTES, np.uint8))
    assert all(reads_exact(tier, i) for i in (0, 1, 4, 5))
    assert tier.stats().checksum_failures == 2
    tier.close()

    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().extra["recovered_lost_blocks"] == 1  # block 2 (3 and 6 were dropped when read)
    assert tier.stats().blocks == 4
    for i in range(7):
        assert reads_exact(tier, i) == (i in (0, 1, 4, 5))
    tier.check_integrity()
    for i in range(10, 16):  # new writes work and land after the damage
        assert put(tier, i)
    assert all(reads_exact(tier, i) for i in (0, 1, 4, 5, *range(10, 16)))
    tier.check_integrity()
    tier.close()
    tier = open_tier(segment_bytes=4 * FP)
    assert all(reads_exact(tier, i) for i in (0, 1, 4, 5, *range(10, 16)))
    tier.check_integrity()


def test_truncated_active_segment_after_restart_keeps_integrity(open_tier, tmp_path):
    tier = open_tier()
    for i in range(4):
        assert put(tier, i)
    tier.close()
    seg, off = locate(tmp_path / "disk", key_of(2))
    os.truncate(seg, off + HEADER_BYTES + 10)  # blocks 2 and 3 lose their bytes while down
    tier = open_tier()
    assert tier.stats().extra["recovered_lost_blocks"] == 2 and tier.stats().blocks == 2
    assert not tier.read(key_of(2), np.zeros(NBYTES, np.uint8))
    assert not tier.read(key_of(3), np.zeros(NBYTES, np.uint8))
    assert reads_exact(tier, 0) and reads_exact(tier, 1)
    tier.check_integrity()
    assert put(tier, 4) and reads_exact(tier, 4)
    tier.check_integrity()


def test_missing_segment_file_is_dropped_on_reopen(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(10):  # segments: 1 = 0-3, 2 = 4-7, 3 = 8-9
        assert put(tier, i)
    tier.close()
    os.unlink(tmp_path / "disk" / "segments" / "00000002.seg")
    tier = open_tier(segment_bytes=4 * FP)
    stats = tier.stats()
    assert stats.extra["recovered_lost_blocks"] == 4
    assert stats.blocks == 6
    for i in range(10):
        assert reads_exact(tier, i) == (i not in (4, 5, 6, 7))
    tier.check_integrity()
    for i in range(10, 16):
        assert put(tier, i)
    assert all(reads_exact(tier, i) for i in (*range(4), 8, 9, *range(10, 16)))
    tier.check_integrity()
    tier.close()
    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().extra["recovered_lost_blocks"] == 0  # dropped for good the first time
    assert tier.stats().blocks == 12
    tier.check_integrity()


def test_missing_active_segment_file_is_dropped_on_reopen(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(6):  # segment 2 (active) holds 4 and 5
        assert put(tier, i)
    tier.close()
    os.unlink(tmp_path / "disk" / "segments" / "00000002.seg")
    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().extra["recovered_lost_blocks"] == 2
    assert all(reads_exact(tier, i) == (i < 4) for i in range(6))
    tier.check_integrity()
    for i in range(6, 12):
        assert put(tier, i)
    assert all(reads_exact(tier, i) == (i < 4 or i >= 6) for i in range(12))
    tier.check_integrity()
    tier.close()
    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().blocks == 10
    assert all(reads_exact(tier, i) == (i < 4 or i >= 6) for i in range(12))
    tier.check_integrity()


def test_missing_segment_file_while_open_is_a_miss(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(10):
        assert put(tier, i)
    os.unlink(tmp_path / "disk" / "segments" / "00000001.seg")
    os.unlink(tmp_path / "disk" / "segments" / "00000003.seg")  # the active one
    for i in range(10):
        assert tier.read(key_of(i), np.zeros(NBYTES, np.uint8)) == (4 <= i < 8)
    assert all(reads_exact(tier, i) for i in range(4, 8))
    assert tier.stats().blocks == 4
    # writes go on, into a file that exists
    for i in range(10, 14):
        assert put(tier, i)
    assert all(reads_exact(tier, i) for i in (*range(4, 8), *range(10, 14)))
    tier.check_integrity()
    tier.close()
    tier = open_tier(segment_bytes=4 * FP)
    assert {index_of(k) for k, _ in tier.items()} == {*range(4, 8), *range(10, 14)}
    assert all(reads_exact(tier, i) for i in (*range(4, 8), *range(10, 14)))
    tier.check_integrity()


def test_deleted_index_is_rebuilt_from_segments(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(14):
        assert put(tier, i, parent=key_of(i - 1) if i else None)
    metas = {k: tier.meta(k) for k, _ in tier.items()}
    used = tier.used_bytes
    tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")
    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().extra["index_rebuilds"] == 1
    assert tier.stats().blocks == 14 and tier.used_bytes == used
    assert {k: tier.meta(k) for k, _ in tier.items()} == metas  # parents and checksums came back
    assert all(reads_exact(tier, i) for i in range(14))
    tier.check_integrity()
    for i in range(14, 18):  # appends continue after the last rebuilt record
        assert put(tier, i)
    assert all(reads_exact(tier, i) for i in range(18))
    tier.close()
    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().extra["index_rebuilds"] == 0  # the rebuilt index was kept
    assert all(reads_exact(tier, i) for i in range(18))
    tier.check_integrity()


@pytest.mark.parametrize("damage", ["all_files", "current", "manifest", "sst", "not_a_directory"])
def test_corrupted_index_is_rebuilt_without_crashing(open_tier, tmp_path, damage):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(9):
        assert put(tier, i)
    tier.close()
    index_dir = tmp_path / "disk" / "index"
    rng = np.random.default_rng(5)
    if damage == "not_a_directory":
        shutil.rmtree(index_dir)
        index_dir.write_bytes(b"garbage")
    else:
        for name in os.listdir(index_dir):
            hit = {"all_files": True, "current": name == "CURRENT", "manifest": name.startswith("MANIFEST"),
                   "sst": name.endswith(".sst")}[damage]
            if hit:
                size = max(os.path.getsize(index_dir / name), 64)
                (index_dir / name).write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().extra["index_rebuilds"] == 1
    assert tier.stats().blocks == 9
    assert all(reads_exact(tier, i) for i in range(9))
    tier.check_integrity()
    assert put(tier, 9) and reads_exact(tier, 9)
    tier.close()
    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().extra["index_rebuilds"] == 0
    assert all(reads_exact(tier, i) for i in range(10))


@pytest.mark.parametrize("punching", [True, False])
def test_removed_and_superseded_records_are_not_resurrected_by_a_rebuild(open_tier, tmp_path, monkeypatch, punching):
    """A removed record is punched out, or, where no hole can be punched, its header is zeroed:
    either way a rebuild of a lost index finds neither a removed block nor an older record."""
    if not punching:
        without_hole_punching(monkeypatch)
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(8):
        assert put(tier, i)
    assert tier.remove(key_of(2))  # removed for good
    assert tier.remove(key_of(5))  # removed, then stored again with other bytes
    newer = payload_of(5005)
    assert tier.write(key_of(5), newer, meta_of(newer))
    assert tier.remove(key_of(7))  # a hole in segment 2, next to live records
    tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")
    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().extra["index_rebuilds"] == 1
    assert {index_of(k) for k, _ in tier.items()} == {0, 1, 3, 4, 5, 6}
    assert not tier.read(key_of(2), np.zeros(NBYTES, np.uint8))
    assert not tier.read(key_of(7), np.zeros(NBYTES, np.uint8))
    dst = np.zeros(NBYTES, np.uint8)
    assert tier.read(key_of(5), dst) and np.array_equal(dst, newer)
    assert all(reads_exact(tier, i) for i in (0, 1, 3, 4, 6))
    tier.check_integrity()
    assert tier.stats().checksum_failures == 0


def test_sequence_numbers_never_go_back_so_a_rebuild_prefers_the_newer_record(open_tier, tmp_path, monkeypatch):
    """The newest record of a key wins a rebuild by its sequence number. A reopen must not hand
    out numbers again that removed records took: where such a record's bytes stay whole (no hole
    punching, and the process killed before its header was zeroed), a key stored again after the
    reopen would otherwise lose to its removed, older record."""
    without_hole_punching(monkeypatch)
    monkeypatch.setattr(disk_reclaim.DiskReclaim, "_invalidate", lambda self, segment, offset: None)  # killed first
    tier = open_tier(segment_bytes=8 * FP)
    for i in range(3):
        assert put(tier, i)
    removed = [tier._index[key_of(i)].seq for i in (1, 2)]
    assert tier.remove(key_of(1)) and tier.remove(key_of(2))  # the newest records: the highest numbers
    tier.close()
    tier = open_tier(segment_bytes=8 * FP)
    newer = payload_of(1001)
    assert tier.write(key_of(1), newer, meta_of(newer))  # key 1 again, other bytes
    assert tier._index[key_of(1)].seq > max(removed)
    tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")
    tier = open_tier(segment_bytes=8 * FP)
    assert tier.stats().extra["index_rebuilds"] == 1
    dst = np.zeros(NBYTES, np.uint8)
    assert tier.read(key_of(1), dst) and np.array_equal(dst, newer)
    assert reads_exact(tier, 0)


def test_index_write_failure_is_an_io_error_not_a_crash(open_tier):
    """RocksDB raising (its WAL hit a full disk, say) must fail the write cleanly; the index is
    then closed and the next write reopens it (a real full disk: test_disk_full.py)."""
    tier = open_tier()
    for i in range(3):
        assert put(tier, i)

    class FailingIndex:
        def __init__(self, db):
            self._db = db

        def write(self, *args, **kwargs):
            raise Exception("IO error: No space left on device")  # what rocksdict raises

        def __getattr__(self, name):
            return getattr(self._db, name)

    tier._db = FailingIndex(tier._db)
    assert not put(tier, 3)
    assert tier.stats().io_errors == 1
    assert not tier.contains(key_of(3))
    tier.check_integrity()  # the record's bytes were cut back off the segment
    assert put(tier, 4)
    assert all(reads_exact(tier, i) == (i != 3) for i in range(5))
    tier.check_integrity()


def test_a_header_read_that_fails_is_no_meta_not_an_error(open_tier, monkeypatch):
    """``meta`` re-reads the record header; its EIO escaped (the store promotes a block it has just
    served with it)."""
    tier = open_tier()
    assert put(tier, 0)

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "injected: Input/output error")

    with monkeypatch.context() as failing:
        failing.setattr(os, "pread", eio)
        failing.setattr(os, "preadv", eio)
        assert tier.meta(key_of(0)) is None
    assert tier.stats().io_errors == 1
    assert tier.meta(key_of(0)) == meta_of(payload_of(0)) and reads_exact(tier, 0)  # its entry stays


@pytest.mark.parametrize("first_layer, num_layers", [(0, None), (2, 1)], ids=["block", "layer_2"])
def test_a_record_header_with_another_layer_count_is_a_miss(open_tier, tmp_path, first_layer, num_layers):
    """A valid header for the key and size but of one layer where the index says four: its checksums
    cannot verify the entry's layers (reading layer 2 raised ZeroDivisionError, slicing none)."""
    tier = open_tier()
    assert put(tier, 0) and put(tier, 1)
    seg, offset = locate(tmp_path / "disk", key_of(1))
    header_key = header_key_of(tmp_path / "disk")
    header = next(r.header for r in scan_segment(seg, header_key, verify=False) if r.offset == offset)
    one_layer = replace(header, num_layers=1, checksums=layer_checksums(payload_of(1), 1))
    with open(seg, "r+b") as f:
        os.pwrite(f.fileno(), one_layer.encode(header_key), offset)
    assert tier.meta(key_of(1)) is None
    count = LAYERS - first_layer if num_layers is None else num_layers
    assert not tier.read(key_of(1), np.zeros(count * NBYTES // LAYERS, np.uint8), first_layer, num_layers)
    assert tier.stats().checksum_failures == 1 and not tier.contains(key_of(1))
    assert reads_exact(tier, 0)
    tier.check_integrity()


@pytest.mark.parametrize("segment_bytes, failure", [(8 * FP, "checksum_failures"), (FP, "io_errors")],
                         ids=["record_punched", "segment_deleted"])
def test_a_failed_read_leaves_the_record_another_write_stored_meanwhile(open_tier, segment_bytes, failure):
    """Block 0 is removed and stored again while a read of its old record is under way: the read
    fails (the old record punched out, or its whole segment deleted) and must drop only that
    record, not the new one (it removed whatever the key's entry was by then)."""
    tier = open_tier(segment_bytes=segment_bytes)
    assert put(tier, 0) and put(tier, 1)
    newer = payload_of(1000)
    run_for = tier._run_for  # called once the read has the key's entry, before any I/O

    def rewritten_meanwhile(key, *args):
        tier._run_for = run_for
        assert tier.remove(key) and tier.write(key, newer, meta_of(newer))
        return run_for(key, *args)

    tier._run_for = rewritten_meanwhile
    assert not tier.read(key_of(0), np.zeros(NBYTES, np.uint8))
    stats = tier.stats()
    assert getattr(stats, failure) == 1 and stats.checksum_failures + stats.io_errors == 1
    dst = np.zeros(NBYTES, np.uint8)
    assert tier.read(key_of(0), dst) and np.array_equal(dst, newer)
    assert reads_exact(tier, 1)
    tier.check_integrity()


@pytest.mark.parametrize("failing", ["fdatasync", "fsync"], ids=["segment", "directory"])
def test_a_failed_fsync_makes_every_later_flush_say_not_durable_until_reopened(open_tier, monkeypatch, failing):
    """A flush whose fsync failed was logged and returned nothing, so a durable put was answered
    durable all the same. And once an fsync failed, the kernel may have dropped the pages it could
    not write: a later fsync that succeeds proves nothing of them. So flush says False from then
    on, until the tier is reopened (which reads back what really is on the disk)."""
    tier = open_tier()
    assert put(tier, 0) and tier.flush()
    assert put(tier, 1)
    if failing == "fsync":
        tier._unsynced_directory = True  # as after creating a segment file

    def eio(fd):
        raise OSError(errno.EIO, "injected: Input/output error")

    with monkeypatch.context() as broken:
        broken.setattr(os, failing, eio)
        assert tier.flush() is False
    assert tier.stats().io_errors == 1
    assert put(tier, 2)
    assert tier.flush() is False, "the fsync works again, but the pages it failed on may be lost"
    assert tier.stats().io_errors == 1 and all(reads_exact(tier, i) for i in range(3))
    tier.close()
    tier = open_tier()
    assert reads_exact(tier, 2) and tier.flush() is True
    tier.check_integrity()
