"""O_DIRECT read-ahead: a multi-block load is served from reads started before it asked, and every
byte is still verified; anything out of step falls back to reading alone."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvstore.checksum import layer_checksums
from kvstore.tiers import direct_io, disk as disk_module
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.read_ahead import ReadAhead, Record, SpanBuffers, ThreadRuns
from kvstore.tiers.segment import footprint

LAYERS = 4
NBYTES = LAYERS * 3001  # unaligned on purpose


def key(i: int) -> bytes:
    return bytes([i + 1]) * 32


@pytest.fixture
def tier(tmp_path):
    tier = DiskTier(str(tmp_path / "disk"), 1 << 26, direct_io=True)
    rng = np.random.default_rng(5)
    tier.payloads = [rng.integers(0, 256, NBYTES, dtype=np.uint8) for _ in range(6)]
    for i, payload in enumerate(tier.payloads):
        assert tier.write(key(i), payload, BlockMeta(NBYTES, LAYERS, layer_checksums(payload, LAYERS)))
    tier.flush()
    if not tier._active.direct:
        pytest.skip("this file system has no O_DIRECT")
    yield tier
    tier.close()


@pytest.fixture
def no_lone_reads(monkeypatch):
    """Reading a record alone fails: whatever succeeds came from the read-ahead."""
    def refuse(*args):
        raise AssertionError("read alone, not from the read-ahead")
    monkeypatch.setattr(disk_module, "read_record_direct", refuse)


def test_a_prefetched_run_is_served_from_the_read_ahead_byte_exact(tier, no_lone_reads):
    tier.prefetch([key(i) for i in range(6)])
    for i, payload in enumerate(tier.payloads):
        dst = np.empty(NBYTES, np.uint8)
        assert tier.read(key(i), dst) and np.array_equal(dst, payload)
    assert tier._runs.current() is None, "an exhausted run is ended"


def test_reads_out_of_order_or_by_layer_end_the_run_and_stay_exact(tier):
    tier.prefetch([key(i) for i in range(6)])
    dst = np.empty(NBYTES, np.uint8)
    assert tier.read(key(3), dst) and np.array_equal(dst, tier.payloads[3])  # not the next: read alone
    assert tier._runs.current() is None
    tier.prefetch([key(i) for i in range(6)])
    layer = np.empty(NBYTES // LAYERS, np.uint8)
    assert tier.read(key(0), layer, first_layer=2, num_layers=1)
    assert np.array_equal(layer, tier.payloads[0][2 * 3001 : 3 * 3001]) and tier._runs.current() is None
    for i in (0, 1):
        assert tier.read(key(i), dst) and np.array_equal(dst, tier.payloads[i])


def _flip_payload_byte(tier, k: bytes) -> None:
    entry = tier._index[k]
    with open(tier._segments[entry.segment].path, "r+b") as f:
        f.seek(entry.offset + 4096 + 5000)
        byte = f.read(1)
        f.seek(entry.offset + 4096 + 5000)
        f.write(bytes([byte[0] ^ 0x10]))


def test_a_corrupt_record_read_ahead_is_a_miss_that_ends_the_run_and_the_rest_still_verify(tier, monkeypatch,
                                                                                           no_lone_reads):
    """A load stops at its first miss, so a failed read ends the thread's run: before, the run
    stayed open, holding its buffers (up to 48 MiB) and its segments' descriptors."""
    _flip_payload_byte(tier, key(2))
    tier.prefetch([key(i) for i in range(6)])
    results = []
    for i in range(6):
        dst = np.zeros(NBYTES, np.uint8)
        ok = tier.read(key(i), dst)
        results.append(ok)
        assert np.array_equal(dst, tier.payloads[i]) if ok else not dst.any(), "no unverified byte reaches dst"
        if i == 2:
            assert tier._runs.current() is None, "the failed read ended the run"
            monkeypatch.undo()  # the rest are read alone
    assert results == [True, True, False, True, True, True]
    assert tier.stats().checksum_failures == 1 and not tier.contains(key(2))


def _open_files() -> list[str]:
    names = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except FileNotFoundError:  # the listing's own descriptor, closed meanwhile
            pass
    return names


