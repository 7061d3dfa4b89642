"""The disk tier's removals and reservations: the books at once, the I/O later.

``reserve`` counts a record about to be written as used (``Tier.reserve``); the write takes it.

``discard`` (what the store calls under its lock) only updates the books under ``_books``, a lock
never held through I/O: the record's index entry goes, its footprint stops counting against the
capacity, and its key and byte range join the work left to reclaim. ``_commit_and_punch``, run by
the next ``write`` (with its own index entry), ``reclaim`` or flush, commits the index deletes and
only then punches the records out and deletes segments left with nothing live, so a punched
record is never still indexed (unless the index write failed: then it fails verification, a
miss). A process killed in between finds a discarded record intact and indexed at its next open:
a block with the right bytes, back from eviction. ``remove`` is ``discard`` then ``reclaim``.

On a file system that cannot punch holes (``_probe_punching`` at open) a discarded record's
bytes count as dead until its whole segment goes; a segment left with nothing live stops
counting at once (it is deleted at the next reclaim), as before the split into books and I/O.
Its header page is overwritten with zeros instead (``_invalidate``), so an index rebuild finds
no removed block (a deleted namespace's, say) to bring back. A process killed between the index
delete and that write leaves the record whole until the next open zeroes it (recovery frees what
no live record covers); a rebuild before that (the index lost as well) may bring the block back
with its own bytes, and never in place of a newer record of the same key (sequence numbers only
grow).

``DiskReclaim`` is part of ``DiskTier`` (kept apart to keep each file to one concern). It expects
the host class to provide ``path``, ``_lock``, ``_books``, ``_index``, ``_segments``, ``_active``,
``_unindexed``, ``_holes``, ``_punches``, ``_reservations``, ``_closed``, ``_segments_dir``,
``capacity_bytes``, ``_used_bytes``, ``_commit``, ``_count`` and ``_check_open``.
"""

from __future__ import annotations

import logging
import os

from kvstore.buffers import aligned_empty
from kvstore.tiers.direct_io import ALIGN, pwritev_all
from kvstore.tiers.disk_files import IndexEntry, SegmentFile
from kvstore.tiers.segment import HEADER_BYTES, footprint, punch_hole

log = logging.getLogger("kvstore.tiers.disk")

_ZERO_HEADER = aligned_empty(HEADER_BYTES, ALIGN)  # [HEADER_BYTES] uint8, page-aligned for O_DIRECT
_ZERO_HEADER[:] = 0


class DiskReclaim:
    def reserve(self, key: bytes, nbytes: int) -> bool:
        """Count ``key``'s record as written from now on (``Tier.reserve``); only the books."""
        size = footprint(nbytes)
        with self._books:
            self._check_open()
            assert key not in self._index and key not in self._reservations, "duplicate disk reservation (store bug)"
            if self._used_bytes() + size > self.capacity_bytes:
                return False
            self._reservations[key] = size
            return True

    def unreserve(self, key: bytes) -> None:
        with self._books:
            self._reservations.pop(key, None)

    def remove(self, key: bytes) -> bool:
        found = self.discard(key)
        self.reclaim()
        return found

    def _remove_record(self, key: bytes, entry: IndexEntry) -> None:
        """``remove`` ``key`` if ``entry`` is still its record: a read that failed on ``entry`` must
        not drop the new record of the key that another thread wrote meanwhile."""
        if self._discard(key, entry):
            self.reclaim()

    def discard(self, key: bytes) -> bool:
        """Forget ``key`` in the books only (see the module docstring)."""
        return self._discard(key, None)

    def _discard(self, key: bytes, expected: IndexEntry | None) -> bool:
        """``discard``, only where ``key``'s entry is ``expected`` (None: whichever it is)."""
        with self._books:
            self._check_open()
            entry = self._index.get(key)
            if entry is None or (expected is not None and entry != expected):
                return False
            del self._index[key]
            size = footprint(entry.nbytes)
            segment = self._segments[entry.segment]
            self._unindexed.add(key)
            segment.live_bytes -= size
            if segment.live_bytes == 0 and segment is not self._active:
                segment.dead_bytes = 0  # the whole file goes at the next reclaim: none of it counts
            elif not self._punches:  # no hole to punch: the bytes count until the segment goes
                segment.dead_bytes += size
            self._holes.append((entry.segment, entry.offset, size if self._punches else 0))
            return True

    def reclaim(self) -> None:
        """Commit the index deletes of discarded blocks, then punch their records out and delete
        segments left with no live record. A failed index write is logged and counted, retried
        with the next one; the holes are punched all the same."""
        with self._lock:
            if self._closed or not (self._unindexed or self._holes):
                return
            try:
                self._commit_and_punch({})
            except Exception as exc:  # rocksdict raises plain Exception; kept in _unindexed
                self._count("io_errors", 1)
                log.error("disk tier %s: index delete failed (%s); retried with the next index write", self.path, exc)

    def _commit_and_punch(self, puts: dict[bytes, bytes]) -> None:
        """``_commit`` ``puts`` with the deletes pending, then punch the records discarded before
        it (after it even when it raised: a delete that did not reach the index leaves an entry
        that fails verification, a miss). Caller holds ``_lock``."""
        with self._books:
            holes, self._holes = self._holes, []
        try:
            self._commit(puts)
        finally:
            self._punch(holes)

    def _punch(self, holes: list[tuple[int, int, int]]) -> None:
        """Give discarded records' bytes back: delete a segment with nothing live left (but the
        active one), punch a hole elsewhere (a hole of size 0 was counted dead at discard, where
        no hole can be punched); a record not punched out is invalidated. Caller holds ``_lock``."""
        for segment_id, offset, size in holes:
            segment = self._segments.get(segment_id)
            if segment is None:  # deleted with an earlier hole of this batch
                continue
            try:
                if segment.live_bytes == 0 and segment is not self._active:
                    self._delete_segment(segment)
                    continue
                punched = bool(size) and punch_hole(segment.fd, offset, size)
            except OSError as exc:
                self._count("io_errors", 1)
                log.error("disk tier %s: freeing a removed record failed (%s); its bytes keep counting", self.path, exc)
                punched = False
            if not punched:
                self._invalidate(segment, offset)
            if size and not punched:
                with self._books:  # unless a discard meanwhile left it nothing live: it goes whole
                    if segment.live_bytes or segment is self._active:
                        segment.dead_bytes += size

    def _invalidate(self, segment: SegmentFile, offset: int) -> None:
        """Overwrite the header page of the removed record at ``offset`` with zeros, so no index
        rebuild takes it for a block (its index entry is deleted already). Not synced: a crash
        may undo it, as it may undo the delete (see the module docstring). Caller holds ``_lock``."""
        try:
            pwritev_all(segment.fd, [_ZERO_HEADER], offset)
        except OSError as exc:
            self._count("io_errors", 1)
            log.error("disk tier %s: invalidating a removed record failed (%s); an index rebuild may find "
                      "it again", self.path, exc)

    def _delete_segment(self, segment: SegmentFile) -> None:
        with self._books:
            del self._segments[segment.id]
        try:
            os.unlink(segment.path)
        except FileNotFoundError:
            pass

    def _probe_punching(self) -> bool:
        """Whether this file system punches holes: tried once on a scratch file at open."""
        probe = os.path.join(self._segments_dir, ".punch-probe")
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, bytes(8192), 0)
            return punch_hole(fd, 0, 4096)
        except OSError:
            return False
        finally:
            os.close(fd)
            os.unlink(probe)
