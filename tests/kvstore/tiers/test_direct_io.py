"""O_DIRECT reads and writes through aligned bounce buffers, and the disk tier's buffered fallback."""

import errno
import os
import pathlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvstore.buffers import aligned_empty
from kvstore.tiers import direct_io
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.disk import DiskTier
from kvstore.checksum import layer_checksums
from tests.conftest import payloads_for


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 256, 5 * 4096 + 123, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


@pytest.mark.parametrize("offset, length", [(0, 4096), (100, 5000), (4095, 2), (8192, 12288), (20000, 123)])
def test_unaligned_ranges_come_back_exact(data_file, offset, length):
    path, data = data_file
    fd = direct_io.open_direct(path)
    if fd is None:
        pytest.skip("this file system has no O_DIRECT")
    try:
        got = direct_io.read_direct(fd, offset, length)
        assert np.array_equal(got, data[offset : offset + length])
    finally:
        os.close(fd)


def test_reads_past_the_end_are_short_not_garbage(data_file):
    path, data = data_file
    fd = direct_io.open_direct(path)
    if fd is None:
        pytest.skip("this file system has no O_DIRECT")
    try:
        got = direct_io.read_direct(fd, len(data) - 10, 100)
        assert np.array_equal(got, data[-10:])
        assert direct_io.read_direct(fd, len(data) + 5000, 10).nbytes == 0
    finally:
        os.close(fd)


def test_a_short_read_is_continued_not_taken_for_the_end_of_the_file(data_file, monkeypatch):
    """The kernel may return fewer bytes than asked short of the end (at most 2 GiB - 4 KiB a call,
    for one); a read that took that for the end made a whole record a miss."""
    path, data = data_file
    fd = direct_io.open_direct(path)
    if fd is None:
        pytest.skip("this file system has no O_DIRECT")
    real_preadv = os.preadv

    def two_pages_at_a_time(fd, buffers, offset):
        return real_preadv(fd, [buffers[0][: 2 * 4096]], offset)

    monkeypatch.setattr(direct_io.os, "preadv", two_pages_at_a_time)
    try:
        assert np.array_equal(direct_io.read_direct(fd, 100, 5 * 4096), data[100 : 100 + 5 * 4096])
        assert np.array_equal(direct_io.read_direct(fd, 3 * 4096, 10_000), data[3 * 4096 :])
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
def test_disk_tier_reads_blocks_and_layers_both_ways(tmp_path, direct):
    tier = DiskTier(str(tmp_path / "disk"), 1 << 24, direct_io=direct)
    payload = np.random.default_rng(1).integers(0, 256, 4 * 3000, dtype=np.uint8)  # 4 layers, unaligned sizes
    assert tier.write(b"k" * 32, payload, BlockMeta(payload.nbytes, 4, layer_checksums(payload, 4)))
    segment = next(iter(tier._segments.values()))
    assert segment.direct == (direct and direct_io.open_direct(segment.path) is not None)
    whole = np.empty_like(payload)
    assert tier.read(b"k" * 32, whole) and np.array_equal(whole, payload)
    layer = np.empty(3000, np.uint8)
    assert tier.read(b"k" * 32, layer, first_layer=2, num_layers=1) and np.array_equal(layer, payload[6000:9000])
    tier.close()


@pytest.mark.parametrize("direct", [True, False])
def test_disk_tier_writes_both_ways_and_every_record_survives_a_reopen(tmp_path, direct):
    path = str(tmp_path / "disk")
    tier = DiskTier(path, 1 << 24, segment_bytes=40_000, direct_io=direct)  # rolls every few records
    rng = np.random.default_rng(3)
    payloads = [rng.integers(0, 256, 4 * 3001, dtype=np.uint8) for _ in range(7)]  # unaligned sizes
    for i, payload in enumerate(payloads):
        assert tier.write(bytes([i]) * 32, payload, BlockMeta(payload.nbytes, 4, layer_checksums(payload, 4)))
    supported = direct_io.open_direct(tier._active.path, writable=True) is not None
    assert all(s.direct == (direct and supported) for s in tier._segments.values())
    tier.close()
    tier = DiskTier(path, 1 << 24, segment_bytes=40_000, direct_io=direct)
    extra = rng.integers(0, 256, 4 * 3001, dtype=np.uint8)  # appended after a reopen, to the same tail
    assert tier.write(b"x" * 32, extra, BlockMeta(extra.nbytes, 4, layer_checksums(extra, 4)))
    for key, payload in [(bytes([i]) * 32, p) for i, p in enumerate(payloads)] + [(b"x" * 32, extra)]:
        got = np.empty_like(payload)
        assert tier.read(key, got) and np.array_equal(got, payload)
    tier.close()


