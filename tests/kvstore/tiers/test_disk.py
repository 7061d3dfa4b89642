"""Disk tier: segment files + RocksDB index. Byte-exact round trips, restart, capacity, hole
punching, durability and concurrency, on real files in ``tmp_path`` and a real RocksDB."""

from __future__ import annotations

import os
import random
import shutil
import sys
import threading
import time

import numpy as np
import pytest

from kvstore.errors import InvalidRequest, StoreClosed
from kvstore.layout import BlockSpec
from kvstore.tiers import disk, disk_reclaim
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.segment import HEADER_BYTES, MAX_LAYERS, footprint

from tests.kvstore.tiers.disk_helpers import (
    LAYERS, NBYTES, FP, key_of, payload_of, meta_of, put, reads_exact, segment_paths,
)


# ---- basic behaviour -------------------------------------------------------------------------

def test_write_read_whole_blocks_and_single_layers(open_tier):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(12):
        assert put(tier, i, parent=key_of(i - 1) if i else None)
    assert tier.stats().extra["segments"] == 3
    layer = NBYTES // LAYERS
    for i in range(12):
        assert tier.contains(key_of(i))
        assert reads_exact(tier, i)
        payload = payload_of(i)
        for first in range(LAYERS):
            one = np.zeros(layer, np.uint8)
            assert tier.read(key_of(i), one, first_layer=first, num_layers=1)
            assert np.array_equal(one, payload[first * layer : (first + 1) * layer])
        mid = np.zeros(2 * layer, np.uint8)
        assert tier.read(key_of(i), mid, first_layer=1, num_layers=2)
        assert np.array_equal(mid, payload[layer : 3 * layer])
        tail = np.zeros(layer, np.uint8)
        assert tier.read(key_of(i), tail, first_layer=LAYERS - 1)
        assert np.array_equal(tail, payload[-layer:])
        meta = tier.meta(key_of(i))
        assert meta == meta_of(payload, LAYERS, key_of(i - 1) if i else None)
    items = dict(tier.items())
    assert set(items) == {key_of(i) for i in range(12)}
    assert all(items[key_of(i)].parent == (key_of(i - 1) if i else None) for i in range(12))
    stats = tier.stats()
    assert stats.blocks == 12 and stats.used_bytes == 12 * FP
    assert stats.bytes_written == 12 * NBYTES
    assert stats.checksum_failures == stats.io_errors == 0
    tier.check_integrity()


def test_miss_on_unknown_key_and_odd_sizes(open_tier):
    tier = open_tier()
    assert not tier.read(key_of(1), np.zeros(NBYTES, np.uint8))
    assert tier.meta(key_of(1)) is None and not tier.remove(key_of(1))
    for i, (nbytes, layers) in enumerate([(1, 1), (4096, 1), (4097, 1), (61 * 7, 61), (MAX_LAYERS * 3, MAX_LAYERS)]):
        assert put(tier, 100 + i, nbytes, layers)
    for i, (nbytes, layers) in enumerate([(1, 1), (4096, 1), (4097, 1), (61 * 7, 61), (MAX_LAYERS * 3, MAX_LAYERS)]):
        assert reads_exact(tier, 100 + i, nbytes)
    with pytest.raises(InvalidRequest):
        put(tier, 200, (MAX_LAYERS + 1) * 2, MAX_LAYERS + 1)
    assert not tier.contains(key_of(200))
    tier.check_integrity()


def test_capacity_below_two_pages_is_rejected(tmp_path):
    with pytest.raises(InvalidRequest):
        DiskTier(str(tmp_path / "d"), HEADER_BYTES)


def test_reopen_keeps_everything(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4 * FP)
    for i in range(20):
        assert put(tier, i, parent=key_of(i - 1) if i else None)
    for i in (3, 4, 5, 6, 11):  # segment 2 dies entirely, segment 3 gets a hole
        assert tier.remove(key_of(i))
    used, segments = tier.used_bytes, tier.stats().extra["segments"]
    metas = {k: tier.meta(k) for k, _ in tier.items()}
    tier.close()

    tier = open_tier(segment_bytes=4 * FP)
    stats = tier.stats()
    assert stats.blocks == 15 and tier.used_bytes == used and stats.extra["segments"] == segments
    assert stats.extra["index_rebuilds"] == stats.extra["recovered_lost_blocks"] == 0
    assert stats.extra["recovered_truncated_bytes"] == 0
    for i in range(20):
        assert reads_exact(tier, i) == (i not in (3, 4, 5, 6, 11))
    assert {k: tier.meta(k) for k, _ in tier.items()} == metas
    tier.check_integrity()
    # writing after a restart never lands on top of an old record
    for i in range(20, 30):
        assert put(tier, i)
    for i in range(30):
        assert reads_exact(tier, i) == (i not in (3, 4, 5, 6, 11))
    tier.check_integrity()
    tier.close()

    tier = open_tier(segment_bytes=4 * FP)
    assert tier.stats().blocks == 25
    for i in range(30):
        assert reads_exact(tier, i) == (i not in (3, 4, 5, 6, 11))
    tier.check_integrity()


