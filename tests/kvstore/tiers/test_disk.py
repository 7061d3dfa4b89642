"""Disk tier: segment files + RocksDB index. Byte-exact round trips, restart, capacity and hole
punching, and faults: every fault gives a miss or a clear error, never wrong bytes, never a crash.

Everything runs on real files in ``tmp_path``, a real RocksDB, and real child processes for the
crash tests (SIGKILL, RLIMIT_FSIZE)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvstore.checksum import layer_checksums
from kvstore.errors import InvalidRequest, StoreClosed
from kvstore.layout import BlockSpec
from kvstore.tiers import disk as disk_module
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.segment import HEADER_BYTES, MAX_LAYERS, footprint, scan_segment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

LAYERS = 4
NBYTES = 24_000  # 4 layers of 6,000 bytes; a record is 7 pages
FP = footprint(NBYTES)


# ---- helpers (the child processes define the same functions, see _PRELUDE) -----------------

def key_of(i: int) -> bytes:
    """32-byte key whose first 8 bytes give back ``i`` (so a reopened index can be checked)."""
    return i.to_bytes(8, "little") + hashlib.blake2b(i.to_bytes(8, "little"), digest_size=24).digest()


def index_of(key: bytes) -> int:
    return int.from_bytes(key[:8], "little")


def payload_of(i: int, nbytes: int = NBYTES) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)


def meta_of(payload: np.ndarray, num_layers: int = LAYERS, parent: bytes | None = None) -> BlockMeta:
    return BlockMeta(payload.nbytes, num_layers, layer_checksums(payload, num_layers), parent)


def put(tier: DiskTier, i: int, nbytes: int = NBYTES, num_layers: int = LAYERS, parent: bytes | None = None) -> bool:
    payload = payload_of(i, nbytes)
    return tier.write(key_of(i), payload, meta_of(payload, num_layers, parent))


def reads_exact(tier: DiskTier, i: int, nbytes: int = NBYTES) -> bool:
    dst = np.zeros(nbytes, np.uint8)
    if not tier.read(key_of(i), dst):
        return False
    assert np.array_equal(dst, payload_of(i, nbytes)), f"block {i} read back WRONG bytes"
    return True


def segment_paths(path) -> list[str]:
    return sorted(glob.glob(os.path.join(str(path), "segments", "*.seg")))


def locate(path, key: bytes) -> tuple[str, int]:
    """(segment file, record offset) of ``key``, found by scanning the segments."""
    for seg in segment_paths(path):
        for record in scan_segment(seg, verify=False):
            if record.header.key == key:
                return seg, record.offset
    raise AssertionError("record not found in any segment")


def flip_byte(file: str, offset: int, mask: int = 0x01) -> None:
    with open(file, "r+b") as f:
        byte = os.pread(f.fileno(), 1, offset)
        os.pwrite(f.fileno(), bytes([byte[0] ^ mask]), offset)


@pytest.fixture
def open_tier(tmp_path):
    """Factory for disk tiers; every tier still open at the end is closed."""
    made: list[DiskTier] = []

    def make(path=None, capacity: int = 64 << 20, segment_bytes: int = 8 * FP, **kw) -> DiskTier:
        tier = DiskTier(str(path or tmp_path / "disk"), capacity, segment_bytes=segment_bytes, **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


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
    tier.close()  # idempotent
    tier.flush()  # no-op once closed


def test_no_hole_punching_file_system(open_tier, tmp_path, monkeypatch):
    """Where punching is unsupported, dead bytes keep counting and the newest record of a key wins."""
    monkeypatch.setattr(disk_module, "punch_hole", lambda fd, offset, length: False)
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


def test_removed_and_superseded_records_are_not_resurrected_by_a_rebuild(open_tier, tmp_path):
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


def test_index_write_failure_is_an_io_error_not_a_crash(open_tier):
    """RocksDB raising (its WAL hit a full disk, say) must fail the write cleanly."""
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

    real = tier._db
    tier._db = FailingIndex(real)
    assert not put(tier, 3)
    assert tier.stats().io_errors == 1
    assert not tier.contains(key_of(3))
    tier.check_integrity()  # the record's bytes were cut back off the segment
    tier._db = real
    assert put(tier, 4)
    assert all(reads_exact(tier, i) == (i != 3) for i in range(5))
    tier.check_integrity()


# ---- real processes: full disk, SIGKILL ------------------------------------------------------

_PRELUDE = textwrap.dedent(
    """
    import hashlib, json, os, random, resource, signal, sys, time
    sys.path.insert(0, os.environ["KVSTORE_REPO"])
    import numpy as np
    from kvstore.checksum import layer_checksums
    from kvstore.tiers.base import BlockMeta
    from kvstore.tiers.disk import DiskTier

    def key_of(i):
        return i.to_bytes(8, "little") + hashlib.blake2b(i.to_bytes(8, "little"), digest_size=24).digest()

    def payload_of(i, nbytes):
        return np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)

    def put(tier, i, nbytes, layers=4):
        p = payload_of(i, nbytes)
        return tier.write(key_of(i), p, BlockMeta(p.nbytes, layers, layer_checksums(p, layers), None))
    """
)


def run_child(body: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(body), *args],
        capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_REPO": REPO},
    )


def test_full_disk_efbig_fails_writes_cleanly(tmp_path, open_tier):
    body = """
    path, nbytes, fp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so pwrite fails with EFBIG instead of killing us
    tier = DiskTier(path, 64 << 20, segment_bytes=64 << 20)
    for i in range(3):
        assert put(tier, i, nbytes)
    limit = 5 * fp + fp // 2  # room for two more records, then the third is cut part way
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    results = [put(tier, i, nbytes) for i in range(3, 8)]
    seg = os.path.join(path, "segments", "00000001.seg")
    report = {"results": results, "io_errors": tier.stats().io_errors, "size": os.path.getsize(seg),
              "blocks": tier.stats().blocks, "used": tier.used_bytes}
    tier.check_integrity()
    dst = np.empty(nbytes, np.uint8)
    report["reads"] = [bool(tier.read(key_of(i), dst)) and bool(np.array_equal(dst, payload_of(i, nbytes)))
                       for i in range(8)]
    tier.remove(key_of(0))
    report["after_remove"] = put(tier, 8, nbytes)  # still too big for the file-size limit
    tier.check_integrity()
    report["integrity"] = True
    tier.close()
    print(json.dumps(report))
    """
    path = str(tmp_path / "disk")
    result = run_child(body, path, str(NBYTES), str(FP))
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["results"] == [True, True, False, False, False]
    assert report["io_errors"] == 3
    assert report["size"] == 5 * FP  # the partial record was cut back off
    assert report["blocks"] == 5 and report["used"] == 5 * FP
    assert report["reads"] == [True] * 5 + [False] * 3
    assert report["after_remove"] is False and report["integrity"] is True
    # without the limit, the directory reopens cleanly and takes writes again
    tier = open_tier(path)
    assert {index_of(k) for k, _ in tier.items()} == {1, 2, 3, 4}
    assert all(reads_exact(tier, i) for i in (1, 2, 3, 4))
    tier.check_integrity()
    assert put(tier, 5) and reads_exact(tier, 5)
    tier.check_integrity()


_KILL_AT_INDEX_COMMIT = """
path, nbytes = sys.argv[1], int(sys.argv[2])
tier = DiskTier(path, 64 << 20, segment_bytes=64 << 20)
for i in range(5):
    assert put(tier, i, nbytes)

