"""The disk tier's files: an index entry's format, one open segment file, the lock that says which
process owns a tier directory, opening the index, and the file-system helpers the tier uses on them
(segment names, O_DIRECT probing, directory fsync, truncation), and the header key file
(``kvstore.tiers.header_key`` says why it exists).

Mechanism only: which record goes where, and when, is ``kvstore.tiers.disk``'s business.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import struct
import time
from dataclasses import dataclass

from typing import Callable

import numpy as np
from rocksdict import Options, Rdict

from kvstore.errors import InvalidRequest, NotPermitted
from kvstore.sizing import format_bytes
from kvstore.tiers.direct_io import open_direct, read_direct
from kvstore.tiers.header_key import SECRET_BYTES, HeaderKey
from kvstore.tiers.segment import HEADER_BYTES, RecordHeader, footprint, scan_segment

log = logging.getLogger(__name__)

_ENTRY = struct.Struct("<IQQIQ32sB")  # segment, offset, nbytes, num_layers, seq, parent, has_parent

# the index's keys: BLOCK_KEY_PREFIX + block key -> IndexEntry; TAIL_KEY -> the committed tail;
# NEXT_SEQ_KEY -> the sequence number the next record takes (missing in indexes written before
# it existed: then the live entries' highest, plus one)
BLOCK_KEY_PREFIX = b"b"
TAIL_KEY = b"m/tail"
TAIL_VALUE = struct.Struct("<IQ")  # segment id, offset
NEXT_SEQ_KEY = b"m/next-seq"
NEXT_SEQ_VALUE = struct.Struct("<Q")
FORMAT_KEY = b"m/format"
HEADER_KEY_CHECK = b"m/header-key"  # HeaderKey.fingerprint() of the key the entries were written under
FORMAT_VERSION = b"kvstore-disk-2"  # 2: header tags keyed with DIR/header.key (``header_key``)
HEADER_KEY_FILE = "header.key"


@dataclass(slots=True)
class IndexEntry:
    segment: int
    offset: int
    nbytes: int
    num_layers: int
    seq: int
    parent: bytes | None

    def encode(self) -> bytes:
        return _ENTRY.pack(
            self.segment, self.offset, self.nbytes, self.num_layers, self.seq,
            self.parent or bytes(32), self.parent is not None,
        )

    @classmethod
    def decode(cls, raw: bytes) -> "IndexEntry":
        segment, offset, nbytes, num_layers, seq, parent, has_parent = _ENTRY.unpack(raw)
        return cls(segment, offset, nbytes, num_layers, seq, parent if has_parent else None)

    def described_by(self, header: RecordHeader | None, key: bytes) -> bool:
        """Whether ``header`` is the record this entry indexes for ``key``: its key, size and layer
        count (a record of another shape, its checksums sliced by this entry's layers, is no record of it)."""
        return (header is not None and header.key == key and header.nbytes == self.nbytes
                and header.num_layers == self.num_layers)


class SegmentFile:
    """One segment file (created if missing), open through one read-write descriptor ``fd`` for
    as long as the tier uses it: O_DIRECT where ``direct`` is asked for and the file system has
    it (then ``direct`` stays True: every read and append on ``fd`` must be aligned), else
    buffered. Readers hold a reference while they read, so the descriptor stays valid even if
    the segment is deleted meanwhile (it closes with the last reference).

    One descriptor serves reads, appends, size, holes and fdatasync alike (O_DIRECT constrains
    data transfers only; fstat, fallocate, ftruncate, fdatasync and fadvise take any descriptor),
    so a tier holds one per segment plus RocksDB's few: 1 TiB in 256 MiB segments is 4,096, and
    the tier raises its soft open-files limit to the hard one (``kvstore.open_files``). Each
    sealed segment used to hold two (three for the active one). Opening sealed segments lazily
    through a bounded cache would hold fewer, but every read and read-ahead would then have to
    pin its descriptor so that closing it for another file could not make a read land in the
    wrong file, on the hottest path, for files that cost no more than a descriptor each.
    """

    def __init__(self, segment_id: int, path: str, direct: bool = False):
        self.id = segment_id
        self.path = path
        fd = open_direct(path, writable=True) if direct else None
        self.direct = fd is not None
        self.fd = fd if fd is not None else os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.live_bytes = 0
        self.dead_bytes = 0  # removed but not reclaimable (no hole punching)
        self.dirty = False

    def read(self, offset: int, length: int) -> np.ndarray | bytes:
        """Up to ``length`` bytes at ``offset`` (fewer at the end of the file) through ``fd``; with
        O_DIRECT a view of this thread's read bounce buffer, valid until the thread's next read."""
        if self.direct:
            return read_direct(self.fd, offset, length)
        return os.pread(self.fd, length, offset)

    def read_header(self, offset: int, header_key: HeaderKey) -> RecordHeader | None:
        """The record header at ``offset`` that ``header_key`` authenticates; None where there is
        none (the file ends before a whole header page, the page is not a header of this tier)."""
        return RecordHeader.decode(self.read(offset, HEADER_BYTES), header_key)

    def __del__(self) -> None:
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            os.close(fd)


LOCK_NAME = "tier.lock"


class DirectoryLock:
    """An advisory ``flock`` on ``DIR/tier.lock``, held from construction until ``release()``.

    Exclusive (``shared=False``): the owner of a tier directory, the only one that may change it.
    Shared: a reader that needs the directory to hold still (``kvstore fsck``); it never creates
    the lock file (a directory without one has never been opened by a tier that locks).
    Either raises ``NotPermitted`` at once, never waits, when the other kind is held, by another
    process or by another tier in this one (flock locks belong to an open file, not a process).
    The kernel drops the lock when its holder dies, SIGKILL included, so a dead owner never
    blocks the next one. ``release`` is idempotent.
    """

    def __init__(self, directory: str, shared: bool = False):
        self.path = os.path.join(directory, LOCK_NAME)
        self._fd: int | None = None
        try:
            fd = os.open(self.path, os.O_RDONLY) if shared else os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:
            return  # shared only: nothing to lock against
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise NotPermitted(
                f"disk tier directory {directory} is in use: another kvstore process (a running "
                f"`kvstore serve`, or an fsck) has it open. Stop that process first (a second tier "
                f"needs a directory of its own).") from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor of the open file drops the flock

    def __del__(self) -> None:
        self.release()


def read_header_key(directory: str) -> HeaderKey | None:
    """The key of the tier in ``directory``; None where it has none. A key file of the wrong size
    raises ``InvalidRequest`` (it was written whole and synced: a damaged or foreign file)."""
    path = os.path.join(directory, HEADER_KEY_FILE)
    try:
        with open(path, "rb") as f:
            secret = f.read(SECRET_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(secret) != SECRET_BYTES:
        raise InvalidRequest(f"{path} holds {len(secret)} bytes, not the {SECRET_BYTES} a tier writes: it is "
                             f"damaged or not a tier's; delete it to start the tier over (no record written "
                             f"under the old key can be trusted without it)")
    return HeaderKey(secret)


def open_header_key(directory: str) -> tuple[HeaderKey, bool]:
    """The key of the tier in ``directory``, created (durably) where there is none; and whether
    it was created. The caller holds the directory's exclusive lock (no two creators race)."""
    key = read_header_key(directory)
    if key is not None:
        return key, False
    secret = os.urandom(SECRET_BYTES)
    path = os.path.join(directory, HEADER_KEY_FILE)
    scratch = path + ".new"
    try:
        fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a leftover scratch file keeps its old mode through O_TRUNC
            if os.write(fd, secret) != SECRET_BYTES:
                raise OSError(errno.ENOSPC, "short write")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(scratch, path)
        fsync_directory(directory)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(scratch)
        raise OSError(exc.errno, f"disk tier {directory}: writing its header key to {path} failed "
                                 f"({exc.strerror or exc}); nothing else was changed") from exc
    return HeaderKey(secret), True


def allocated_bytes(directory: str) -> int:
    """The bytes the files below ``directory`` take on disk (holes not counted; 0 if it is missing)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:  # removed meanwhile (a segment deleted by a running tier)
                pass
    return total


def room_for_tier(path: str) -> int:
    """The most a tier at ``path`` can take of its file system now: the free space and what its
    files already take."""
    return shutil.disk_usage(path).free + allocated_bytes(path)


MIN_DISK_CAPACITY = HEADER_BYTES * 2


def disk_capacity_problem(capacity_bytes: int) -> str | None:
    """Why a disk tier cannot have ``capacity_bytes``, or None."""
    if capacity_bytes < MIN_DISK_CAPACITY:
        return (f"disk tier capacity must be at least {MIN_DISK_CAPACITY} bytes (0 disables the tier), "
                f"got {capacity_bytes}")
    return None


def warn_if_oversized(path: str, capacity_bytes: int) -> None:
    """Warn when a tier's capacity is more than its file system can give it: it would fill the file
    system, and then its index (which RocksDB writes at every open) could not open again."""
    room = room_for_tier(path)
    if capacity_bytes > room:
        log.warning("disk tier %s: its capacity, %s, is more than its file system can give it (%s with what "
                    "the tier holds now): once the file system is full its writes fail, and it cannot "
                    "open again until space is freed there; give it a capacity below that",
                    path, format_bytes(capacity_bytes), format_bytes(room))


def open_index(index_dir: str) -> Rdict:
    """The tier's RocksDB index, created if missing (empty: the tier rebuilds it from the segments).

    An index RocksDB cannot open because it is broken (corrupt, files missing, or the path is not
    a directory) is set aside (``set_aside``) and a new one created: the segments are the truth,
    and the tier rebuilds the entries from them. An index that fails to open for a reason outside
    it (locked by another process, no space left, a read-only file system, an I/O error, no
    access, too many open files) raises ``OSError`` (with that errno where there is one) naming
    the directory and the cause, and is left as it is: it is not broken, and moving it would take
    a live index from under its owner, or throw away a good one for want of space.
    """
    try:
        if os.path.lexists(index_dir) and not os.path.isdir(index_dir):
            raise CorruptIndex("not a directory")
        return _open_rdict(index_dir)
    except CorruptIndex as exc:
        set_aside(index_dir, str(exc))
        return _open_rdict(index_dir)


def set_aside(index_dir: str, reason: str) -> None:
    """Move an index that cannot be used (closed) to ``index.corrupt-TIME``, out of the way of a new one."""
    aside = f"{index_dir}.corrupt-{int(time.time())}"
    log.warning("disk index at %s cannot be used (%s); moved to %s, rebuilding", index_dir, reason, aside)
    shutil.move(index_dir, aside)


class CorruptIndex(Exception):
    """RocksDB cannot use the index: a rebuild from the segments repairs it."""


@dataclass(frozen=True)
class StoredIndex:
    """Everything an index holds (``read_index``)."""

    stamp: bytes | None  # FORMAT_KEY's value; None in an index no tier has stamped yet
    key_check: bytes | None  # HEADER_KEY_CHECK's value
    tail: tuple[int, int] | None  # the committed tail (segment id, offset); None before the first record
    next_seq: int | None  # NEXT_SEQ_KEY's value, where the index has it
    entries: dict[bytes, IndexEntry]  # block key -> where its record is


def read_index(db: Rdict, index_dir: str) -> StoredIndex:
    """Everything ``db``, the index at ``index_dir``, holds, read in full before anyone acts on it.
    Raises ``CorruptIndex`` where a read finds it broken (a block failing its checksum, a malformed
    value), and ``OSError`` where a read fails for a cause outside it (``_index_error``). Block
    entries are read through an iterator whose status is checked at the end: rocksdict's
    ``items()`` stops at a block that fails its checksum as if the index ended there, and a tier
    taking that shortened index for the truth frees the good records it no longer lists."""
    try:
        stamp, tail, next_seq = db.get(FORMAT_KEY), db.get(TAIL_KEY), db.get(NEXT_SEQ_KEY)
        return StoredIndex(stamp, db.get(HEADER_KEY_CHECK), TAIL_VALUE.unpack(tail) if tail else None,
                           NEXT_SEQ_VALUE.unpack(next_seq)[0] if next_seq else None, _block_entries(db))
    except struct.error as exc:
        raise CorruptIndex(f"a malformed value ({exc})") from exc
    except Exception as exc:  # rocksdict raises plain Exception with RocksDB's status as its message
        raise _index_error(index_dir, "read", exc) from exc


def _block_entries(db: Rdict) -> dict[bytes, IndexEntry]:
    """Block key -> entry for every block in ``db``; raises what RocksDB raises where a read fails."""
    entries: dict[bytes, IndexEntry] = {}
    it = db.iter()
    try:
        it.seek(BLOCK_KEY_PREFIX)
        while it.valid() and it.key().startswith(BLOCK_KEY_PREFIX):
            entries[it.key()[1:]] = IndexEntry.decode(it.value())
            it.next()
        it.status()  # raises the error that ended the loop, if one did
    finally:
        del it  # a live iterator keeps the index open, and so its LOCK held, past the index's close
    return entries


# RocksDB's LOCK file held (its wording varies: "lock hold by current process", "While lock file:
# .../LOCK: Resource temporarily unavailable"): the index is another's, not broken
_LOCKED = re.compile(r"/LOCK\b|lock hold")

# errors of the file system or of our rights, not of the index, and what to do about each; RocksDB
# names them by strerror ("IO error: No space left on device: While appending to file: ..."), its
# Rust wrapper by number ("No space left on device (os error 28)")
_NOT_THE_INDEX = {
    errno.ENOSPC: "free space on its file system",
    errno.EDQUOT: "free space within this user's disk quota",
    errno.EROFS: "make its file system writable",
    errno.EIO: "check the device (dmesg)",
    errno.EACCES: "give this user access to it",
    errno.EPERM: "give this user access to it",
    errno.EMFILE: "raise the open-files limit (ulimit -n, LimitNOFILE)",
    errno.ENFILE: "raise the system's open-files limit (fs.file-max)",
    errno.ENOMEM: "free memory",
}


def _cause(message: str) -> int | None:
    """The errno of ``_NOT_THE_INDEX`` that a RocksDB error message names, if any."""
    for code in _NOT_THE_INDEX:
        if os.strerror(code) in message or f"(os error {code})" in message:
            return code
    return None


def _open_rdict(index_dir: str) -> Rdict:
    """Open (or create) the index; ``OSError`` if it fails for a reason outside the index (locked,
    full, read-only, unreadable...), else ``CorruptIndex`` for any failure."""
    try:
        return Rdict(index_dir, options=Options(raw_mode=True))
    except Exception as exc:  # rocksdict raises plain Exception with RocksDB's status as its message
        raise _index_error(index_dir, "opened", exc) from exc


def _index_error(index_dir: str, done: str, exc: Exception) -> Exception:
    """What RocksDB's failure ``exc`` to be ``done`` ("opened", "read") to the index means: an
    ``OSError`` naming the cause and what to do, where the cause is outside the index (locked,
    full, read-only, unreadable...), else ``CorruptIndex``."""
    message = str(exc)
    code = _cause(message)
    if code is not None:
        return OSError(code, f"disk index at {index_dir} could not be {done} ({message}); left as it is: "
                             f"{os.strerror(code)} is no corruption. {_NOT_THE_INDEX[code].capitalize()}, then "
                             f"open the tier again.")
    if _LOCKED.search(message):
        return OSError(f"disk index at {index_dir} could not be {done} ({message}); left as it is: it is in "
                       f"use, not corrupt. Stop the process that has it open, then open the tier again.")
    return CorruptIndex(message)


def segment_name(segment_id: int) -> str:
    return f"{segment_id:08d}.seg"


def newest_records(segments_dir: str, segment_ids: list[int], header_key: HeaderKey,
                   progress: Callable[[int], None] | None = None) -> tuple[dict[bytes, IndexEntry], tuple[int, int]]:
    """The index a set of segments implies: for each key its valid record (``header_key``
    authenticates its header, its payload verifies) with the highest sequence number, and the
    tail (segment, offset) after the last valid record."""
    best: dict[bytes, IndexEntry] = {}
    tail = (0, 0)
    for segment_id in segment_ids:
        for record in scan_segment(os.path.join(segments_dir, segment_name(segment_id)), header_key, verify=True,
                                   progress=progress):
            if not record.valid:
                continue
            header = record.header
            if header.key not in best or best[header.key].seq < header.seq:
                best[header.key] = IndexEntry(segment_id, record.offset, header.nbytes, header.num_layers,
                                              header.seq, header.parent)
            tail = max(tail, (segment_id, record.offset + footprint(header.nbytes)))
    return best, tail


def supports_direct(directory: str) -> bool:
    """Whether files in ``directory`` can be opened with O_DIRECT (not on tmpfs, say)."""
    probe = os.path.join(directory, ".direct-probe")
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT, 0o644))
    try:
        fd = open_direct(probe, writable=True)
        if fd is None:
            return False
        os.close(fd)
        return True
    finally:
        os.unlink(probe)


def fsync_directory(path: str) -> None:
    """Make a directory's entries (a new segment file) survive a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def truncate_quietly(fd: int, length: int) -> None:
    """Cut a file back to ``length`` after a failed write; best effort (the record is lost either way)."""
    try:
        os.ftruncate(fd, length)
    except OSError:
        pass
