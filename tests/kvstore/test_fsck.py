"""kvstore fsck: read-only verification of a disk tier, and repair."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvstore.cli import main
from kvstore.errors import InvalidRequest, NotPermitted
from kvstore.fsck import format_report, fsck
from kvstore.keys import namespace_hashes
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.segment import HEADER_BYTES, scan_segment
from tests.conftest import payloads_for
from tests.kvstore.tiers.disk_helpers import (
    TierOwner, corrupt_index_block, header_key_of, reads_exact, tier_with_index_in_one_sst,
)
from tests.kvstore.tiers.tmpfs import mounted_tmpfs


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def _files(directory) -> dict:
    """Every file below ``directory``: its size, modification time and bytes."""
    return {p: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in directory.rglob("*") if p.is_file()}


def test_clean_tier_reports_clean_and_changes_nothing(disk_dir):
    """Nothing under the tier changes, the index's files included (rocksdict rewrote its
    rocksdict-config.json at every open, read-only ones too, until session 28)."""
    os.unlink(disk_dir / "tier.lock")  # as a tier from before the lock left it: the check creates none
    before = _files(disk_dir)
    assert any(p.parent.name == "index" for p in before)
    report = fsck(str(disk_dir))
    assert report.clean and report.ok == report.indexed_blocks == 10
    assert (report.bad_entries, report.corrupt_records, report.orphans, report.missing_segments) == (0, 0, 0, 0)
    assert _files(disk_dir) == before
    assert sorted(os.listdir(disk_dir)) == ["header.key", "index", "segments"]
    assert "status: clean" in format_report(report)


def test_a_tier_on_a_read_only_file_system_checks_clean(disk_dir, tmp_path, capsys):
    """Before, the check's open of the index failed there (rocksdict writes its config file even
    when it opens read-only): "index is unreadable ... run with --repair", every block an orphan."""
    with mounted_tmpfs(str(tmp_path / "ro"), 8 << 20) as mount:
        tier_dir = shutil.copytree(disk_dir, os.path.join(mount, "disk"))
        subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
        assert main(["fsck", tier_dir]) == 0
        out, err = capsys.readouterr()
        assert "status: clean" in out and "unreadable" not in out + err
        report = fsck(tier_dir)
        assert report.clean and report.ok == report.indexed_blocks == 10 and report.orphans == 0


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


def test_a_missing_header_key_is_a_problem_and_repair_starts_the_tier_empty(disk_dir, capsys):
    """Without DIR/header.key no record header authenticates: every block is lost, and saying
    "clean" (or counting orphans) would hide it."""
    os.unlink(disk_dir / "header.key")
    report = fsck(str(disk_dir))
    assert not report.clean and report.header_key_problem == "missing"
    assert report.indexed_blocks == 10 and report.ok == 0
    assert any("header.key is missing" in p and "none of their blocks can be served" in p for p in report.problems)
    assert main(["fsck", str(disk_dir)]) == 1
    assert "PROBLEMS FOUND" in capsys.readouterr().out
    repaired = fsck(str(disk_dir), repair=True)
    assert repaired.clean and repaired.indexed_blocks == repaired.segments == 0
    assert repaired.repaired_entries == 10, "the blocks it lost are counted"
    assert (disk_dir / "header.key").exists()


def test_with_the_key_and_the_segments_gone_the_missing_segments_are_still_reported(disk_dir):
    os.unlink(disk_dir / "header.key")
    shutil.rmtree(disk_dir / "segments")
    os.mkdir(disk_dir / "segments")
    report = fsck(str(disk_dir))
    assert not report.clean and report.missing_segments == 1 and report.header_key_problem == ""


def test_a_damaged_or_foreign_key_is_a_finding_not_a_crash(disk_dir, tmp_path):
    from kvstore.tiers.disk_files import open_header_key

    (disk_dir / "header.key").write_bytes(b"short")
    report = fsck(str(disk_dir))
    assert not report.clean and report.header_key_problem == "unreadable" and report.bad_entries == 0
    assert any("header.key cannot be used" in p and "holds 5 bytes" in p for p in report.problems)
    open_header_key(str(tmp_path))  # another tier's key, copied in
    shutil.copyfile(tmp_path / "header.key", disk_dir / "header.key")
    report = fsck(str(disk_dir))
    assert not report.clean and report.header_key_problem == "another" and report.ok == 0
    assert fsck(str(disk_dir), repair=True).repaired_entries == 10


def test_an_index_of_another_format_is_named_not_taken_for_a_key_problem(disk_dir):
    from rocksdict import Options, Rdict

    from kvstore.tiers.disk_files import FORMAT_KEY

    index = Rdict(str(disk_dir / "index"), options=Options(raw_mode=True))
    index.put(FORMAT_KEY, b"kvstore-disk-1")
    index.close()
    report = fsck(str(disk_dir))
    assert not report.clean and report.other_format == "kvstore-disk-1" and report.header_key_problem == ""
    assert any("format 'kvstore-disk-1'" in p and "reads 'kvstore-disk-2'" in p for p in report.problems)


def test_progress_callback_sees_every_byte(disk_dir):
    seen = []
    fsck(str(disk_dir), progress=lambda label, total: (seen.append(total), lambda n: seen.append(-n))[1])
    total, advanced = seen[0], -sum(x for x in seen[1:])
    assert total == os.path.getsize(disk_dir / "segments" / "00000001.seg") and advanced == total


def test_not_a_disk_tier_is_a_clear_error(tmp_path, disk_dir):
    """A data directory (as `kvstore run --data-dir` and `serve --data-dir` take) points at its tier;
    a missing path says so (both said only "not a kvstore disk tier directory")."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidRequest, match=r"not a kvstore disk tier directory \(no segments/ inside\)"):
        fsck(str(empty))
    with pytest.raises(InvalidRequest, match=f"but holds one: did you mean {disk_dir}\\?"):
        fsck(str(disk_dir.parent))
    with pytest.raises(InvalidRequest, match="missing does not exist; give a disk tier's directory"):
        fsck(str(tmp_path / "missing"))
    (tmp_path / "file").write_text("x")  # it was said to be unreadable by this user
    with pytest.raises(InvalidRequest, match="file is a file, not a directory; give a disk tier's directory"):
        fsck(str(tmp_path / "file"))


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="drops root's file-access capabilities")
def test_a_tier_the_user_may_not_read_is_named_as_such(disk_dir):
    """Root without CAP_DAC_OVERRIDE stands in for another user."""
    os.chmod(disk_dir, 0)
    try:
        done = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m",
                               "kvstore.cli", "fsck", str(disk_dir)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": REPO})
    finally:
        os.chmod(disk_dir, 0o755)
    assert done.returncode == 2 and f"{disk_dir} cannot be read by this user" in done.stderr, done.stderr


