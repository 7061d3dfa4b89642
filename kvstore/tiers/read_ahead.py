"""O_DIRECT read-ahead over a run of disk records, so the device never waits for the CPU.

A multi-block load reads records one after another, and after each read the caller verifies the
checksums and copies the bytes out. Read synchronously, the device idles during that work; the
kernel's readahead, which overlaps it for buffered reads, does nothing for O_DIRECT. A
``ReadAhead`` keeps up to ``depth`` reads in flight on a reader thread, each into its own
page-aligned buffer, in the order the caller will ask for them::

    run = ReadAhead(reader, [Record(key, segment, fd, offset, length), ...], buffers=pool)
    span = run.take(key, segment, offset)   # read while the previous record was being copied
    ...verify, copy out...
    run.done()             # the record's bytes are no longer needed
    run.close()            # waits for reads in flight; unread records are dropped

Records that lie back to back in one file (a chain written in one go) are read together, up to
``span_bytes`` per read: fewer, larger requests, like the ``dd``-style ceiling's, and fewer
hand-offs between the reader thread and the caller (each of which waits for the GIL).

Reads complete in order; ``take`` of a record that is not the next in the run returns None (the
caller reads that one itself). A read error surfaces as the ``OSError`` of ``take``. Buffers
come from a ``SpanBuffers`` pool and belong to the run until it closes: a record's bytes are
valid until its ``done()``. Mechanism only: what to read
ahead is the disk tier's business.
"""

from __future__ import annotations

import collections
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from kvstore.buffers import aligned_empty
from kvstore.tiers.direct_io import read_direct_into

DEFAULT_DEPTH = 3  # buffers: the reader fills the next ones while the caller works through one
DEFAULT_SPAN_BYTES = 16 << 20  # 3 x 16 MiB beat 2 x 8 MiB by 15-20% on cold 1.1 GiB loads here
DEFAULT_KEEP = 2 * DEFAULT_DEPTH  # spare buffers kept between runs: two threads' worth, 96 MiB


class SpanBuffers:
    """Page-aligned read buffers of ``span_bytes``, kept between runs and shared by threads.

    A fresh anonymous mapping is page-faulted on its first read, and on this machine's VM the
    three faulted-in buffers of one run cost 55-80 ms each, about 0.2 s of a 1.1 GiB load that
    otherwise takes 0.4-1 s. So a run takes its buffers from here and gives them back when it
    closes; at most ``keep`` spare buffers are kept (the rest are unmapped). A run needing a
    larger buffer (one record over ``span_bytes``) gets a one-off one. Thread-safe. Disk tiers
    share ``SHARED_BUFFERS``, so a process holds at most ``keep`` spares however many tiers it opens.
    """

    def __init__(self, span_bytes: int = DEFAULT_SPAN_BYTES, keep: int = DEFAULT_KEEP):
        self.span_bytes = span_bytes
        self._keep = keep
        self._spare: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A page-aligned buffer of at least ``nbytes`` (its contents are arbitrary)."""
        if nbytes > self.span_bytes:
            return aligned_empty(nbytes)
        with self._lock:
            if self._spare:
                return self._spare.pop()
        return aligned_empty(self.span_bytes)

    def give(self, buffer: np.ndarray) -> None:
        """Return a buffer from ``take``; no read may be writing into it any more."""
        with self._lock:
            if buffer.nbytes == self.span_bytes and len(self._spare) < self._keep:
                self._spare.append(buffer)

    def spare(self) -> int:
        with self._lock:
            return len(self._spare)

    def clear(self) -> None:
        """Unmap the spare buffers (buffers still taken are unaffected)."""
        with self._lock:
            self._spare.clear()


class Record(NamedTuple):
    key: bytes
    segment: int  # the segment's id: with ``offset``, which record this is
    fd: int  # an O_DIRECT descriptor that stays open for the run (its segment is referenced)
    offset: int  # ALIGN-aligned
    length: int  # ALIGN-aligned


@dataclass
class _Span:
    """Adjacent records of one file, read with one request into ``buffer``."""

    records: list[Record]
    buffer: np.ndarray | None = None
    future: Future | None = None
    next: int = 0  # records[next] is the next one to take

    @property
    def nbytes(self) -> int:
        return self.records[-1].offset + self.records[-1].length - self.records[0].offset


SHARED_BUFFERS = SpanBuffers()


class ReadAhead:
    def __init__(self, reader: ThreadPoolExecutor, records: list[Record], depth: int = DEFAULT_DEPTH,
                 owners: tuple = (), buffers: SpanBuffers | None = None):
        """Start reading the first ``depth`` spans of ``records`` into buffers from ``buffers``
        (default: ``SHARED_BUFFERS``). ``owners`` are kept referenced until ``close`` (the segments
        whose descriptors the records name)."""
        self._reader = reader
        self._buffers = buffers if buffers is not None else SHARED_BUFFERS
        self._pending = collections.deque(_spans(records, self._buffers.span_bytes))
        self._owners = owners
        size = max((s.nbytes for s in self._pending), default=0)
        self._free = [self._buffers.take(size) for _ in range(min(depth, len(self._pending)))]
        self._inflight: collections.deque[_Span] = collections.deque()
        self._taken = False
        self._lock = threading.Lock()  # the owning thread's calls against ``abandon`` from another
        self._fill()

    def exhausted(self) -> bool:
        with self._lock:
            return not self._inflight and not self._pending

    def take(self, key: bytes, segment: int, offset: int) -> np.ndarray | None:
        """The bytes of ``key``'s record at ``segment``, ``offset`` (a view, valid until ``done``)
        when it is the next in the run, else None. Raises the read's OSError; a short read gives a
        shorter view."""
        with self._lock:
            if self._taken or not self._inflight:
                return None
            span = self._inflight[0]
            record = span.records[span.next]
            if (record.key, record.segment, record.offset) != (key, segment, offset):
                return None
            self._taken = True  # from here ``abandon`` leaves this span's read and buffer alone
        got = span.future.result()
        start = record.offset - span.records[0].offset
        return span.buffer[start : min(start + record.length, max(got, start))]

    def done(self) -> None:
        """The record from the last ``take`` is no longer used; a span whose records are all done
        gives its buffer to the next read."""
        with self._lock:
            if not self._taken:
                return
            self._taken = False
            if not self._inflight:  # abandoned meanwhile: nothing more is read
                return
            span = self._inflight[0]
            span.next += 1
            if span.next == len(span.records):
                self._inflight.popleft()
                self._free.append(span.buffer)
                self._fill()

    def close(self) -> None:
        """Stop: wait for the reads in flight (their buffers are being written), drop the rest and
        give every buffer back. Views from ``take`` are invalid afterwards. The owning thread's call."""
        with self._lock:
            self._pending.clear()
            for span in self._inflight:
                if not span.future.cancel():
                    _wait(span.future)
                self._free.append(span.buffer)
            self._inflight.clear()
            for buffer in self._free:
                self._buffers.give(buffer)
            self._free.clear()
            self._taken = False
            self._owners = ()

    def abandon(self) -> None:
        """Stop the run from another thread (its tier is closing): read nothing more, wait for the
        reads in flight, let the segments go. Its buffers are dropped, never given back to the pool:
        the owning thread may still be verifying or copying a view of one, and a buffer another run
        took and read into meanwhile would change those bytes under it. The owning thread's next
        ``take`` returns None, its ``done`` does nothing."""
        with self._lock:
            self._pending.clear()
            for span in self._inflight:
                _wait(span.future)  # never cancelled: the owning thread may be waiting for it in ``take``
            self._inflight.clear()
            self._free.clear()
            self._owners = ()

    def _fill(self) -> None:
        """Submit the next spans into the free buffers; caller holds ``_lock``."""
        while self._free and self._pending:
            span = self._pending.popleft()
            span.buffer = self._free.pop()
            first = span.records[0]
            span.future = self._reader.submit(read_direct_into, first.fd, first.offset, span.buffer[: span.nbytes])
            self._inflight.append(span)


