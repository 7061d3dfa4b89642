"""kvstore fsck: read-only verification of a disk tier, and repair."""

import os
import shutil

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.fsck import format_report, fsck
from kvstore.keys import namespace_hashes
from kvstore.tiers.segment import HEADER_BYTES
from tests.conftest import payloads_for


@pytest.fixture
def disk_dir(make_store, namespace, spec, tmp_path):
    """A disk tier holding 10 blocks, closed."""
    store = make_store(host_bytes=None, disk_dir=tmp_path / "disk")
    ns_id = store.register_namespace(namespace)
    hashes = namespace_hashes(namespace, np.arange(40))
    store.put(ns_id, hashes, payloads_for(spec, hashes))
    store.close()
    return tmp_path / "disk"


def _flip(path, offset):
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ 0x01]), offset)
    finally:
        os.close(fd)


def test_clean_tier_reports_clean_and_changes_nothing(disk_dir):
    before = {p: p.stat().st_mtime_ns for p in (disk_dir / "segments").iterdir()}
    report = fsck(str(disk_dir))
    assert report.clean and report.ok == report.indexed_blocks == 10
    assert (report.bad_entries, report.corrupt_records, report.orphans, report.missing_segments) == (0, 0, 0, 0)
    assert before == {p: p.stat().st_mtime_ns for p in (disk_dir / "segments").iterdir()}
    assert "status: clean" in format_report(report)


def test_flipped_payload_bit_is_found_and_repair_drops_only_that_block(disk_dir):
    segment = disk_dir / "segments" / "00000001.seg"
    _flip(segment, HEADER_BYTES + 5)  # inside the first record's payload
    report = fsck(str(disk_dir))
    assert not report.clean and report.corrupt_records == 1 and report.bad_entries == 1 and report.ok == 9
    assert "--repair" in format_report(report)
    repaired = fsck(str(disk_dir), repair=True)
    assert repaired.clean and repaired.repaired_entries == 1 and repaired.ok == repaired.indexed_blocks == 9


def test_missing_segment_is_reported(disk_dir, tmp_path):
    # a second segment exists only with a small segment size; make one by copying and renaming
    segments = disk_dir / "segments"
    os.unlink(segments / "00000001.seg")
    report = fsck(str(disk_dir))
    assert not report.clean and report.missing_segments == 1 and report.ok == 0


def test_missing_index_is_reported_not_fatal(disk_dir):
    shutil.rmtree(disk_dir / "index")
    report = fsck(str(disk_dir))
    assert report.indexed_blocks == 0 and report.orphans == 10
    assert any("index directory is missing" in p for p in report.problems)


def test_progress_callback_sees_every_byte(disk_dir):
    seen = []
    fsck(str(disk_dir), progress=lambda label, total: (seen.append(total), lambda n: seen.append(-n))[1])
    total, advanced = seen[0], -sum(x for x in seen[1:])
    assert total == os.path.getsize(disk_dir / "segments" / "00000001.seg") and advanced == total


def test_not_a_disk_tier_is_a_clear_error(tmp_path):
    with pytest.raises(InvalidRequest, match="not a kvstore disk tier"):
        fsck(str(tmp_path))