class KillAtCommit:
    # the record's bytes are in the segment when the index batch is written: die right there
    def __init__(self, db):
        self._db = db
    def write(self, *args, **kwargs):
        seg = os.path.join(path, "segments", "00000001.seg")
        print(json.dumps({"size_at_commit": os.path.getsize(seg)}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    def __getattr__(self, name):
        return getattr(self._db, name)

tier._db = KillAtCommit(tier._db)
put(tier, 5, nbytes)
print("survived", flush=True)
"""

_KILL_MID_RECORD = """
path, nbytes = sys.argv[1], int(sys.argv[2])
tier = DiskTier(path, 64 << 20, segment_bytes=64 << 20)
for i in range(5):
    assert put(tier, i, nbytes)
real_pwritev = os.pwritev

def torn_pwritev(fd, buffers, offset):
    # write the header and part of the payload, then die (a torn record)
    first = bytes(buffers[0]) + bytes(buffers[1])[:5000]
    os.pwrite(fd, first, offset)
    print(json.dumps({"size_at_commit": os.fstat(fd).st_size}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

os.pwritev = torn_pwritev
put(tier, 5, nbytes)
print("survived", flush=True)
"""


@pytest.mark.parametrize("script", [_KILL_AT_INDEX_COMMIT, _KILL_MID_RECORD], ids=["at_index_commit", "mid_record"])
def test_sigkill_before_the_index_commit(tmp_path, open_tier, script):
    path = str(tmp_path / "disk")
    result = run_child(script, path, str(NBYTES))
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert "survived" not in result.stdout
    size_at_kill = json.loads(result.stdout.splitlines()[0])["size_at_commit"]
    assert size_at_kill > 5 * FP  # the uncommitted record's bytes really were on disk

    tier = open_tier(path, segment_bytes=64 << 20)
    stats = tier.stats()
    assert stats.extra["recovered_truncated_bytes"] == size_at_kill - 5 * FP > 0
    assert {index_of(k) for k, _ in tier.items()} == {0, 1, 2, 3, 4}
    assert all(reads_exact(tier, i) for i in range(5))
    assert not tier.contains(key_of(5))
    assert os.path.getsize(os.path.join(path, "segments", "00000001.seg")) == 5 * FP
    tier.check_integrity()
    for i in range(5, 9):
        assert put(tier, i)
    assert all(reads_exact(tier, i) for i in range(9))
    tier.check_integrity()
    tier.close()
    tier = open_tier(path, segment_bytes=64 << 20)
    assert tier.stats().extra["recovered_truncated_bytes"] == 0
    assert all(reads_exact(tier, i) for i in range(9))
    tier.check_integrity()


@pytest.mark.parametrize("script", [_KILL_AT_INDEX_COMMIT, _KILL_MID_RECORD], ids=["at_index_commit", "mid_record"])
def test_sigkill_then_lost_index_rebuilds_from_what_is_complete(tmp_path, open_tier, script):
    """A crash, then the index is lost too: the rebuild keeps complete records only."""
    path = str(tmp_path / "disk")
    result = run_child(script, path, str(NBYTES))
    assert result.returncode == -signal.SIGKILL, result.stderr
    size_at_kill = json.loads(result.stdout.splitlines()[0])["size_at_commit"]
    shutil.rmtree(os.path.join(path, "index"))
    tier = open_tier(path, segment_bytes=64 << 20)
    stats = tier.stats()
    assert stats.extra["index_rebuilds"] == 1
    if script is _KILL_AT_INDEX_COMMIT:
        # the record was whole and verifies: keeping it is correct (it is block 5's own bytes)
        assert {index_of(k) for k, _ in tier.items()} == set(range(6))
        assert stats.extra["recovered_truncated_bytes"] == 0
    else:
        assert {index_of(k) for k, _ in tier.items()} == set(range(5))
        assert stats.extra["recovered_truncated_bytes"] == size_at_kill - 5 * FP > 0
    assert all(reads_exact(tier, index_of(k)) for k, _ in tier.items())
    tier.check_integrity()
    assert put(tier, 100) and reads_exact(tier, 100)
    tier.check_integrity()


_STREAM = """
path, start = sys.argv[1], int(sys.argv[2])
sizes = [12288, 10000, 24000, 60000]
durable = sys.argv[3] == "1"
tier = DiskTier(path, 2 << 20, segment_bytes=256 << 10, durable=durable)
rng = random.Random(start)
live = [int.from_bytes(k[:8], "little") for k, _ in tier.items()]
print("ready", flush=True)
i = start
while True:
    nbytes = sizes[i % 4]
    while not put(tier, i, nbytes):
        victim = live.pop(rng.randrange(len(live)))
        assert tier.remove(key_of(victim))
    live.append(i)
    if rng.random() < 0.2 and live:
        tier.remove(key_of(live.pop(rng.randrange(len(live)))))
    i += 1
"""


def _check_stream_survivor(path: str) -> int:
    sizes = [12288, 10000, 24000, 60000]
    tier = DiskTier(path, 2 << 20, segment_bytes=256 << 10)
    try:
        keys = [k for k, _ in tier.items()]
        for key in keys:
            i = index_of(key)
            assert key == key_of(i), "the index holds a key nobody wrote"
            assert reads_exact(tier, i, sizes[i % 4]), f"committed block {i} did not read back"
        stats = tier.stats()
        assert stats.checksum_failures == 0 and stats.io_errors == 0
        assert tier.used_bytes <= tier.capacity_bytes
        tier.check_integrity()
        return len(keys)
    finally:
        tier.close()


@pytest.mark.parametrize("durable", [False, True])
def test_sigkill_at_random_times_during_a_stream_of_writes(tmp_path, durable):
    path = str(tmp_path / "disk")
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    survivors = []
    for round_ in range(3):
        child = subprocess.Popen(
            [sys.executable, "-c", _PRELUDE + textwrap.dedent(_STREAM), path, str(round_ * 1_000_000), "1" if durable else "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_REPO": REPO},
        )
        try:
            assert child.stdout.readline().strip() == "ready", child.stderr.read()
            time.sleep(rng.uniform(0.05, 0.5))
            assert child.poll() is None, f"stream child died on its own (seed {seed}): {child.stderr.read()}"
            child.send_signal(signal.SIGKILL)
            child.wait(30)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
            child.stderr.close()
        assert child.returncode == -signal.SIGKILL
        survivors.append(_check_stream_survivor(path))
    assert all(n > 0 for n in survivors), f"seed {seed}: {survivors}"