def test_a_tier_of_another_format_version_is_refused_and_left_as_it_is(open_tier, tmp_path):
    """Before, the stamp was only checked for presence: another version's tier opened as this one's,
    its records read as garbage (checksum failures) and were punched out."""
    from rocksdict import Options, Rdict

    from kvstore.tiers.disk_files import FORMAT_KEY, FORMAT_VERSION

    tier = open_tier()
    for i in range(5):
        assert put(tier, i)
    tier.close()
    index = Rdict(str(tmp_path / "disk" / "index"), options=Options(raw_mode=True))
    index.put(FORMAT_KEY, b"kvstore-disk-9")
    index.close()
    segments = {p: p.read_bytes() for p in (tmp_path / "disk" / "segments").iterdir()}
    with pytest.raises(InvalidRequest, match=r"holds format 'kvstore-disk-9', and this kvstore reads "
                                             r"'kvstore-disk-2'; left as it is"):
        open_tier()
    assert {p: p.read_bytes() for p in (tmp_path / "disk" / "segments").iterdir()} == segments
    index = Rdict(str(tmp_path / "disk" / "index"), options=Options(raw_mode=True))
    index.put(FORMAT_KEY, FORMAT_VERSION)
    index.close()
    tier = open_tier()  # the directory was let go, and nothing in it was lost
    assert tier.stats().blocks == 5 and all(reads_exact(tier, i) for i in range(5))


def test_an_empty_tier_of_another_format_version_is_taken_over(open_tier, tmp_path):
    """Nothing to lose: an upgrade does not make the operator delete an empty directory by hand.
    Its segments' leftovers (records of a removed block) are garbage to this version and go."""
    from rocksdict import Options, Rdict

    from kvstore.tiers.disk_files import FORMAT_KEY

    tier = open_tier()
    for i in range(3):
        assert put(tier, i)
    for i in range(3):
        assert tier.remove(key_of(i))
    tier.close()
    index = Rdict(str(tmp_path / "disk" / "index"), options=Options(raw_mode=True))
    index.put(FORMAT_KEY, b"kvstore-disk-1")
    index.close()
    tier = open_tier()
    assert tier.stats().blocks == 0 and tier.used_bytes == 0 and tier.stats().extra["index_rebuilds"] == 1
    assert put(tier, 5) and reads_exact(tier, 5)
    tier.close()
    tier = open_tier()  # stamped as this version's now
    assert tier.stats().extra["index_rebuilds"] == 0 and reads_exact(tier, 5)


