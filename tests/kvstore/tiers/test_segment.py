"""Segment record format: header round trip, corruption detection, scanning with holes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore.checksum import layer_checksums
from kvstore.tiers.header_key import TAG_BYTES, HeaderKey
from kvstore.tiers.segment import (
    HEADER_BYTES,
    MAGIC,
    MAX_LAYERS,
    PAGE,
    RecordHeader,
    footprint,
    punch_hole,
    scan_segment,
)

KEY = HeaderKey(bytes(range(32)))  # the tier's secret in these tests


def _key(i: int) -> bytes:
    return bytes([i % 256]) * 16 + i.to_bytes(16, "little")


def _header(i: int, payload: np.ndarray, num_layers: int, seq: int = 0, parent: bytes | None = None) -> RecordHeader:
    return RecordHeader(_key(i), payload.nbytes, num_layers, seq, parent, layer_checksums(payload, num_layers))


def _payload(seed: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def _append_record(f, header: RecordHeader, payload: np.ndarray) -> int:
    """Append a record the way the disk tier lays it out; returns its offset."""
    offset = f.seek(0, os.SEEK_END)
    assert offset % PAGE == 0
    f.write(header.encode(KEY))
    f.write(payload.tobytes())
    f.write(bytes(footprint(payload.nbytes) - HEADER_BYTES - payload.nbytes))
    f.flush()
    return offset


def test_footprint_is_header_page_plus_page_rounded_payload():
    assert footprint(0) == HEADER_BYTES
    assert footprint(1) == HEADER_BYTES + PAGE
    assert footprint(PAGE) == HEADER_BYTES + PAGE
    assert footprint(PAGE + 1) == HEADER_BYTES + 2 * PAGE
    # the realistic V3.2 block (61 layers x 64 tokens x 788 B): a header page plus < 1 page of padding
    assert footprint(3_076_352) == 753 * PAGE
    assert footprint(3_076_352) / 3_076_352 < 1.003


@pytest.mark.parametrize("num_layers", [1, 2, 61, MAX_LAYERS])
@pytest.mark.parametrize("with_parent", [False, True])
def test_header_round_trip(num_layers, with_parent):
    payload = _payload(num_layers, num_layers * 40)
    parent = bytes(range(32)) if with_parent else None
    header = _header(7, payload, num_layers, seq=123456789012, parent=parent)
    page = header.encode(KEY)
    assert len(page) == HEADER_BYTES
    assert page[:8] == MAGIC
    decoded = RecordHeader.decode(page, KEY)
    assert decoded == header
    assert decoded.parent == parent
    assert decoded.checksums == layer_checksums(payload, num_layers)
    # numpy pages decode the same way (the disk tier reads headers into numpy buffers)
    assert RecordHeader.decode(np.frombuffer(page, np.uint8), KEY) == header


def test_all_zero_parent_is_not_confused_with_no_parent():
    payload = _payload(1, 64)
    header = _header(1, payload, 2, parent=bytes(32))
    assert RecordHeader.decode(header.encode(KEY), KEY).parent == bytes(32)
    assert RecordHeader.decode(_header(1, payload, 2).encode(KEY), KEY).parent is None


def test_encode_rejects_impossible_layer_counts():
    payload = _payload(0, 8)
    with pytest.raises(AssertionError):
        RecordHeader(_key(0), 8, 0, 0, None, ()).encode(KEY)
    with pytest.raises(AssertionError):
        RecordHeader(_key(0), 8, MAX_LAYERS + 1, 0, None, (0,) * (MAX_LAYERS + 1)).encode(KEY)
    assert RecordHeader(_key(0), 8, 1, 0, None, layer_checksums(payload, 1)).encode(KEY)


@pytest.mark.parametrize("num_layers", [1, 61])
def test_any_flipped_byte_in_the_header_decodes_to_none(num_layers):
    payload = _payload(3, num_layers * 16)
    page = bytearray(_header(3, payload, num_layers, seq=5, parent=_key(2)).encode(KEY))
    covered = 104 + 8 * num_layers + TAG_BYTES  # fixed fields + layer checksums + header tag
    for position in range(covered):
        for bit in (0x01, 0x80):
            corrupt = bytearray(page)
            corrupt[position] ^= bit
            assert RecordHeader.decode(bytes(corrupt), KEY) is None, f"flip at byte {position} went unnoticed"


def test_zero_page_and_garbage_decode_to_none():
    assert RecordHeader.decode(bytes(HEADER_BYTES), KEY) is None
    garbage = bytearray(np.random.default_rng(9).integers(0, 256, HEADER_BYTES, dtype=np.uint8).tobytes())
    assert RecordHeader.decode(bytes(garbage), KEY) is None
    garbage[:8] = MAGIC  # right magic, wrong everything else
    assert RecordHeader.decode(bytes(garbage), KEY) is None


def test_a_header_tagged_with_another_key_decodes_to_none():
    """Everything but the secret right: the tag is the only thing standing between a page a client
    wrote and a header, and another key's tag does not pass (nor does the tier's own tag on a
    header whose bytes were changed after tagging)."""
    payload = _payload(4, 64)
    header = _header(4, payload, 2, seq=9)
    assert RecordHeader.decode(header.encode(KEY), KEY) == header
    assert RecordHeader.decode(header.encode(HeaderKey(bytes(32))), KEY) is None
    assert RecordHeader.decode(header.encode(HeaderKey(bytes(range(1, 33)))), KEY) is None


def _forged_block(victim: bytes, forger: HeaderKey, pages: int = 4) -> np.ndarray:
    """A client's block whose second page is a header for ``victim``'s key, tagged with ``forger``,
    claiming the next two pages (a real payload) as its own, at a sequence number beyond any."""
    inner = _payload(77, 2 * PAGE)
    forged = RecordHeader(victim, inner.nbytes, 1, 2**62, None, layer_checksums(inner, 1)).encode(forger)
    block = np.zeros(pages * PAGE, np.uint8)
    block[PAGE : 2 * PAGE] = np.frombuffer(forged, np.uint8)
    block[2 * PAGE : 4 * PAGE] = inner
    return block


@pytest.mark.parametrize("forger, found", [(HeaderKey(bytes(32)), False), (KEY, True)], ids=["guessed", "stolen"])
def test_a_header_planted_in_a_payload_is_found_only_with_the_tiers_key(tmp_path, forger, found):
    """A removed record's header page is zeroed (no hole punched), so a scan steps page by page into
    its payload, a client's bytes. A header planted there for another key must not pass: before
    format 2 the header checksum was an unkeyed xxh3 anyone could compute, and a rebuilt index
    served the planted block under the victim's key. With the tier's key (one who can read the
    tier's directory) the same page does pass: the scan reaches it."""
    path = str(tmp_path / "00000003.seg")
    block = _forged_block(_key(99), forger)
    honest = _payload(5, 3000)
    with open(path, "wb") as f:
        planted_at = _append_record(f, _header(1, block, 1), block)
        tail_at = _append_record(f, _header(5, honest, 1, seq=1), honest)
        f.seek(planted_at)
        f.write(bytes(HEADER_BYTES))  # removed: header zeroed, payload left
    records = list(scan_segment(path, KEY))
    assert [r.header.key for r in records if r.offset == tail_at] == [_key(5)]
    planted = [r for r in records if r.header.key == _key(99)]
    assert bool(planted) == found
    if found:
        assert planted[0].offset == planted_at + 2 * PAGE and planted[0].valid


def test_scan_finds_records_skips_holes_and_flags_bad_payloads(tmp_path):
    path = str(tmp_path / "00000001.seg")
    sizes = [10_000, 4096, 1, 30_000, 8192]
    payloads = [_payload(i, n) for i, n in enumerate(sizes)]
    headers = [_header(i, p, 1 if p.nbytes % 2 else 2, seq=i) for i, p in enumerate(payloads)]
    with open(path, "wb") as f:
        offsets = [_append_record(f, h, p) for h, p in zip(headers, payloads)]
    assert os.path.getsize(path) == sum(footprint(n) for n in sizes)

    records = list(scan_segment(path, KEY))
    assert [r.offset for r in records] == offsets
    assert [r.header for r in records] == headers
    assert all(r.valid for r in records)

    # punch out record 1: its pages read back as zeros and the scan skips them
    with open(path, "r+b") as f:
        assert punch_hole(f.fileno(), offsets[1], footprint(sizes[1]))
        assert os.pread(f.fileno(), footprint(sizes[1]), offsets[1]) == bytes(footprint(sizes[1]))
        # corrupt one payload byte of record 3
        os.pwrite(f.fileno(), bytes([payloads[3][777] ^ 0x10]), offsets[3] + HEADER_BYTES + 777)
    assert os.path.getsize(path) == sum(footprint(n) for n in sizes)  # hole keeps the size

    advanced = []
    records = list(scan_segment(path, KEY, progress=advanced.append))
    assert [r.offset for r in records] == [offsets[i] for i in (0, 2, 3, 4)]
    assert [r.valid for r in records] == [True, True, False, True]
    assert records[2].header == headers[3]  # the header is intact, only the payload is bad
    assert sum(advanced) == os.path.getsize(path)

    # without verification a corrupt payload cannot be seen, but a missing one still can
    unverified = list(scan_segment(path, KEY, verify=False))
    assert [r.valid for r in unverified] == [True, True, True, True]


def test_scan_reports_truncated_record_invalid_and_skips_garbage(tmp_path):
    path = str(tmp_path / "00000002.seg")
    payloads = [_payload(10 + i, 20_000) for i in range(3)]
    headers = [_header(10 + i, p, 4, seq=i) for i, p in enumerate(payloads)]
    with open(path, "wb") as f:
        offsets = [_append_record(f, headers[0], payloads[0])]
        f.write(np.random.default_rng(1).integers(0, 256, 3 * PAGE, dtype=np.uint8).tobytes())  # garbage pages
        offsets.append(_append_record(f, headers[1], payloads[1]))
        offsets.append(_append_record(f, headers[2], payloads[2]))
    cut = offsets[2] + HEADER_BYTES + 5_000  # the last record loses most of its payload
    os.truncate(path, cut)

    for verify in (True, False):
        records = list(scan_segment(path, KEY, verify=verify))
        assert [r.offset for r in records] == offsets
        assert [r.valid for r in records] == [True, True, False]


def test_scan_of_an_empty_or_tiny_file_finds_nothing(tmp_path):
    empty = tmp_path / "empty.seg"
    empty.write_bytes(b"")
    assert list(scan_segment(str(empty), KEY)) == []
    tiny = tmp_path / "tiny.seg"
    tiny.write_bytes(MAGIC + bytes(100))  # less than a header page
    assert list(scan_segment(str(tiny), KEY)) == []


def test_punch_hole_frees_blocks(tmp_path):
    path = tmp_path / "punch.seg"
    path.write_bytes(np.ones(64 * PAGE, np.uint8).tobytes())
    with open(path, "r+b") as f:
        os.fsync(f.fileno())
        before = os.fstat(f.fileno()).st_blocks
        assert punch_hole(f.fileno(), 8 * PAGE, 32 * PAGE)
        after = os.fstat(f.fileno()).st_blocks
        assert os.fstat(f.fileno()).st_size == 64 * PAGE
        assert (before - after) * 512 == 32 * PAGE
        assert os.pread(f.fileno(), PAGE, 7 * PAGE) == bytes([1]) * PAGE
        assert os.pread(f.fileno(), 32 * PAGE, 8 * PAGE) == bytes(32 * PAGE)
        assert os.pread(f.fileno(), PAGE, 40 * PAGE) == bytes([1]) * PAGE
