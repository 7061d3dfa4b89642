"""Ceilings the benchmark compares the store with, measured in the same run on the same machine.

- memcpy: ``numpy.copyto`` of the same per-block sizes between distinct buffers;
- disk: ``dd``-style sequential O_DIRECT reads and writes of one file (4 MiB requests, fsync at the
  end of the write) on the same file system as the disk tier;
- hashing: vLLM's default prefix hash, ``sha256(pickle((parent, tuple(tokens), extra)))`` per block.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import pickle
import time

import numpy as np

DIRECT_REQUEST = 4 << 20


def memcpy_seconds(sources: list[np.ndarray], dsts: list[np.ndarray]) -> float:
    start = time.perf_counter()
    for src, dst in zip(sources, dsts):
        np.copyto(dst, src)
    return time.perf_counter() - start


def direct_bytes(total_bytes: int) -> int:
    """The bytes the O_DIRECT ceilings move for ``total_bytes``: whole 4 MiB requests."""
    return max(DIRECT_REQUEST, total_bytes // DIRECT_REQUEST * DIRECT_REQUEST)


def _aligned_buffer(nbytes: int) -> mmap.mmap:
    buf = mmap.mmap(-1, nbytes)  # anonymous maps are page aligned, as O_DIRECT needs
    np.frombuffer(buf, np.uint8)[:] = np.random.default_rng(7).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


def direct_write_seconds(path: str, total_bytes: int) -> float:
    """Sequential O_DIRECT write of ``total_bytes`` (rounded down to 4 MiB requests) plus fsync."""
    buf = _aligned_buffer(DIRECT_REQUEST)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    try:
        start = time.perf_counter()
        for offset in range(0, direct_bytes(total_bytes), DIRECT_REQUEST):
            os.pwritev(fd, [buf], offset)
        os.fsync(fd)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        buf.close()


def direct_read_seconds(path: str, total_bytes: int) -> float:
    """Sequential O_DIRECT read of ``direct_bytes(total_bytes)`` of ``path`` (bypasses the page cache)."""
    buf = _aligned_buffer(DIRECT_REQUEST)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        start = time.perf_counter()
        for offset in range(0, direct_bytes(total_bytes), DIRECT_REQUEST):
            os.preadv(fd, [buf], offset)
        return time.perf_counter() - start
    finally:
        os.close(fd)
        buf.close()


def sha256_pickle_seconds(tokens: list[int], block_size: int) -> float:
    """vLLM-style chained sha256 of pickled (parent, tokens, extra) over every full block."""
    start = time.perf_counter()
    parent = hashlib.sha256(pickle.dumps("vllm-none-hash")).digest()
    for i in range(len(tokens) // block_size):
        parent = hashlib.sha256(pickle.dumps((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None))).digest()
    return time.perf_counter() - start