def test_a_torn_record_past_the_committed_tail_is_uncommitted_not_corrupt(disk_dir):
    """A crash mid-append leaves a record whose header landed and whose payload did not: the
    legitimate crash state the next open cuts away, so the tier is clean."""
    segment = disk_dir / "segments" / "00000001.seg"
    tail = os.path.getsize(segment)
    first = next(scan_segment(str(segment), header_key_of(disk_dir), verify=False))
    with open(segment, "r+b") as f:  # the first record's header and half its payload, at the tail
        f.seek(tail)
        f.write(os.pread(f.fileno(), HEADER_BYTES + first.header.nbytes // 2, first.offset))
    report = fsck(str(disk_dir))
    assert report.clean and report.corrupt_records == 0 and report.problems == []
    assert report.ok == 10 and report.uncommitted_bytes == HEADER_BYTES + first.header.nbytes // 2
    assert "status: clean" in format_report(report)


def test_an_unreadable_index_is_a_reported_problem_not_a_crash(disk_dir, capsys):
    (disk_dir / "index" / "CURRENT").write_bytes(b"garbage")
    report = fsck(str(disk_dir))
    assert not report.clean and report.index_unreadable and report.orphans == 10 and report.ok == 0
    assert any("index is unreadable" in p and "--repair" in p for p in report.problems)
    assert main(["fsck", str(disk_dir)]) == 1
    out, err = capsys.readouterr()
    assert "index is unreadable" in out and "PROBLEMS FOUND" in out and err == ""
    repaired = fsck(str(disk_dir), repair=True)  # the index is rebuilt from the segments
    assert repaired.clean and repaired.ok == repaired.indexed_blocks == 10


def test_an_index_block_failing_its_checksum_is_unreadable_not_clean(tmp_path):
    """Before, the check read the index up to the bad block as if it ended there: "clean", with the
    entries after it counted as orphans (which the next open punched out)."""
    path = tmp_path / "disk"
    corrupt_index_block(tier_with_index_in_one_sst(path, 300), "entries")
    report = fsck(str(path))
    assert not report.clean and report.index_unreadable and report.ok == 0 and report.orphans == 300
    assert any("index is unreadable (Corruption: block checksum mismatch" in p for p in report.problems)
    repaired = fsck(str(path), repair=True)  # the index is rebuilt from the segments
    assert repaired.clean and repaired.ok == repaired.indexed_blocks == 300 and repaired.orphans == 0


def test_fsck_refuses_a_tier_another_process_has_open_and_changes_nothing(disk_dir, capsys):
    with TierOwner(disk_dir) as owner:
        assert owner.put(1000, 1001) == [True, True]
        for repair in (False, True):
            with pytest.raises(NotPermitted, match=f"{disk_dir} is in use"):
                fsck(str(disk_dir), repair=repair)
        assert main(["fsck", "--repair", str(disk_dir)]) == 2
        assert "is in use: another kvstore process" in capsys.readouterr().err
        assert sorted(os.listdir(disk_dir)) == ["header.key", "index", "segments", "tier.lock"]  # no index moved aside
        assert owner.put(1002) == [True]  # durable: acknowledged means on disk
        owner.close()
    tier = DiskTier(str(disk_dir), 64 << 20)
    try:
        assert tier.stats().extra["index_rebuilds"] == 0 and tier.stats().blocks == 13
        assert all(reads_exact(tier, i) for i in (1000, 1001, 1002))
    finally:
        tier.close()


def test_a_repair_on_a_full_file_system_says_so_and_moves_nothing(disk_dir, tmp_path, capsys):
    """Before, the full disk made the open take the index for corrupt: it was moved aside, and the
    repair died with a traceback of a private _CorruptIndex."""
    with mounted_tmpfs(str(tmp_path / "full"), 8 << 20) as mount:
        tier_dir = shutil.copytree(disk_dir, os.path.join(mount, "disk"))
        filler = os.open(os.path.join(mount, "filler"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.posix_fallocate(filler, 0, shutil.disk_usage(mount).free)
            assert main(["fsck", "--repair", tier_dir]) == 2
            out, err = capsys.readouterr()
            assert "No space left on device" in err and tier_dir in err and out == ""
            assert sorted(os.listdir(tier_dir)) == ["header.key", "index", "segments", "tier.lock"]
            report = fsck(tier_dir)  # the check needs no space, and the index still reads
            assert report.clean and report.ok == report.indexed_blocks == 10
        finally:
            os.close(filler)