def test_capacity_enforced_and_space_reclaimed(open_tier, tmp_path):
    tier = open_tier(capacity=10 * FP + FP // 2, segment_bytes=4 * FP)
    for i in range(10):
        assert tier.can_fit(NBYTES)
        assert put(tier, i)
    assert not tier.can_fit(NBYTES)
    assert not put(tier, 10)  # full: refused, nothing evicted
    assert not tier.contains(key_of(10))
    assert tier.stats().blocks == 10 and tier.used_bytes == 10 * FP <= tier.capacity_bytes
    assert all(reads_exact(tier, i) for i in range(10))
    assert tier.stats().io_errors == 0
    tier.flush()
    assert tier.allocated_bytes() == 10 * FP

    # a hole is punched over a removed record of a segment that stays
    assert tier.remove(key_of(1))
    assert tier.allocated_bytes() == 9 * FP
    assert tier.used_bytes == 9 * FP
    assert len(segment_paths(tmp_path / "disk")) == 3
    # a non-active segment whose last record goes is deleted
    for i in (0, 2, 3):
        assert tier.remove(key_of(i))
    assert len(segment_paths(tmp_path / "disk")) == 2
    assert tier.stats().extra["segments"] == 2
    assert tier.allocated_bytes() == 6 * FP and tier.used_bytes == 6 * FP
    tier.check_integrity()
    # the freed room is usable again
    for i in range(10, 14):
        assert put(tier, i)
    assert not put(tier, 14)
    assert all(reads_exact(tier, i) == (i >= 4) for i in range(14))
    tier.check_integrity()


def test_empty_active_segment_is_deleted_when_it_stops_being_active(open_tier, tmp_path):
    tier = open_tier(segment_bytes=4 * FP)
    names = lambda: [os.path.basename(p) for p in segment_paths(tmp_path / "disk")]  # noqa: E731
    for i in range(6):  # segment 1: 0-3, segment 2 (active): 4, 5
        assert put(tier, i)
    assert names() == ["00000001.seg", "00000002.seg"]
    for i in (4, 5):
        assert tier.remove(key_of(i))
    assert names() == ["00000001.seg", "00000002.seg"]  # still the active one: kept, holes punched
    tier.flush()
    assert tier.allocated_bytes() == 4 * FP
    tier.check_integrity()
    for i in (6, 7):  # appended after the holes: segment 2 is now full
        assert put(tier, i)
    for i in (6, 7):
        assert tier.remove(key_of(i))
    assert names() == ["00000001.seg", "00000002.seg"]
    assert put(tier, 8)  # rolls to segment 3; the empty segment 2 goes
    assert names() == ["00000001.seg", "00000003.seg"]
    assert tier.stats().extra["segments"] == 2
    assert all(reads_exact(tier, i) == (i in (0, 1, 2, 3, 8)) for i in range(9))
    tier.check_integrity()
    tier.close()
    tier = open_tier(segment_bytes=4 * FP)
    assert names() == ["00000001.seg", "00000003.seg"]
    assert all(reads_exact(tier, i) == (i in (0, 1, 2, 3, 8)) for i in range(9))
    tier.check_integrity()


def test_storage_overhead_of_a_realistic_block(open_tier):
    spec = BlockSpec(61, 64, ("mla_fp8_ds", "indexer_fp8"))
    assert spec.block_bytes == 3_076_352
    tier = open_tier(capacity=64 << 20, segment_bytes=16 << 20)
    count = 8
    for i in range(count):
        assert put(tier, i, spec.block_bytes, 61)
    tier.flush()
    payload = count * spec.block_bytes
    assert tier.allocated_bytes() / payload <= 1.02
    assert tier.used_bytes / payload <= 1.02
    layer = spec.block_bytes // 61
    one = np.empty(layer, np.uint8)
    assert tier.read(key_of(5), one, first_layer=60, num_layers=1)
    assert np.array_equal(one, payload_of(5, spec.block_bytes)[60 * layer :])
    assert reads_exact(tier, 7, spec.block_bytes)
    tier.close()
    tier = open_tier(capacity=64 << 20, segment_bytes=16 << 20)
    assert tier.allocated_bytes() / payload <= 1.02
    assert all(reads_exact(tier, i, spec.block_bytes) for i in range(count))


def test_durable_mode(open_tier, tmp_path):
    tier = open_tier(durable=True)
    for i in range(5):
        assert put(tier, i)
    assert tier.remove(key_of(2))
    assert all(reads_exact(tier, i) == (i != 2) for i in range(5))
    tier.flush()
    tier.check_integrity()
    tier.close()
    tier = open_tier(durable=True)
    assert all(reads_exact(tier, i) == (i != 2) for i in range(5))
    tier.check_integrity()


def test_flush_syncs_the_segments_directory_once_a_segment_file_was_created(open_tier, tmp_path, monkeypatch):
    """Not durable, a new segment file's directory entry waits for the next flush, which must sync
    it (before, only ``durable=True`` synced it, at creation: a power loss after a flush could lose
    a whole segment of flushed records)."""
    synced = []
    monkeypatch.setattr(disk, "fsync_directory", synced.append)
    tier = open_tier(segment_bytes=2 * FP)
    segments = str(tmp_path / "disk" / "segments")
    assert put(tier, 0) and put(tier, 1)  # segment 1
    assert synced == []
    tier.flush()
    assert synced == [segments]
    tier.flush()  # no segment file created since
    assert synced == [segments]
    assert put(tier, 2)  # segment 2
    tier.flush()
    assert synced == [segments, segments]


def test_operations_after_close_raise(open_tier):
    tier = open_tier()
    assert put(tier, 1)
    tier.close()
    with pytest.raises(StoreClosed):
        put(tier, 2)
    with pytest.raises(StoreClosed):
        tier.read(key_of(1), np.zeros(NBYTES, np.uint8))
    with pytest.raises(StoreClosed):
        tier.remove(key_of(1))
    with pytest.raises(StoreClosed):
        tier.discard(key_of(1))
    tier.close()  # idempotent
    tier.flush()  # no-op once closed


def test_no_hole_punching_file_system(open_tier, tmp_path, monkeypatch):
    """Where punching is unsupported, dead bytes keep counting and the newest record of a key wins."""
    monkeypatch.setattr(disk_reclaim, "punch_hole", lambda fd, offset, length: False)
    tier = open_tier(capacity=6 * FP, segment_bytes=3 * FP)
    for i in range(6):
        assert put(tier, i)
    assert tier.remove(key_of(4))
    assert tier.used_bytes == 6 * FP  # the removed record is dead but not reclaimed
    assert not put(tier, 6)
    for i in (0, 1, 2):  # a whole dead segment is deleted: its bytes come back
        assert tier.remove(key_of(i))
    assert tier.used_bytes == 3 * FP
    payload = payload_of(1004)
    assert tier.write(key_of(4), payload, meta_of(payload))  # key 4 again, newer bytes
    tier.check_integrity()
    tier.close()
    shutil.rmtree(tmp_path / "disk" / "index")
    tier = open_tier(capacity=6 * FP, segment_bytes=3 * FP)
    assert tier.stats().extra["index_rebuilds"] == 1
    dst = np.zeros(NBYTES, np.uint8)
    assert tier.read(key_of(4), dst) and np.array_equal(dst, payload)  # newest sequence wins
    assert reads_exact(tier, 3) and reads_exact(tier, 5)
    tier.check_integrity()


# ---- concurrency ----------------------------------------------------------------------------

def test_concurrent_reads_while_another_thread_writes_and_removes(open_tier):
    tier = open_tier(capacity=64 << 20, segment_bytes=6 * FP)
    stable = list(range(24))
    for i in stable:
        assert put(tier, i)
    errors: list[BaseException] = []
    reads = [0]
    stop = threading.Event()
    layer = NBYTES // LAYERS

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                i = rng.choice(stable)
                if rng.random() < 0.5:
                    assert reads_exact(tier, i)
                else:
                    first = rng.randrange(LAYERS)
                    dst = np.empty(layer, np.uint8)
                    assert tier.read(key_of(i), dst, first_layer=first, num_layers=1)
                    assert np.array_equal(dst, payload_of(i)[first * layer : (first + 1) * layer])
                reads[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def writer() -> None:
        rng = random.Random(7)
        live: list[int] = []
        i = 1000
        try:
            while not stop.is_set():
                if live and (len(live) > 40 or rng.random() < 0.45):
                    assert tier.remove(key_of(live.pop(rng.randrange(len(live)))))
                else:
                    assert put(tier, i)
                    live.append(i)
                    i += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def observer() -> None:
        try:
            while not stop.is_set():
                tier.stats()
                tier.can_fit(NBYTES)
                tier.allocated_bytes()
                list(tier.items())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    threads += [threading.Thread(target=writer), threading.Thread(target=observer)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert reads[0] > 100
    stats = tier.stats()
    assert stats.checksum_failures == 0 and stats.io_errors == 0
    # the writer really churned: many segments were rolled, and emptied ones deleted meanwhile
    newest = max(int(os.path.basename(p)[:-4]) for p in segment_paths(tier.path))
    assert newest >= 10 and stats.extra["segments"] < newest
    assert all(reads_exact(tier, i) for i in stable)
    tier.check_integrity()


def test_stats_while_segments_roll_and_die(open_tier):
    """used_bytes/stats/can_fit walk the segment table while writers add and delete segments."""
    tier = open_tier(capacity=1 << 30, segment_bytes=footprint(100))  # every write rolls a segment
    payload = payload_of(0, 100)
    meta = meta_of(payload, 1)
    errors: list[BaseException] = []
    stop = threading.Event()

    def observer() -> None:
        try:
            while not stop.is_set():
                tier.stats()
                tier.can_fit(100)
                tier.allocated_bytes()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible to expose the race
    thread = threading.Thread(target=observer)
    thread.start()
    try:
        for i in range(2000):
            assert tier.write(key_of(i), payload, meta)
            if i:
                assert tier.remove(key_of(i - 1))  # its segment is no longer active: deleted
    finally:
        stop.set()
        thread.join(30)
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert tier.stats().blocks == 1 and tier.stats().extra["segments"] == 1
    tier.check_integrity()
