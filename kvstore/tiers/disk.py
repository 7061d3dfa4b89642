"""Disk tier: append-only segment files hold block bytes; a RocksDB index maps key -> record.

    DIR/segments/00000001.seg ...   records (format in ``kvstore.tiers.segment``)
    DIR/index/                      RocksDB: b"b" + key -> entry, b"m/tail" -> active tail
    DIR/header.key                  the secret that authenticates record headers (``header_key``)

Why the bytes are not in RocksDB: blob reads through it measured 0.74 GB/s here against
6.7 GB/s for ``preadv`` into the destination buffer (DESIGN.md section 7). I/O is O_DIRECT by
default (``direct_io``), reads and appends alike, never mixed with buffered I/O on the same files:
a record is read (header page + payload, read ahead over multi-block loads: ``read_ahead``) into
an aligned buffer, every layer read is verified against the checksums in the record header, and
only then copied to the caller. A mismatch is a miss, the entry is dropped and counted, and
nothing wrong is ever served. Buffered (``direct_io=False``), reads go straight into the
caller's buffer and are verified there.

One process owns a tier directory: it holds an exclusive ``flock`` on ``DIR/tier.lock`` from
before it touches anything there until ``close`` (the kernel drops it if the process dies), and a
second opener, in this process or another, gets ``NotPermitted`` instead of a share of the files.

Crash safety: a record's bytes are written before its index entry, in the same order every
time. On open, the active segment is cut back to the last committed tail (a partly written
record disappears), index entries whose segment file vanished are dropped, bytes no live record
covers are punched out, and a missing or unusable index is rebuilt from the segments (newest
sequence number wins: ``disk_recovery``); an index that is locked or that we may not read is
left alone and the open fails. ``durable=True`` acknowledges a write only after ``fdatasync`` and a
synced index write.

Space: capacity counts record footprints. Removing a record punches a hole over it; a segment
with no live record left is deleted. On a file system without hole punching (tested once at
open) the dead bytes keep counting until their whole segment dies. ``discard`` (what the store
calls under its lock) only updates the books, and the I/O waits for the next write, ``reclaim``
or flush (``disk_reclaim``).

Locks: ``_lock`` orders the I/O (writes, reclaims, flushes); ``_books`` guards the index, the
segments' byte counts and the work left to reclaim, and is never held through I/O, so a
``discard`` never waits for a write. A write the file system cannot take (no space
for the record or for the index's log, no inode or descriptor for a new segment file) is a
rejected write counted in ``io_errors``; the index is reopened after such a failure
(``_commit``), so writes resume once space is freed.

Descriptors: one per segment file for as long as the tier uses it (``SegmentFile`` says why not
fewer), plus RocksDB's; opening a tier raises the process's soft RLIMIT_NOFILE to the hard one.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import numpy as np
from rocksdict import Rdict, WriteOptions

from kvstore.checksum import layers_match
from kvstore.errors import InvalidRequest, StoreClosed
from kvstore.open_files import raise_open_files_limit
from kvstore.tiers.base import KEY_BYTES, BlockMeta, Tier, TierStats
from kvstore.tiers.direct_io import pwritev_all, read_record_direct, write_record_direct
from kvstore.tiers.disk_files import (
    BLOCK_KEY_PREFIX, NEXT_SEQ_KEY, NEXT_SEQ_VALUE, TAIL_KEY, TAIL_VALUE, DirectoryLock, IndexEntry, SegmentFile,
    disk_capacity_problem, fsync_directory, open_index, segment_name, supports_direct, truncate_quietly,
    warn_if_oversized,
)
from kvstore.tiers.disk_reclaim import DiskReclaim
from kvstore.tiers.disk_recovery import DiskRecovery
from kvstore.tiers.header_key import HeaderKey
from kvstore.tiers.read_ahead import ReadAhead, Record, ThreadRuns
from kvstore.tiers.segment import HEADER_BYTES, MAX_LAYERS, RecordHeader, footprint, start_writeback

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 256 << 20
_ZEROS = bytes(HEADER_BYTES)


class DiskTier(DiskRecovery, DiskReclaim, Tier):
    name = "disk"

    def __init__(
        self,
        path: str,
        capacity_bytes: int,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        durable: bool = False,
        progress: Callable[[str, int], Callable[[int], None]] | None = None,
        direct_io: bool = True,
    ):
        if problem := disk_capacity_problem(capacity_bytes):
            raise InvalidRequest(f"{problem}; --disk-capacity or KVSTORE_DISK_CAPACITY")
        self.path = os.path.abspath(path)
        self.capacity_bytes = capacity_bytes
        self.segment_bytes = segment_bytes
        self.durable = durable
        self._segments_dir = os.path.join(self.path, "segments")
        self._runs = ThreadRuns()  # each loading thread's O_DIRECT read-ahead
        self._lock = threading.RLock()  # held through I/O: writes, reclaims, flushes
        self._books = threading.Lock()  # index, byte counts, _unindexed, _holes; never held through I/O
        self._index: dict[bytes, IndexEntry] = {}
        self._segments: dict[int, SegmentFile] = {}
        self._active: SegmentFile | None = None
        self._tail = 0
        self._seq = 0
        self._header_key: HeaderKey | None = None  # DIR/header.key, read (or made) by recovery
        self._write_opt = WriteOptions()
        self._write_opt.sync = durable
        self._counters = dict.fromkeys(
            ("bytes_read", "bytes_written", "checksum_failures", "io_errors", "recovered_lost_blocks",
             "recovered_truncated_bytes", "index_rebuilds"), 0)
        self._counters_lock = threading.Lock()  # reads count without the tier's lock (held through write I/O)
        self._closed = False
        self._progress = progress
        self._writer: ThreadPoolExecutor | None = None
        self._index_dir = os.path.join(self.path, "index")
        self._db: Rdict | None = None  # None after an index write failed: reopened by the next one
        self._unindexed: set[bytes] = set()  # removed blocks whose index delete is still to be committed
        self._holes: list[tuple[int, int, int]] = []  # discarded records to punch: (segment id, offset, size)
        self._writing = 0  # footprint of the record being written (writes hold _lock: one at a time)
        self._reservations: dict[bytes, int] = {}  # key -> footprint set aside for its write (``reserve``)
        self._punches = True  # whether the file system punches holes (probed at open)
        self._unsynced_directory = False  # a segment file created since the segments directory was synced
        self._sync_failed = False  # an fsync failed: written pages may be lost whatever later ones say
        os.makedirs(self.path, exist_ok=True)
        self._dir_lock = DirectoryLock(self.path)  # first: another process's directory is never touched
        raise_open_files_limit("a disk tier holds one descriptor per segment file")
        try:
            self._open(direct_io)
        except BaseException:
            self._abandon_open()
            raise

    # ---- open and recovery -------------------------------------------------------------

    def _open(self, direct_io: bool) -> None:
        """Everything an open does once the directory is ours: files, I/O mode, index, recovery."""
        os.makedirs(self._segments_dir, exist_ok=True)
        # O_DIRECT reads and writes (default), or buffered ones: never a mix. A buffered read next
        # to an O_DIRECT append can leave stale pages in the page cache that later buffered reads
        # serve (seen here as records reading back as zeros); checksums caught it, as misses.
        # Where the file system has no O_DIRECT (tmpfs), everything is buffered.
        self.direct_io = direct_io and supports_direct(self._segments_dir)
        # writes a record's first MiB while the rest is copied into the bounce buffer (direct_io)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvstore-disk-write") if self.direct_io else None
        self._punches = self._probe_punching()
        self._db = open_index(self._index_dir)
        self._recover()
        warn_if_oversized(self.path, self.capacity_bytes)

    def _abandon_open(self) -> None:
        """After a failed open: close what was opened, then let the directory go."""
        self._drop_index()
        if self._writer is not None:
            self._writer.shutdown()
        self._segments.clear()
        self._active = None  # its reference would keep the active segment's descriptor open
        self._dir_lock.release()

    # ---- the Tier interface ------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Live and dead record bytes, the record being written and the room reserved for writes
        to come (so others make room for theirs)."""
        with self._books:
            return self._used_bytes()

    def _used_bytes(self) -> int:
        """``used_bytes``; caller holds ``_books``."""
        segments = sum(s.live_bytes + s.dead_bytes for s in self._segments.values())
        return segments + self._writing + sum(self._reservations.values())

    def footprint(self, nbytes: int) -> int:
        return footprint(nbytes)

    def can_fit(self, nbytes: int) -> bool:
        return self.used_bytes + footprint(nbytes) <= self.capacity_bytes

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def meta(self, key: bytes) -> BlockMeta | None:
        """``key``'s metadata, its checksums read from its record header; None when it is not
        resident or its header is not its own or cannot be read (an I/O error: counted, never
        raised, as a read's would be; the entry stays for ``read`` to verify and drop)."""
        entry = self._index.get(key)
        if entry is None:
            return None
        try:
            header = self._read_header(entry)
        except OSError as exc:
            self._count("io_errors", 1)
            log.warning("disk tier %s: reading a block's header failed (%s)", self.path, exc)
            return None
        if not entry.described_by(header, key):  # overwritten or zeroed under its entry: no record of it
            return None
        return BlockMeta(entry.nbytes, entry.num_layers, header.checksums, entry.parent)

    def parent_of(self, key: bytes) -> bytes | None:
        entry = self._index.get(key)  # the index keeps the parent: no header read
        return None if entry is None else entry.parent

    def items(self) -> Iterator[tuple[bytes, BlockMeta]]:
        """Resident blocks with parents; checksums are left empty (they stay on disk)."""
        with self._books:
            snapshot = [(k, BlockMeta(e.nbytes, e.num_layers, (), e.parent)) for k, e in self._index.items()]
        return iter(snapshot)

    def max_layers(self) -> int:
        return MAX_LAYERS  # a record header has room for this many layer checksums

    def write(self, key: bytes, payload: np.ndarray, meta: BlockMeta) -> bool:
        assert len(key) == KEY_BYTES and payload.nbytes == meta.nbytes, "malformed write (store bug)"
        if not 0 < meta.num_layers <= MAX_LAYERS:
            raise InvalidRequest(f"a disk record holds 1..{MAX_LAYERS} layers, got {meta.num_layers}")
        size = footprint(meta.nbytes)
        with self._lock:
            self._check_open()
            assert key not in self._index, "duplicate disk write (store bug)"
            with self._books:
                self._reservations.pop(key, None)  # its reserved room, if any, counts as _writing from here
                if self._used_bytes() + size > self.capacity_bytes:
                    return False
                self._writing = size
            segment = offset = None
            try:
                if (self._active is None or (self._tail and self._tail + size > self.segment_bytes)
                        or os.fstat(self._active.fd).st_nlink == 0):  # deleted behind our back
                    self._roll_segment()  # a new file: no inode or no descriptor left fails the write
                segment, offset = self._active, self._tail
                entry = IndexEntry(segment.id, offset, meta.nbytes, meta.num_layers, self._seq, meta.parent)
                header = RecordHeader(key, meta.nbytes, meta.num_layers, self._seq, meta.parent, meta.checksums)
                self._write_record(segment, offset, header.encode(self._header_key), payload, size)
                self._commit_and_punch({BLOCK_KEY_PREFIX + key: entry.encode(),
                                        TAIL_KEY: TAIL_VALUE.pack(segment.id, offset + size),
                                        NEXT_SEQ_KEY: NEXT_SEQ_VALUE.pack(self._seq + 1)})
            except Exception as exc:  # OSError from the segment, rocksdict raises plain Exception
                self._count("io_errors", 1)
                log.error("disk tier %s: write failed (%s); block not stored", self.path, exc)
                if segment is not None:
                    truncate_quietly(segment.fd, offset)
                with self._books:
                    self._writing = 0
                    if segment is not None:
                        self._unindexed.add(key)  # in case the failed batch reached the index's log after all
                self._reclaim_after_failed_write()
                return False
            with self._books:
                self._index[key] = entry
                segment.live_bytes += size
                self._writing = 0
            self._seq += 1
            self._tail = offset + size
            self._count("bytes_written", meta.nbytes)
            return True

    def _reclaim_after_failed_write(self) -> None:
        """Give back what evictions freed before a write that failed (out of space, say: the
        records it was to replace are still on the file system), so the store's retry can
        succeed instead of failing the same way until the next flush. Caller holds ``_lock``."""
        if not self._holes:
            return
        try:
            self._commit_and_punch({})
        except Exception as exc:  # rocksdict raises plain Exception; the deletes stay pending
            log.error("disk tier %s: reclaiming after a failed write failed too (%s)", self.path, exc)

    def _write_record(self, segment: SegmentFile, offset: int, header: bytes, payload: np.ndarray, size: int) -> None:
        segment.dirty = True  # the file's size (and, buffered, its pages) await fdatasync either way
        if segment.direct:
            write_record_direct(segment.fd, offset, header, payload.reshape(-1).view(np.uint8), size,
                                self._writer)
            if self.durable:
                os.fdatasync(segment.fd)
            return
        pad = size - HEADER_BYTES - payload.nbytes
        pwritev_all(segment.fd, [memoryview(header), memoryview(payload).cast("B"), memoryview(_ZEROS)[:pad]], offset)
        if self.durable:
            os.fdatasync(segment.fd)
        else:
            start_writeback(segment.fd, offset, size)

    def _roll_segment(self) -> None:
        next_id = max(self._segments, default=0) + 1
        segment = SegmentFile(next_id, os.path.join(self._segments_dir, segment_name(next_id)), self.direct_io)
        if self.durable:  # the new file's directory entry must survive a power loss too
            fsync_directory(self._segments_dir)
        else:
            self._unsynced_directory = True  # synced by the next flush
        with self._books:
            self._segments[next_id] = segment
        old, self._active, self._tail = self._active, segment, 0
        if old is not None and old.live_bytes == 0:
            self._delete_segment(old)

    def read(self, key: bytes, dst: np.ndarray, first_layer: int = 0, num_layers: int | None = None) -> bool:
        self._check_open()
        entry = self._index.get(key)
        if entry is None:
            self._runs.end(self._runs.current())  # a load stops at its first miss: its run ends too
            return False
        segment = self._segments.get(entry.segment)  # a reference keeps the descriptor open
        count = entry.num_layers - first_layer if num_layers is None else num_layers
        layer_bytes = entry.nbytes // entry.num_layers
        assert dst.nbytes == count * layer_bytes, "destination size checked by the store (bug)"
        start = entry.offset + HEADER_BYTES + first_layer * layer_bytes
        run = self._run_for(key, entry, first_layer, count)
        try:
            if segment is None or os.fstat(segment.fd).st_nlink == 0:
                raise FileNotFoundError(f"segment {entry.segment} is gone")
            span = run.take(key, entry.segment, entry.offset) if run is not None else None
            if run is not None and span is None:  # out of step with the run: read alone from now on
                self._runs.end(run)
                run = None
            if span is not None:  # read ahead while the blocks before it were verified and copied
                header_page, data = span[:HEADER_BYTES], span[HEADER_BYTES : HEADER_BYTES + dst.nbytes]
                complete = header_page.nbytes == HEADER_BYTES and data.nbytes == dst.nbytes
            elif segment.direct:
                header_page, data = read_record_direct(segment.fd, entry.offset, start, dst.nbytes)
                complete = header_page.nbytes == HEADER_BYTES and data.nbytes == dst.nbytes
            else:
                header_page, data = np.empty(HEADER_BYTES, np.uint8), dst
                complete = os.preadv(segment.fd, [header_page], entry.offset) == HEADER_BYTES
                complete = complete and os.preadv(segment.fd, [dst], start) == dst.nbytes
        except OSError as exc:
            self._runs.end(run)
            self._count("io_errors", 1)
            log.warning("disk tier %s: read of a block failed (%s); dropped", self.path, exc)
            self._remove_record(key, entry)
            return False
        verified = False
        try:
            verified = self._verify_and_copy(key, entry, header_page if complete else None, data, dst, first_layer,
                                             count)
            return verified
        finally:
            if run is not None:
                run.done()
                if not verified or run.exhausted():  # a miss stops the load: free the buffers, let the segments go
                    self._runs.end(run)

    def _verify_and_copy(self, key: bytes, entry: IndexEntry, header_page: np.ndarray | None, data: np.ndarray,
                         dst: np.ndarray, first_layer: int, count: int) -> bool:
        """Copy ``data`` into ``dst`` if the record verifies (``header_page`` None: it was read short);
        otherwise drop the block (``entry``, unless another write replaced it meanwhile) and count it."""
        header = RecordHeader.decode(header_page, self._header_key) if header_page is not None else None
        if not (entry.described_by(header, key)
                and layers_match(data, header.checksums[first_layer : first_layer + count])):
            self._count("checksum_failures", 1)
            log.warning("disk tier %s: block failed verification; dropped", self.path)
            self._remove_record(key, entry)
            return False
        if data is not dst:
            np.copyto(dst, data)  # verified bytes only ever reach the caller
        self._count("bytes_read", dst.nbytes)
        return True

    def _count(self, counter: str, amount: int) -> None:
        with self._counters_lock:
            self._counters[counter] += amount

    def prefetch(self, keys: list[bytes]) -> None:
        """Start reading these records now, so the reads of a multi-block load overlap with
        verifying and copying the blocks before them. Buffered reads: ask the kernel
        (``POSIX_FADV_WILLNEED``). O_DIRECT reads: a ``ReadAhead`` over the leading records
        present, for this thread's next whole-block reads of them in this order. The run ends
        (its buffers and segments let go) when it is read to its end, at the first read that
        misses (a load stops there), at a read out of its order, or at this thread's next
        ``prefetch`` (``prefetch([])`` just ends it)."""
        if self.direct_io:
            self._start_run(keys)
            return
        for key in keys:
            entry = self._index.get(key)
            segment = self._segments.get(entry.segment) if entry else None
            if segment is not None:
                try:
                    os.posix_fadvise(segment.fd, entry.offset, footprint(entry.nbytes), os.POSIX_FADV_WILLNEED)
                except OSError:
                    return  # a hint only

    def _start_run(self, keys: list[bytes]) -> None:
        records, owners = [], []
        for key in keys:
            entry = self._index.get(key)
            segment = self._segments.get(entry.segment) if entry else None
            if segment is None or not segment.direct:
                break
            records.append(Record(key, segment.id, segment.fd, entry.offset, footprint(entry.nbytes)))
            owners.append(segment)
        self._runs.start(records, tuple(owners))

    def _run_for(self, key: bytes, entry: IndexEntry, first_layer: int, count: int) -> ReadAhead | None:
        """This thread's read-ahead, if ``key`` is a whole-block read it can serve; a run that has
        fallen out of step with the reads is ended."""
        run = self._runs.current()
        if run is not None and (first_layer != 0 or count != entry.num_layers):
            self._runs.end(run)
            return None
        return run

    def _read_header(self, entry: IndexEntry) -> RecordHeader | None:
        """The record header at ``entry``; None where there is none (segment gone, file cut short)."""
        segment = self._segments.get(entry.segment)
        return segment.read_header(entry.offset, self._header_key) if segment is not None else None

    # ---- maintenance -------------------------------------------------------------------

    def flush(self) -> bool:
        """fdatasync the segments written to and the segments directory where a segment file was
        created since, then the index with the deletes still to be committed and its log; whether
        all of it succeeded. A failure is logged and counted as an io_error, never raised: I/O
        failure of the tier is no caller's error, and a store closes its tiers after flushing them.
        Once an fsync failed no later flush says True until the tier is reopened: the kernel may
        have dropped the pages it could not write, and a later fsync reports nothing of them."""
        with self._lock:
            if self._closed:
                return False
            try:
                self._sync_files()
                if self._unindexed or self._holes or self._db is None:
                    self._commit_and_punch({})
                try:
                    self._db.flush_wal(True)
                except Exception:
                    self._drop_index()
                    raise
            except Exception as exc:  # OSError from a segment, rocksdict raises plain Exception
                self._count("io_errors", 1)
                log.error("disk tier %s: flush failed (%s); what was written since the last flush may not "
                          "survive a crash", self.path, exc)
                return False
            return not self._sync_failed

    def _sync_files(self) -> None:
        """fdatasync the dirty segments, then the segments directory if it changed. Caller holds ``_lock``."""
        try:
            for segment in self._segments.values():
                if segment.dirty:
                    os.fdatasync(segment.fd)
                    segment.dirty = False
            if self._unsynced_directory:
                fsync_directory(self._segments_dir)
                self._unsynced_directory = False
        except OSError:
            if not self._sync_failed:
                log.error("disk tier %s: an fsync failed; no flush says durable until the tier is reopened", self.path)
            self._sync_failed = True
            raise

    def drop_page_cache(self) -> None:
        """Flush, then ask the kernel to drop these segments' cached pages (for cold-read tests)."""
        self.flush()
        for segment in list(self._segments.values()):
            os.posix_fadvise(segment.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def allocated_bytes(self) -> int:
        """Bytes the file system really holds for the segments (holes excluded)."""
        return sum(os.fstat(s.fd).st_blocks * 512 for s in list(self._segments.values()))

    def stats(self) -> TierStats:
        with self._counters_lock:
            counters = dict(self._counters)
        return TierStats(
            name=self.name,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes,
            blocks=len(self._index),
            bytes_read=counters.pop("bytes_read"),
            bytes_written=counters.pop("bytes_written"),
            checksum_failures=counters.pop("checksum_failures"),
            io_errors=counters.pop("io_errors"),
            extra={"segments": len(self._segments), "path": self.path, **counters},
        )

    def close(self) -> None:
        """Flush, then close everything and let the directory go, whatever failed on the way."""
        with self._lock:
            if self._closed:
                return
            try:
                self.flush()
                if self._unindexed:
                    log.error("disk tier %s: %d removed blocks are still in the index (it could not be written); "
                              "after a restart each comes back intact or, where its bytes were freed already, "
                              "fails verification as a miss", self.path, len(self._unindexed))
                self._runs.close()
                if self._writer is not None:
                    self._writer.shutdown()
            finally:
                self._closed = True
                self._drop_index()
                with self._books:
                    self._segments.clear()
                self._active = None
                self._dir_lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed(f"disk tier at {self.path} is closed")