def test_a_load_that_stops_early_keeps_no_segment_of_its_run_open(tmp_path):
    """Blocks in segments of their own; the load fails at block 0, block 1 is removed later: no
    descriptor of its deleted segment may stay open, nor a buffer of the run stay taken."""
    tier = DiskTier(str(tmp_path / "disk"), 1 << 26, segment_bytes=footprint(NBYTES), direct_io=True)
    try:
        payloads = [np.random.default_rng(i).integers(0, 256, NBYTES, dtype=np.uint8) for i in range(3)]
        for i, payload in enumerate(payloads):
            assert tier.write(key(i), payload, BlockMeta(NBYTES, LAYERS, layer_checksums(payload, LAYERS)))
        if not tier.direct_io:
            pytest.skip("this file system has no O_DIRECT")
        _flip_payload_byte(tier, key(0))
        spare = tier._runs.buffers.spare()
        tier.prefetch([key(i) for i in range(3)])
        assert not tier.read(key(0), np.empty(NBYTES, np.uint8))  # the load stops here
        assert tier.remove(key(1))
        assert not [name for name in _open_files() if name.endswith(".seg (deleted)")]
        assert tier._runs.current() is None and tier._runs.buffers.spare() >= spare
    finally:
        tier.close()


def test_a_record_rewritten_elsewhere_after_the_prefetch_is_read_where_it_now_is(tier):
    tier.prefetch([key(i) for i in range(6)])
    assert tier.remove(key(1))
    payload = tier.payloads[1]
    assert tier.write(key(1), payload, BlockMeta(NBYTES, LAYERS, layer_checksums(payload, LAYERS)))
    for i in range(6):
        dst = np.empty(NBYTES, np.uint8)
        assert tier.read(key(i), dst) and np.array_equal(dst, tier.payloads[i])
    assert tier.stats().checksum_failures == 0


def test_close_waits_for_reads_in_flight_and_take_refuses_other_records(tmp_path):
    path = str(tmp_path / "f.bin")
    data = np.random.default_rng(0).integers(0, 256, 8 * 4096, dtype=np.uint8)
    data.tofile(path)
    fd = direct_io.open_direct(path)
    if fd is None:
        pytest.skip("this file system has no O_DIRECT")
    try:
        with ThreadPoolExecutor(1) as reader:
            run = ReadAhead(reader, [Record(b"a", 1, fd, 0, 8192), Record(b"b", 1, fd, 8192, 16384),
                                     Record(b"c", 1, fd, 24576, 8192)], depth=2)
            assert run.take(b"b", 1, 8192) is None and run.take(b"a", 1, 4096) is None
            first = run.take(b"a", 1, 0)
            assert np.array_equal(first, data[:8192])
            assert run.take(b"b", 1, 8192) is None, "one span at a time: done() first"
            run.done()
            assert np.array_equal(run.take(b"b", 1, 8192), data[8192:24576])
            run.close()
            assert run.exhausted() and run.take(b"c", 1, 24576) is None
    finally:
        os.close(fd)


def test_a_run_abandoned_by_close_keeps_its_taken_view_and_reads_nothing_more(tmp_path):
    """A load racing the tier's close: before session 35 its next ``done`` submitted a read to the
    stopped reader (RuntimeError out of ``DiskTier.read``). Now the run stops, the view it handed
    out keeps its bytes (the buffer never goes back to the pool for another run to read into)."""
    path = str(tmp_path / "f.bin")
    data = np.random.default_rng(1).integers(0, 256, 4 * 8192, dtype=np.uint8)
    data.tofile(path)
    fd = direct_io.open_direct(path)
    if fd is None:
        pytest.skip("this file system has no O_DIRECT")
    try:
        runs = ThreadRuns()
        runs.buffers = SpanBuffers(span_bytes=8192, keep=8)  # a span per record: more to read after the first
        runs.start([Record(bytes([i]), 1, fd, i * 8192, 8192) for i in range(4)])
        run = runs.current()
        view = run.take(bytes([0]), 1, 0)
        closing = threading.Thread(target=runs.close)
        closing.start()
        closing.join()
        run.done()
        assert run.take(bytes([1]), 1, 8192) is None and run.exhausted()
        assert np.array_equal(view, data[:8192]) and runs.buffers.spare() == 0
        runs.start([Record(bytes([i]), 1, fd, i * 8192, 8192) for i in range(4)])
        assert runs.current() is None  # no run after close
    finally:
        os.close(fd)