def test_a_direct_record_is_header_payload_and_zeros_in_one_aligned_write(tmp_path):
    path = str(tmp_path / "f.seg")
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    fd = direct_io.open_direct(path, writable=True)
    if fd is None:
        pytest.skip("this file system has no O_DIRECT")
    payload = np.arange(5000, dtype=np.uint32).view(np.uint8)[:9999]
    try:
        direct_io.write_record_direct(fd, 8192, b"H" * 100, payload, 3 * 4096 + 4096)
    finally:
        os.close(fd)
    raw = np.fromfile(path, np.uint8)
    assert raw.nbytes == 8192 + 4 * 4096 and not raw[:8192].any()
    assert raw[8192 : 8292].tobytes() == b"H" * 100 and np.array_equal(raw[8292 : 8292 + 9999], payload)
    assert not raw[8292 + 9999 :].any()


@pytest.mark.parametrize("start, end", [(0, 50), (50, 130), (100, 4096), (0, 8192), (4000, 9000), (4096, 8192)])
def test_assembling_a_record_in_pieces_gives_the_same_bytes(start, end):
    payload = np.random.default_rng(3).integers(0, 256, 5000, dtype=np.uint8)
    whole, pieces = np.full(8192, 7, np.uint8), np.full(8192, 7, np.uint8)
    direct_io.assemble_record(whole, b"H" * 100, payload)
    direct_io.assemble_record(pieces, b"H" * 100, payload, 0, start)
    direct_io.assemble_record(pieces, b"H" * 100, payload, start, end)
    direct_io.assemble_record(pieces, b"H" * 100, payload, end)
    assert np.array_equal(pieces, whole)
    assert whole[:100].tobytes() == b"H" * 100 and np.array_equal(whole[100:5100], payload) and not whole[5100:].any()


def _direct_segment(tmp_path, writable=True):
    path = str(tmp_path / "f.seg")
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o644))
    fd = direct_io.open_direct(path, writable=writable)
    if fd is None:
        pytest.skip("this file system has no O_DIRECT")
    return path, fd


def _unaligned(data: np.ndarray) -> np.ndarray:
    """``data`` copied to an address 16 bytes past a page boundary (the bounce-buffer path)."""
    out = aligned_empty(data.nbytes + 16)[16:]
    out[:] = data
    return out


