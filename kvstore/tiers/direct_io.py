"""O_DIRECT reads through page-aligned, per-thread bounce buffers.

O_DIRECT needs the file offset, the length and the memory address aligned (4 KiB here), and
callers' buffers are not. So a read covers the aligned span around the wanted bytes, lands in
this thread's bounce buffer (an anonymous mapping: page-aligned), and the caller gets a view of
just the wanted bytes, valid until its thread's next read. Cold reads then run at the device's
rate with large requests (buffered reads of a cold file go at the speed of the kernel's
readahead window, which on this machine was under half the O_DIRECT rate), and they do not fill
the page cache with bytes the host tier already holds.

File systems without O_DIRECT (tmpfs) make ``open_direct`` return None: callers read buffered.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

import numpy as np

ALIGN = 4096
_local = threading.local()


def open_direct(path: str) -> int | None:
    """A read-only O_DIRECT descriptor for ``path``, or None where O_DIRECT is not supported."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDONLY | flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def _bounce(nbytes: int) -> np.ndarray:
    """This thread's page-aligned scratch of at least ``nbytes`` (grows, never shrinks)."""
    buf = getattr(_local, "buf", None)
    if buf is None or len(buf) < nbytes:
        size = max(nbytes, 8 << 20)
        _local.mapping = mmap.mmap(-1, size)  # anonymous: page-aligned
        buf = _local.buf = np.frombuffer(_local.mapping, np.uint8)
    return buf


def read_direct(fd: int, offset: int, length: int) -> np.ndarray:
    """``[length]`` bytes at ``offset`` (fewer at end of file) as a view of this thread's bounce
    buffer, read with O_DIRECT over the aligned span that covers them."""
    start = offset // ALIGN * ALIGN
    end = -(-(offset + length) // ALIGN) * ALIGN
    span = _bounce(end - start)[: end - start]
    got = os.preadv(fd, [span], start)
    available = max(0, min(got - (offset - start), length))
    return span[offset - start : offset - start + available]


def read_record_direct(fd: int, header_at: int, data_at: int, nbytes: int,
                       header_bytes: int = ALIGN) -> tuple[np.ndarray, np.ndarray]:
    """A record's header page and ``nbytes`` at ``data_at``: one read when they are adjacent (a
    whole block), else two (one layer), the header copied out of the bounce buffer first."""
    if data_at == header_at + header_bytes:
        span = read_direct(fd, header_at, header_bytes + nbytes)
        return span[:header_bytes], span[header_bytes:]
    header_page = read_direct(fd, header_at, header_bytes).copy()
    return header_page, read_direct(fd, data_at, nbytes)
