"""The disk tier's recovery. On open: read the whole index (an index found corrupt is set aside and
rebuilt, before anything acts on it), read the header key (made where there is none: then no record
already there can be authenticated, and an index of them is set aside), drop entries whose bytes
are gone, cut the active segment back to its committed tail, delete segments nothing was committed
to, rebuild a missing index from the segment headers, and free bytes no live record covers. While
open: reopen the index after a write to it failed (``_commit``); check the books against the files
(``check_integrity``).

``DiskRecovery`` is half of ``DiskTier`` (kept apart to keep each file to one concern). It expects
the host class to provide ``path``, ``direct_io``, ``_segments_dir``, ``_index_dir``, ``_db``,
``_unindexed``, ``_books``, ``_write_opt``, ``_index``, ``_segments``, ``_active``, ``_tail``, ``_seq``,
``_counters``, ``_progress``, ``_lock``, ``used_bytes``, ``capacity_bytes``, ``_count``, ``_invalidate``
and ``_delete_segment``; it sets ``_header_key``. ``_recover`` runs once, at open, before the tier
serves anything; ``_commit`` with the tier's lock held.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import resource

from rocksdict import WriteBatch

from kvstore.errors import InvalidRequest
from kvstore.tiers.base import KEY_BYTES
from kvstore.tiers.disk_files import (
    BLOCK_KEY_PREFIX, FORMAT_KEY, FORMAT_VERSION, HEADER_KEY_CHECK, HEADER_KEY_FILE, TAIL_KEY, TAIL_VALUE,
    CorruptIndex, SegmentFile, StoredIndex, _index_error, newest_records, open_header_key, open_index, read_index,
    segment_name, set_aside,
)
from kvstore.tiers.segment import HEADER_BYTES, MAGIC, PAGE, RecordHeader, footprint, punch_hole

log = logging.getLogger("kvstore.tiers.disk")

_SCAN_BYTES = 1 << 20  # read at a time when looking for record headers among bytes no record covers


class DiskRecovery:
    def _segment_ids_on_disk(self) -> list[int]:
        ids = []
        for name in os.listdir(self._segments_dir):
            if name.endswith(".seg") and name[:-4].isdigit():
                ids.append(int(name[:-4]))
        return sorted(ids)

    def _recover(self) -> None:
        on_disk = self._segment_ids_on_disk()
        stored = self._read_index()
        self._header_key, created = open_header_key(self.path)
        if created and on_disk:  # no header of these segments can be authenticated: garbage, all of it
            log.warning("disk tier %s: no header key (%s) beside %d segment files; their records cannot be "
                        "told from forgeries and are reclaimed as garbage", self.path, HEADER_KEY_FILE, len(on_disk))
        if stored.stamp is not None and stored.key_check != self._header_key.fingerprint():
            # written under another key (the file lost, then a crash before this replacement; or
            # copied in): not one entry would verify, and its bytes would never be reclaimed
            self._counters["recovered_lost_blocks"] += len(stored.entries)
            stored = self._replace_index(f"its entries were written under another header key than {HEADER_KEY_FILE}")
        if stored.stamp is None:  # a new index, or one lost or set aside: the segments are the truth
            if on_disk:
                self._rebuild_index(on_disk)
            self._write_index(lambda: self._db.write(self._stamp()))
            stored = read_index(self._db, self._index_dir)
        self._load_index(stored, on_disk)
        self._reclaim_uncovered()

    def _read_index(self) -> StoredIndex:
        """The whole index, checked to be in this kvstore's format. An index a read finds corrupt
        (a block failing its checksum) is closed, set aside and replaced by an empty one, which
        reads as unstamped (to be rebuilt): an index read short must not pass for the truth, or
        the records it no longer lists would be freed as garbage. An index of another format
        version is refused (``InvalidRequest``, nothing changed), unless it lists no block: then it
        reads as unstamped, and the tier is rebuilt as this version's."""
        try:
            stored = read_index(self._db, self._index_dir)
        except CorruptIndex as exc:
            return self._replace_index(str(exc))
        if stored.stamp is None or stored.stamp == FORMAT_VERSION:
            return stored
        other = stored.stamp.decode(errors="replace")
        if not stored.entries:  # another version's, holding no block: nothing to lose, taken over
            log.warning("disk tier %s: an empty tier of format %r; taken over as %r", self.path, other,
                        FORMAT_VERSION.decode())
            return dataclasses.replace(stored, stamp=None)  # rebuilt: whatever its segments hold is garbage here
        raise InvalidRequest(f"disk tier {self.path} holds format {other!r}, and this kvstore reads "
                             f"{FORMAT_VERSION.decode()!r}; left as it is: open it with the kvstore that wrote it, "
                             "give this one another directory, or delete it to start over (a cache: its blocks "
                             "are computed again)")

    def _stamp(self) -> WriteBatch:
        """What says the index is this version's, and under which header key its entries are."""
        batch = WriteBatch(raw_mode=True)
        batch.put(FORMAT_KEY, FORMAT_VERSION)
        batch.put(HEADER_KEY_CHECK, self._header_key.fingerprint())
        return batch

    def _replace_index(self, reason: str) -> StoredIndex:
        """Close the index, set it aside (``reason`` says why it cannot be used), and read the
        empty one opened in its place: unstamped, so the segments are the truth."""
        self._drop_index()
        set_aside(self._index_dir, reason)
        self._db = open_index(self._index_dir)
        return read_index(self._db, self._index_dir)

    def _load_index(self, stored: StoredIndex, on_disk: list[int]) -> None:
        sizes = {i: os.path.getsize(os.path.join(self._segments_dir, segment_name(i))) for i in on_disk}
        tail_segment, tail_offset = stored.tail or (0, 0)
        # Sequence numbers never go back, even past removed blocks: where a removed record's bytes
        # stay (no hole punching), a rebuild must still prefer a newer record of the same key.
        self._seq = stored.next_seq or 0
        lost, dropped = WriteBatch(raw_mode=True), 0
        for key, entry in stored.entries.items():
            beyond_tail = (entry.segment, entry.offset) >= (tail_segment, tail_offset)
            beyond_eof = entry.offset + footprint(entry.nbytes) > sizes.get(entry.segment, -1)
            if beyond_tail or beyond_eof:  # segment missing or cut short
                lost.delete(BLOCK_KEY_PREFIX + key)
                dropped += 1
                continue
            self._index[key] = entry
            self._seq = max(self._seq, entry.seq + 1)
        if dropped:
            self._counters["recovered_lost_blocks"] += dropped
            log.warning("disk tier %s: %d index entries pointed at missing or truncated segments; dropped",
                        self.path, dropped)
            self._write_index(lambda: self._db.write(lost))
        for segment_id in on_disk:
            if segment_id > tail_segment:  # created, but nothing in it was ever committed
                os.unlink(os.path.join(self._segments_dir, segment_name(segment_id)))
                continue
            self._segments[segment_id] = self._open_segment(segment_id, len(on_disk))
        for entry in self._index.values():
            self._segments[entry.segment].live_bytes += footprint(entry.nbytes)
        if tail_segment in self._segments:
            self._active = self._segments[tail_segment]
            size = os.fstat(self._active.fd).st_size
            if size > tail_offset:  # a record was being written when the process died
                os.ftruncate(self._active.fd, tail_offset)
                self._counters["recovered_truncated_bytes"] += size - tail_offset
            elif size < tail_offset:  # cut short behind our back: keep appends after every committed record
                os.ftruncate(self._active.fd, tail_offset)
            self._tail = tail_offset

    def _open_segment(self, segment_id: int, count: int) -> SegmentFile:
        """Segment ``segment_id`` of ``count``; running out of descriptors says what to change."""
        try:
            return SegmentFile(segment_id, os.path.join(self._segments_dir, segment_name(segment_id)), self.direct_io)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            limit = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            raise OSError(exc.errno, f"disk tier {self.path} has {count} segment files and keeps one descriptor "
                                     f"open per file, more than this process may open ({exc.strerror}; hard "
                                     f"RLIMIT_NOFILE {limit}): raise the limit (ulimit -Hn, systemd LimitNOFILE) "
                                     f"or use larger segments") from exc

    def _rebuild_index(self, on_disk: list[int]) -> None:
        """Recreate the index from segment headers, verifying every payload."""
        self._counters["index_rebuilds"] += 1
        total = sum(os.path.getsize(os.path.join(self._segments_dir, segment_name(i))) for i in on_disk)
        advance = self._progress("rebuilding disk index", total) if self._progress else None
        log.warning("disk tier %s: no index, rebuilding from %d segments (%d bytes)", self.path, len(on_disk), total)
        best, tail = newest_records(self._segments_dir, on_disk, self._header_key, advance)
        batch = WriteBatch(raw_mode=True)
        for key, entry in best.items():
            batch.put(BLOCK_KEY_PREFIX + key, entry.encode())
        batch.put(TAIL_KEY, TAIL_VALUE.pack(*tail))
        self._write_index(lambda: self._db.write(batch))

    def _write_index(self, write) -> None:
        """``write()`` to the index while recovering. A failure whose cause RocksDB names outside the
        index (no space left, say) raises ``OSError`` saying so and what to do; until session 34 it
        was rocksdict's plain ``Exception``, a traceback. What the write would have done is left
        undone, and the next open does it again (an index not yet stamped is rebuilt again)."""
        try:
            write()
        except Exception as exc:
            error = _index_error(self._index_dir, "written", exc)
            if isinstance(error, OSError):
                raise error from exc
            raise

    def _reclaim_uncovered(self) -> None:
        """Free every byte range of every segment that no live record covers (``_free_uncovered``);
        delete a segment with no live record (but the active one)."""
        covered: dict[int, list[tuple[int, int]]] = {sid: [] for sid in self._segments}
        for entry in self._index.values():
            covered[entry.segment].append((entry.offset, entry.offset + footprint(entry.nbytes)))
        for segment_id, segment in list(self._segments.items()):
            if not covered[segment_id] and segment is not self._active:
                self._delete_segment(segment)
                continue
            cursor = 0
            end_of_file = os.fstat(segment.fd).st_size
            for start, end in sorted(covered[segment_id]) + [(end_of_file, end_of_file)]:
                if start > cursor:
                    self._free_uncovered(segment, cursor, start)
                cursor = max(cursor, end)

    def _free_uncovered(self, segment: SegmentFile, start: int, end: int) -> None:
        """Punch ``[start, end)`` of ``segment``, bytes no live record covers, out. Where no hole
        can be punched (the file system has none, or the punch failed: logged and counted) the
        bytes count as dead and every record header among them is zeroed, as ``_punch`` does while
        open: a record whose index delete was committed just before a crash would otherwise come
        back at the next rebuild (a deleted namespace's block, say). Finding the headers reads the
        bytes: without hole punching, every dead byte at every open."""
        try:
            if punch_hole(segment.fd, start, end - start):
                return
        except OSError as exc:
            self._count("io_errors", 1)
            log.error("disk tier %s: freeing unreferenced bytes of segment %d failed (%s); they keep counting",
                      self.path, segment.id, exc)
        segment.dead_bytes += end - start
        for offset in self._record_headers(segment, start, end):
            self._invalidate(segment, offset)

    def _record_headers(self, segment: SegmentFile, start: int, end: int) -> list[int]:
        """Offsets of the valid record headers in ``[start, end)`` of ``segment``, read
        ``_SCAN_BYTES`` at a time. Every page is looked at (a zeroed header leaves no length to
        skip its record by). A read that fails ends the search, logged and counted."""
        found = []
        offset = start
        try:
            while offset + HEADER_BYTES <= end:
                span = segment.read(offset, min(_SCAN_BYTES, end - offset))
                at = 0
                while at + HEADER_BYTES <= len(span):
                    page = span[at : at + HEADER_BYTES]
                    header = RecordHeader.decode(page, self._header_key) if bytes(page[: len(MAGIC)]) == MAGIC else None
                    if header is not None:
                        found.append(offset + at)
                    at += footprint(header.nbytes) if header is not None else PAGE
                if at == 0:  # the file ends before ``end``
                    break
                offset += at
        except OSError as exc:
            self._count("io_errors", 1)
            log.error("disk tier %s: looking for removed records in segment %d failed (%s); an index rebuild "
                      "may find them again", self.path, segment.id, exc)
        return found

    # ---- while open: the index after a failed write ----------------------------------------

    def _commit(self, puts: dict[bytes, bytes]) -> None:
        """Write ``puts`` to the index in one batch, after the deletes of removed blocks that have
        not reached it yet (deletes first: a block removed and written again ends up present).
        Raises what the index raises, and then closes it: RocksDB keeps a failed write-ahead-log
        append (ENOSPC) as a background error that fails every later write, delete and flush until
        the DB is opened again, so the next commit reopens it (measured: once space is freed, the
        reopened index takes writes, and keeps every entry committed before)."""
        with self._books:
            deletes = list(self._unindexed)
        batch = WriteBatch(raw_mode=True)
        for key in deletes:
            batch.delete(BLOCK_KEY_PREFIX + key)
        for key, value in puts.items():
            batch.put(key, value)
        try:
            if self._db is None:
                self._db = open_index(self._index_dir)
            self._db.write(batch, write_opt=self._write_opt)
        except Exception:
            self._drop_index()
            raise
        with self._books:
            self._unindexed.difference_update(deletes)

    def _drop_index(self) -> None:
        """Close the index, ignoring its error (after a failure, closing reports that failure again)."""
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except Exception:
                pass

    def check_integrity(self) -> None:
        with self._lock:
            with self._books:  # the books alone: a discard never waits for the file checks below
                live: dict[int, int] = {sid: 0 for sid in self._segments}
                for key, entry in self._index.items():
                    assert len(key) == KEY_BYTES, "malformed key in the disk index"
                    assert entry.segment in self._segments, f"entry points at missing segment {entry.segment}"
                    live[entry.segment] += footprint(entry.nbytes)
                for sid, segment in self._segments.items():
                    assert live[sid] == segment.live_bytes, f"segment {sid}: live bytes disagree with the index"
                segments = list(self._segments.values())
            for segment in segments:
                assert os.path.exists(segment.path), f"segment file {segment.path} vanished"
            assert self.used_bytes <= self.capacity_bytes, "disk tier over capacity"
            if self._active is not None:
                assert os.fstat(self._active.fd).st_size == self._tail, "active segment longer than its tail"