@pytest.mark.parametrize("nbytes", [3 * 4096 + 256, 3 * 4096, 100])
def test_page_aligned_payloads_are_written_in_place(tmp_path, monkeypatch, nbytes):
    path, fd = _direct_segment(tmp_path)
    payload = aligned_empty(nbytes)
    payload[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    monkeypatch.setattr(direct_io, "assemble_record", lambda *a, **k: pytest.fail("payload went through the bounce buffer"))
    size = 4096 + -(-nbytes // 4096) * 4096
    try:
        direct_io.write_record_direct(fd, 4096, b"R" * 4096, payload, size)
    finally:
        os.close(fd)
    raw = np.fromfile(path, np.uint8)
    assert raw.nbytes == 4096 + size and not raw[:4096].any()
    assert raw[4096:8192].tobytes() == b"R" * 4096
    assert np.array_equal(raw[8192 : 8192 + nbytes], payload) and not raw[8192 + nbytes :].any()


def test_a_failed_in_place_write_raises_and_leaves_the_file_empty(tmp_path):
    path, fd = _direct_segment(tmp_path, writable=False)  # read-only: every write fails
    payload = aligned_empty(3 * 4096 + 256)
    try:
        with pytest.raises(OSError):
            direct_io.write_record_direct(fd, 0, b"R" * 4096, payload, 5 * 4096)
    finally:
        os.close(fd)
    assert os.path.getsize(path) == 0


def test_only_page_aligned_contiguous_payloads_behind_whole_header_pages_go_in_place():
    aligned = aligned_empty(3 * 4096)
    assert direct_io.writes_in_place(b"R" * 4096, aligned)
    assert not direct_io.writes_in_place(b"R" * 100, aligned)  # the payload would start mid-page in the file
    assert not direct_io.writes_in_place(b"R" * 4096, aligned[16:])
    assert not direct_io.writes_in_place(b"R" * 4096, aligned.reshape(3, 4096)[:, :2048])


def test_a_large_record_written_in_two_overlapped_writes_lands_whole(tmp_path):
    path, fd = _direct_segment(tmp_path)
    payload = _unaligned(np.random.default_rng(4).integers(0, 256, direct_io.FIRST_WRITE + 777_777, dtype=np.uint8))
    size = (4096 + payload.nbytes + 4095) // 4096 * 4096
    with ThreadPoolExecutor(1) as writer:
        try:
            direct_io.write_record_direct(fd, 4096, b"R" * 4096, payload, size, writer)
        finally:
            os.close(fd)
    raw = np.fromfile(path, np.uint8)
    assert raw.nbytes == 4096 + size and not raw[:4096].any()
    assert raw[4096:8192].tobytes() == b"R" * 4096
    assert np.array_equal(raw[8192 : 8192 + payload.nbytes], payload) and not raw[8192 + payload.nbytes :].any()


def test_a_failed_overlapped_write_raises_and_leaves_no_write_running(tmp_path):
    path, fd = _direct_segment(tmp_path, writable=False)  # read-only: every write fails
    payload = _unaligned(np.ones(direct_io.FIRST_WRITE * 2, np.uint8))
    with ThreadPoolExecutor(1) as writer:
        try:
            with pytest.raises(OSError):
                direct_io.write_record_direct(fd, 0, b"R" * 4096, payload, payload.nbytes + 4096, writer)
            assert writer.submit(lambda: "idle").result(timeout=5) == "idle"
        finally:
            os.close(fd)
    assert os.path.getsize(path) == 0


@pytest.mark.parametrize("how", ["bounce", "in_place", "overlapped"])
def test_a_write_that_fills_the_disk_part_way_raises_no_space_not_a_device_error(small_tmpfs, how):
    """A full disk takes part of a write; before, the short count was reported as EIO ("short
    write"), so a full disk looked like a failing device. Now the rest is written again and that
    write raises the real error."""
    directory = pathlib.Path(small_tmpfs(2 << 20))  # room for two of the record's 3 MiB
    path, fd = _direct_segment(directory)
    nbytes = 3 << 20
    payload = aligned_empty(nbytes) if how == "in_place" else _unaligned(np.ones(nbytes, np.uint8))
    with ThreadPoolExecutor(1) as writer:
        try:
            with pytest.raises(OSError) as caught:
                direct_io.write_record_direct(fd, 0, b"R" * 4096, payload, 4096 + nbytes,
                                              writer if how == "overlapped" else None)
        finally:
            os.close(fd)
    assert caught.value.errno == errno.ENOSPC, caught.value


def _write_one(tmp_path):
    tier = DiskTier(str(tmp_path / "disk"), 1 << 24, direct_io=True)
    payload = np.random.default_rng(2).integers(0, 256, 4 * 3000, dtype=np.uint8)
    assert tier.write(b"k" * 32, payload, BlockMeta(payload.nbytes, 4, layer_checksums(payload, 4)))
    tier.flush()
    entry = tier._index[b"k" * 32]
    return tier, payload, tier._segments[entry.segment].path, entry.offset


def test_direct_reads_turn_a_flipped_bit_into_a_miss(tmp_path):
    tier, payload, path, offset = _write_one(tmp_path)
    with open(path, "r+b") as f:
        f.seek(offset + 4096 + 7000)
        byte = f.read(1)
        f.seek(offset + 4096 + 7000)
        f.write(bytes([byte[0] ^ 1]))
    dst = np.zeros_like(payload)
    assert not tier.read(b"k" * 32, dst) and tier.stats().checksum_failures == 1
    assert not dst.any(), "unverified bytes never reach the caller"
    tier.close()


def test_direct_reads_of_a_truncated_segment_are_a_miss(tmp_path):
    tier, payload, path, offset = _write_one(tmp_path)
    os.truncate(path, offset + 4096 + 5000)
    assert not tier.read(b"k" * 32, np.zeros_like(payload))
    assert not tier.contains(b"k" * 32)
    tier.close()


def test_write_through_from_host_slots_reaches_disk_with_no_bounce_copy(make_store, namespace, spec, chain,
                                                                         tmp_path, monkeypatch):
    store = make_store()
    if store.tiers[1].direct_io is False:
        pytest.skip("this file system has no O_DIRECT")
    in_place = []
    write = direct_io.write_record_in_place
    monkeypatch.setattr(direct_io, "write_record_in_place", lambda *a: (in_place.append(a[1]), write(*a)))
    monkeypatch.setattr(direct_io, "assemble_record", lambda *a, **k: pytest.fail("a host slot went through the bounce buffer"))
    ns_id = store.register_namespace(namespace)
    payloads = payloads_for(spec, chain)
    assert store.put(ns_id, chain, payloads).stored == len(chain)
    store.flush()  # write-through runs on the store's writer thread
    store.close()
    assert len(in_place) == len(chain)
    disk_only = make_store(host_bytes=None)
    ns_id = disk_only.register_namespace(namespace)
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in chain]
    assert disk_only.load(ns_id, chain, dsts).loaded_blocks == len(chain)
    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
