"""``kvstore fsck DIR``: verify a disk tier without changing it (or repair it with ``repair=True``).

Every segment is scanned and every payload checksum verified; the index is cross-checked against
what the segments hold. Findings:

    ok                 indexed, and the record at that place has that key and verifies
    bad_entries        indexed, but the record there is missing, corrupt or another key's
    corrupt_records    a record header that parses but whose payload fails its checksums
    orphans            a complete, verifying record no index entry points at (unacknowledged)
    missing_segments   segments the index points at that do not exist
    uncommitted_bytes  bytes at or past the committed tail (an interrupted write; a torn record
                       there is not a corrupt one)
    index_unreadable   the index could not be read in full: it does not open, or a block of it fails
                       its checksum (repair rebuilds it from the segments)
    header_key_problem "missing": segments, but no DIR/header.key to authenticate their record headers
                       with; "unreadable": a key file that cannot be read or is damaged; "another": the
                       index's entries were written under another key. Nothing can be served, and
                       nothing is verified (the next open, or repair, starts the tier empty; a damaged
                       key file must be deleted first)
    other_format       the index is another format version's and holds blocks (checked by nothing)

A tier is clean when there are no bad entries, corrupt records or missing segments and the index
reads: orphans and uncommitted bytes are what a crash legitimately leaves, and the next open
reclaims them. Repair opens the tier (which runs its recovery), reads every block through the
verifying read path (dropping any that fail), and closes it.

fsck checks a tier at rest: while a process has the tier open (it holds ``DIR/tier.lock``), the
check and the repair both refuse with ``NotPermitted`` rather than race its writes. The check
holds a shared lock meanwhile, so no tier opens the directory under it; it creates nothing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator

import numpy as np
from rocksdict import AccessType, Options, Rdict

from kvstore.errors import InvalidRequest
from kvstore.tiers.disk_files import (
    FORMAT_VERSION, HEADER_KEY_FILE, DirectoryLock, StoredIndex, read_header_key, read_index, room_for_tier,
)
from kvstore.tiers.header_key import HeaderKey
from kvstore.tiers.segment import scan_segment

ProgressFactory = Callable[[str, int], Callable[[int], None]]


@dataclass
class FsckReport:
    path: str
    segments: int = 0
    indexed_blocks: int = 0
    ok: int = 0
    bad_entries: int = 0
    corrupt_records: int = 0
    orphans: int = 0
    missing_segments: int = 0
    uncommitted_bytes: int = 0
    payload_bytes: int = 0
    repaired_entries: int = 0
    index_unreadable: bool = False
    header_key_problem: str = ""  # "missing", "unreadable" or "another" (the index's entries are another key's)
    other_format: str = ""  # the index's format, where it is another version's and holds blocks
    problems: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.bad_entries or self.corrupt_records or self.missing_segments or self.index_unreadable
                    or self.header_key_problem or self.other_format)

    def as_dict(self) -> dict:
        return {**asdict(self), "clean": self.clean}


def _read_index(index_dir: str) -> StoredIndex:
    """Everything the index holds, read-only and writing nothing there; raises where any of it
    cannot be read (``read_index``), never returns part of it."""
    with _shadow_of(index_dir) as shadow:
        db = Rdict(shadow, options=Options(raw_mode=True), access_type=AccessType.read_only())
        try:
            return read_index(db, index_dir)
        finally:
            db.close()


@contextlib.contextmanager
def _shadow_of(index_dir: str) -> Iterator[str]:
    """A temporary directory of links to the index's files, to open the index read-only from:
    rocksdict rewrites its ``rocksdict-config.json`` (and RocksDB its ``LOG``) even then, which
    changed the tier under a check and failed it on a read-only file system ("index unreadable,
    run --repair"). Those two are copied or left out; the rest are read through the links."""
    with tempfile.TemporaryDirectory(prefix="kvstore-fsck-index-") as shadow:
        for name in os.listdir(index_dir):
            source = os.path.join(os.path.abspath(index_dir), name)
            if name == "rocksdict-config.json":
                shutil.copyfile(source, os.path.join(shadow, name))
            elif name != "LOCK" and not name.startswith("LOG"):
                os.symlink(source, os.path.join(shadow, name))
        yield shadow


def fsck(path: str, progress: ProgressFactory | None = None, repair: bool = False) -> FsckReport:
    """Check the tier at ``path`` (after repairing it, with ``repair``). The check changes nothing.
    Raises ``InvalidRequest`` if ``path`` is no disk tier, ``NotPermitted`` if a process has it open,
    and, with ``repair``, ``OSError`` naming the cause if the tier cannot be opened for a reason
    outside it (no space left, a read-only file system...: ``open_index``), having changed nothing."""
    if not os.path.isdir(os.path.join(path, "segments")):
        raise InvalidRequest(_not_a_tier(path))
    report = FsckReport(path=os.path.abspath(path))
    if repair:
        report.repaired_entries = _repair(path, progress)
    lock = DirectoryLock(path, shared=True)
    try:
        _check(path, report, progress)
    finally:
        lock.release()
    return report


def _not_a_tier(path: str) -> str:
    """Why ``path`` is no disk tier directory, and where the tier may be."""
    if not os.path.exists(path):
        return f"{path} does not exist; give a disk tier's directory (DATA_DIR/disk)"
    if not os.path.isdir(path):
        return f"{path} is a file, not a directory; give a disk tier's directory (DATA_DIR/disk)"
    if not os.access(path, os.R_OK | os.X_OK):
        return f"{path} cannot be read by this user; run as the tier's owner"
    if os.path.isdir(os.path.join(path, "disk", "segments")):
        return f"{path} is not a kvstore disk tier directory, but holds one: did you mean {os.path.join(path, 'disk')}?"
    return f"{path} is not a kvstore disk tier directory (no segments/ inside)"


def _load_index(path: str, report: FsckReport) -> StoredIndex:
    """``_read_index``, with a missing or unreadable index noted in ``report`` instead of raised
    (then an empty, unstamped one)."""
    index_dir = os.path.join(path, "index")
    if not os.path.isdir(index_dir):
        report.problems.append("index directory is missing (the next open rebuilds it from the segments)")
        return _NO_INDEX
    try:
        return _read_index(index_dir)
    except Exception as exc:  # rocksdict raises plain Exception
        report.index_unreadable = True
        report.problems.append(f"index is unreadable ({exc}); run with --repair to rebuild it from the segments")
        return _NO_INDEX


_NO_INDEX = StoredIndex(None, None, None, None, {})


def _usable_header_key(path: str, report: FsckReport, stored: StoredIndex, segments: int) -> HeaderKey | None:
    """The key to check the records with; None, with why in ``report``, where there is none to
    trust: no key file (with segments to check), one that cannot be read, or an index of
    entries written under another key (the file replaced or lost and made anew)."""
    try:
        header_key = read_header_key(path)
    except (InvalidRequest, OSError) as exc:
        report.header_key_problem = "unreadable"
        report.problems.append(f"{HEADER_KEY_FILE} cannot be used ({exc}); no record can be checked without it")
        return None
    if header_key is None:
        if segments:
            report.header_key_problem = "missing"
            report.problems.append(f"{HEADER_KEY_FILE} is missing: no record header of the {segments} segments "
                                   "can be authenticated, so none of their blocks can be served (the next open, "
                                   "or --repair, reclaims them and starts the tier empty)")
        return None
    if stored.stamp is not None and stored.entries and stored.key_check != header_key.fingerprint():
        report.header_key_problem = "another"
        report.problems.append(f"the index's entries were written under another header key than {HEADER_KEY_FILE}: "
                               "none of them can be served (the next open, or --repair, sets the index aside and "
                               "reclaims the records)")
        return None
    return header_key


def _check(path: str, report: FsckReport, progress: ProgressFactory | None) -> None:
    segments_dir = os.path.join(path, "segments")
    stored = _load_index(path, report)
    entries, tail = stored.entries, stored.tail
    report.indexed_blocks = len(entries)
    segment_ids = sorted(int(n[:-4]) for n in os.listdir(segments_dir) if n.endswith(".seg") and n[:-4].isdigit())
    report.segments = len(segment_ids)
    if stored.stamp not in (None, FORMAT_VERSION) and entries:
        report.other_format = stored.stamp.decode(errors="replace")
        report.problems.append(f"the index is of format {report.other_format!r}, and this kvstore reads "
                               f"{FORMAT_VERSION.decode()!r}: check it with the kvstore that wrote it (this one "
                               "refuses to open it; deleting the directory starts it over)")
        return
    header_key = _usable_header_key(path, report, stored, len(segment_ids))
    found = _verified_records(segments_dir, segment_ids, header_key, tail, report, progress) if header_key else {}
    present = set(segment_ids)
    missing = {entry.segment for entry in entries.values() if entry.segment not in present}
    report.missing_segments = len(missing)
    report.problems += [f"segment {s} is referenced by the index but missing" for s in sorted(missing)]
    if header_key is None:  # nothing could be verified: the entries are neither good nor bad
        return
    referenced = set()
    for key, entry in entries.items():
        referenced.add((entry.segment, entry.offset))
        if found.get((entry.segment, entry.offset)) == key:
            report.ok += 1
        elif entry.segment not in missing:
            report.bad_entries += 1
            report.problems.append(f"index entry {key.hex()} -> segment {entry.segment} offset {entry.offset}: "
                                   "no verifying record")
    report.orphans = sum(1 for place in found if place not in referenced)


def _verified_records(segments_dir: str, segment_ids: list[int], header_key: HeaderKey, tail: tuple[int, int] | None,
                      report: FsckReport, progress: ProgressFactory | None) -> dict[tuple[int, int], bytes]:
    """(segment, offset) -> key of every record that verifies; corrupt ones and uncommitted bytes
    counted in ``report``."""
    total = sum(os.path.getsize(os.path.join(segments_dir, f"{i:08d}.seg")) for i in segment_ids)
    advance = progress("verifying segments", total) if progress else None
    found: dict[tuple[int, int], bytes] = {}
    for segment_id in segment_ids:
        seg_path = os.path.join(segments_dir, f"{segment_id:08d}.seg")
        for record in scan_segment(seg_path, header_key, verify=True, progress=advance):
            if record.valid:
                found[(segment_id, record.offset)] = record.header.key
                report.payload_bytes += record.header.nbytes
            elif not _uncommitted(tail, segment_id, record.offset):  # a torn record there is a crash leftover
                report.corrupt_records += 1
                report.problems.append(f"segment {segment_id} offset {record.offset}: record fails its checksums")
        report.uncommitted_bytes += _uncommitted_bytes(tail, segment_id, os.path.getsize(seg_path))
    return found


def _uncommitted(tail: tuple[int, int] | None, segment_id: int, offset: int) -> bool:
    """Whether ``offset`` of a segment is at or past the committed tail (no tail known: never)."""
    return tail is not None and (segment_id, offset) >= tail


def _uncommitted_bytes(tail: tuple[int, int] | None, segment_id: int, size: int) -> int:
    """Bytes of a ``size``-byte segment at or past the committed tail."""
    if tail is None or segment_id < tail[0]:
        return 0
    return size if segment_id > tail[0] else max(0, size - tail[1])


def _repair(path: str, progress: ProgressFactory | None) -> int:
    """Open the tier (recovery runs), read-verify every block, drop the failures."""
    from kvstore.tiers.disk import DiskTier  # the tier's own recovery is the repair

    capacity = max(room_for_tier(path), 1 << 20)  # what it holds and the room left: no oversized-tier warning
    tier = DiskTier(path, capacity, progress=progress)
    try:
        before = tier.stats().blocks
        items = list(tier.items())
        advance = progress("repairing", sum(meta.nbytes for _, meta in items)) if progress else None
        for key, meta in items:
            scratch = np.empty(meta.nbytes, np.uint8)
            tier.read(key, scratch)
            if advance:
                advance(meta.nbytes)
        return before - tier.stats().blocks + tier.stats().extra["recovered_lost_blocks"]
    finally:
        tier.close()


def format_report(report: FsckReport) -> str:
    lines = [
        f"disk tier {report.path}",
        f"  segments {report.segments}, indexed blocks {report.indexed_blocks}, verified ok {report.ok}",
        f"  bad index entries {report.bad_entries}, corrupt records {report.corrupt_records}, "
        f"missing segments {report.missing_segments}",
        f"  orphan records {report.orphans}, uncommitted tail bytes {report.uncommitted_bytes}",
    ]
    if report.repaired_entries:
        lines.append(f"  repaired: dropped {report.repaired_entries} blocks that failed verification")
    lines += [f"  ! {p}" for p in report.problems[:20]]
    if len(report.problems) > 20:
        lines.append(f"  ... and {len(report.problems) - 20} more")
    lines.append("  status: " + ("clean" if report.clean else "PROBLEMS FOUND (run with --repair to drop bad blocks)"))
    return "\n".join(lines)