def test_closing_the_tier_lets_go_of_an_idle_threads_run(tmp_path):
    """A thread that read one block of a prefetched run and went idle: before session 35 its run
    kept the segments' descriptors open after the tier closed, for as long as the thread lived."""
    tier = DiskTier(str(tmp_path / "disk"), 1 << 26, segment_bytes=footprint(NBYTES), direct_io=True)
    payloads = [np.random.default_rng(i).integers(0, 256, NBYTES, dtype=np.uint8) for i in range(3)]
    for i, payload in enumerate(payloads):
        assert tier.write(key(i), payload, BlockMeta(NBYTES, LAYERS, layer_checksums(payload, LAYERS)))
    if not tier.direct_io:
        tier.close()
        pytest.skip("this file system has no O_DIRECT")
    segments = str(tmp_path / "disk" / "segments")
    read_one, closed = threading.Event(), threading.Event()

    def load():
        tier.prefetch([key(i) for i in range(3)])
        assert tier.read(key(0), np.empty(NBYTES, np.uint8))
        read_one.set()
        closed.wait(10)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        assert read_one.wait(10)
        assert any(name.startswith(segments) for name in _open_files())
        tier.close()
        assert not [name for name in _open_files() if name.startswith(segments)]
    finally:
        closed.set()
        loader.join()


def test_records_back_to_back_in_one_file_are_read_together_up_to_the_span_size():
    from kvstore.tiers.read_ahead import _spans

    records = [Record(b"a", 1, 7, 0, 4096), Record(b"b", 1, 7, 4096, 8192), Record(b"c", 1, 7, 12288, 4096),
               Record(b"d", 1, 7, 20480, 4096),  # a hole before it
               Record(b"e", 2, 8, 24576, 4096)]  # another file
    assert [[r.key for r in s.records] for s in _spans(records, 1 << 20)] == [[b"a", b"b", b"c"], [b"d"], [b"e"]]
    assert [[r.key for r in s.records] for s in _spans(records, 12288)] == [[b"a", b"b"], [b"c"], [b"d"], [b"e"]]
    assert [s.nbytes for s in _spans(records, 4096)] == [4096, 8192, 4096, 4096, 4096]  # one record may exceed it


def test_consecutive_runs_reuse_the_same_buffers(tier):
    """A second load must not page-fault fresh mappings: its buffers are the first run's."""
    keys = [key(i) for i in range(6)]
    addresses = []
    for _ in range(2):
        tier.prefetch(keys)
        run = tier._runs.current()
        addresses.append(sorted(b.ctypes.data for b in run._free + [s.buffer for s in run._inflight]))
        for i, payload in enumerate(tier.payloads):
            dst = np.empty(NBYTES, np.uint8)
            assert tier.read(key(i), dst) and np.array_equal(dst, payload)
        assert tier._runs.current() is None
    assert addresses[0] == addresses[1]
    assert tier._runs.buffers.spare() >= len(addresses[0])


def test_span_buffers_keep_at_most_keep_and_never_an_odd_size():
    pool = SpanBuffers(span_bytes=1 << 16, keep=2)
    taken = [pool.take(4096) for _ in range(3)]
    assert all(b.nbytes == 1 << 16 and b.ctypes.data % direct_io.ALIGN == 0 for b in taken)
    big = pool.take(1 << 17)  # one record larger than a span: a one-off buffer
    assert big.nbytes == 1 << 17
    for b in taken + [big]:
        pool.give(b)
    assert pool.spare() == 2
    assert pool.take(100).ctypes.data in {b.ctypes.data for b in taken}
    pool.clear()
    assert pool.spare() == 0


def test_a_closed_run_gives_its_buffers_back_even_with_reads_in_flight(tmp_path):
    path = str(tmp_path / "f.bin")
    np.zeros(64 * 4096, np.uint8).tofile(path)
    fd = direct_io.open_direct(path)
    if fd is None:
        pytest.skip("this file system has no O_DIRECT")
    pool = SpanBuffers(span_bytes=8192, keep=8)
    try:
        with ThreadPoolExecutor(1) as reader:
            records = [Record(bytes([i]), 1, fd, i * 8192, 8192) for i in range(16)]
            run = ReadAhead(reader, records, depth=3, buffers=pool)
            assert run.take(bytes([0]), 1, 0) is not None
            run.close()  # one span taken, two in flight or done, thirteen never started
    finally:
        os.close(fd)
    assert pool.spare() == 3
