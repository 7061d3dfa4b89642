"""O_DIRECT read-ahead over a run of disk records, so the device never waits for the CPU.

A multi-block load reads records one after another, and after each read the caller verifies the
checksums and copies the bytes out. Read synchronously, the device idles during that work; the
kernel's readahead, which overlaps it for buffered reads, does nothing for O_DIRECT. A
``ReadAhead`` keeps up to ``depth`` record reads in flight on a reader thread, each into its own
page-aligned buffer, in the order the caller will ask for them::

    run = ReadAhead(reader, [Record(key, segment, fd, offset, length), ...], depth=2)
    span = run.take(key, segment, offset)   # the next record's bytes, read while the previous one was being copied
    ...verify, copy out...
    run.done()             # its buffer goes to the next read in the run
    run.close()            # waits for reads in flight; unread records are dropped

Reads complete in order; ``take`` of a key that is not the next in the run returns None (the
caller reads that one itself). A read error surfaces as the ``OSError`` of ``take``. Buffers
belong to the run: a span is valid until ``done()``. Mechanism only: what to read ahead is the
disk tier's business.
"""

from __future__ import annotations

import collections
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from kvstore.tiers.direct_io import aligned_buffer, read_direct_into

DEFAULT_DEPTH = 2


class Record(NamedTuple):
    key: bytes
    segment: int  # the segment's id: with ``offset``, which record this is
    fd: int  # an O_DIRECT descriptor that stays open for the run (its segment is referenced)
    offset: int  # ALIGN-aligned
    length: int


class ReadAhead:
    def __init__(self, reader: ThreadPoolExecutor, records: list[Record], depth: int = DEFAULT_DEPTH,
                 owners: tuple = ()):
        """Start reading the first ``depth`` of ``records``. ``owners`` are kept referenced until
        ``close`` (the segments whose descriptors the records name)."""
        self._reader = reader
        self._pending = collections.deque(records)
        self._owners = owners
        size = max((r.length for r in records), default=0)
        self._free = [aligned_buffer(size) for _ in range(min(depth, len(records)))]
        self._inflight: collections.deque[tuple[Record, np.ndarray, Future]] = collections.deque()
        self._taken: np.ndarray | None = None
        self._fill()

    def exhausted(self) -> bool:
        return not self._inflight and not self._pending

    def take(self, key: bytes, segment: int, offset: int) -> np.ndarray | None:
        """The bytes of ``key``'s record at ``segment``, ``offset`` (a view, valid until ``done``)
        when it is the next in the run, else None. Raises the read's OSError; a short read gives a
        shorter span."""
        if self._taken is not None or not self._inflight:
            return None
        record = self._inflight[0][0]
        if (record.key, record.segment, record.offset) != (key, segment, offset):
            return None
        record, buffer, future = self._inflight.popleft()
        self._taken = buffer
        return buffer[: future.result()]

    def done(self) -> None:
        """The span from the last ``take`` is no longer used: read the next record into it."""
        if self._taken is not None:
            self._free.append(self._taken)
            self._taken = None
            self._fill()

    def close(self) -> None:
        """Stop: wait for the reads in flight (their buffers are being written), drop the rest."""
        self._pending.clear()
        for _, _, future in self._inflight:
            if not future.cancel():
                try:
                    future.result()
                except OSError:
                    pass
        self._inflight.clear()
        self._free.clear()
        self._taken = None
        self._owners = ()

    def _fill(self) -> None:
        while self._free and self._pending:
            record, buffer = self._pending.popleft(), self._free.pop()
            span = buffer[: record.length]
            self._inflight.append((record, buffer, self._reader.submit(read_direct_into, record.fd, record.offset, span)))

