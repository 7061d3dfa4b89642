"""The disk tier's files: an index entry's format, one open segment file, and the file-system
helpers the tier uses on them (segment names, O_DIRECT probing, directory fsync, truncation).

Mechanism only: which record goes where, and when, is ``kvstore.tiers.disk``'s business.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from typing import Callable

from kvstore.tiers.direct_io import open_direct
from kvstore.tiers.segment import footprint, scan_segment

_ENTRY = struct.Struct("<IQQIQ32sB")  # segment, offset, nbytes, num_layers, seq, parent, has_parent


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


class SegmentFile:
    """One open segment file. Readers hold a reference while they read, so the descriptor stays
    valid even if the segment is deleted meanwhile (it closes with the last reference)."""

    def __init__(self, segment_id: int, path: str, direct: bool = False, appends: bool = False):
        """``direct``: reads (and with ``appends``, writes) use O_DIRECT descriptors."""
        self.id = segment_id
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # buffered I/O, size, holes, fdatasync
        self.direct_fd = open_direct(path) if direct else None  # None: buffered reads
        self.write_fd = open_direct(path, writable=True) if direct and appends else None  # None: buffered writes
        self.live_bytes = 0
        self.dead_bytes = 0  # removed but not reclaimable (no hole punching)
        self.dirty = False

    def seal(self) -> None:
        """No more appends (no longer the active segment): close the O_DIRECT write descriptor."""
        fd, self.write_fd = self.write_fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        for name in ("fd", "direct_fd", "write_fd"):
            fd = getattr(self, name, None)
            setattr(self, name, None)
            if fd is not None and fd >= 0:
                os.close(fd)


def segment_name(segment_id: int) -> str:
    return f"{segment_id:08d}.seg"


def newest_records(segments_dir: str, segment_ids: list[int], progress: Callable[[int], None] | None = None,
                   ) -> tuple[dict[bytes, IndexEntry], tuple[int, int]]:
    """The index a set of segments implies: for each key its valid record with the highest
    sequence number (payload verified), and the tail (segment, offset) after the last valid record."""
    best: dict[bytes, IndexEntry] = {}
    tail = (0, 0)
    for segment_id in segment_ids:
        for record in scan_segment(os.path.join(segments_dir, segment_name(segment_id)), verify=True,
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