def _wait(future: Future) -> None:
    """Wait for a read; its failure is the reading thread's to report (``take``), not this one's."""
    try:
        future.result()
    except OSError:
        pass


def _spans(records: list[Record], span_bytes: int) -> list[_Span]:
    """``records`` in order, grouped into runs that lie back to back in one file, each at most
    ``span_bytes`` (or one record, if larger)."""
    spans: list[_Span] = []
    for record in records:
        last = spans[-1].records[-1] if spans else None
        if (last is not None and last.fd == record.fd and last.offset + last.length == record.offset
                and spans[-1].nbytes + record.length <= span_bytes):
            spans[-1].records.append(record)
        else:
            spans.append(_Span([record]))
    return spans


class ThreadRuns:
    """Each loading thread's current ``ReadAhead``, and the one reader thread they share.

    ``close`` abandons every run still open, whichever thread holds it, before it stops the reader:
    until session 35 a run left open by an idle thread kept its segments' descriptors open after the
    tier closed, and a load racing the close failed with ``RuntimeError`` (a read submitted to a
    stopped reader). After ``close`` no run starts; loads read record by record."""

    def __init__(self, thread_name: str = "kvstore-disk-read"):
        self._local = threading.local()
        self._reader: ThreadPoolExecutor | None = None
        self.buffers = SHARED_BUFFERS
        self._lock = threading.Lock()  # the reader, the open runs and whether closed
        self._open: weakref.WeakSet[ReadAhead] = weakref.WeakSet()  # a dead thread's run goes with it
        self._closed = False
        self._thread_name = thread_name

    def current(self) -> ReadAhead | None:
        return getattr(self._local, "run", None)

    def start(self, records: list[Record], owners: tuple = ()) -> None:
        """This thread's run becomes one over ``records`` (none for fewer than two, or once closed)."""
        self.end(self.current())
        if len(records) < 2:
            return
        with self._lock:  # held while the first reads are submitted: ``close`` cannot stop the reader under them
            if self._closed:
                return
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix=self._thread_name)
            run = ReadAhead(self._reader, records, owners=owners, buffers=self.buffers)
            self._open.add(run)
        self._local.run = run

    def end(self, run: ReadAhead | None) -> None:
        """Close ``run``; if it is this thread's, the thread has none after."""
        if run is not None:
            run.close()
            with self._lock:
                self._open.discard(run)
            if self.current() is run:
                self._local.run = None

    def close(self) -> None:
        """Abandon every open run (``ReadAhead.abandon``), then stop the reader thread."""
        with self._lock:
            self._closed = True
            runs = list(self._open)
            self._open.clear()
        for run in runs:
            run.abandon()
        if self._reader is not None:
            self._reader.shutdown(wait=True)
