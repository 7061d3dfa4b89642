"""Keep transfer-sized buffers in the heap instead of returning them to the kernel after each use.

Every Get and Put moves payloads through buffers of a few MiB: the message ``bytes``, gRPC's
slices and socket read buffers, the Get staging arrays. glibc serves allocations above its mmap
threshold (128 KiB at first, adapting up to 32 MiB) with fresh mappings and trims the free top of
its heaps above the trim threshold, so each transfer's buffers come back as new pages that the
kernel must fault in and zero: on loopback that costs about as much CPU as a copy of the payload,
on both ends. Pinning both thresholds keeps those pages for the next transfer (memory a transfer
freed stays in the process, up to the trim threshold, instead of going back to the kernel).

The sidecar sets them at start and every ``KVStoreClient`` in its process, so an engine that
uses the client keeps up to 1 GiB of freed heap too. ``KVSTORE_KEEP_HEAP=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import os
import sys

from kvstore.config import parse_bool, read_setting

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's own ceiling for its adaptive threshold
TRIM_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h


def keep_heap_for_transfers() -> bool:
    """Set glibc's mmap and trim thresholds (idempotent); False where libc is not glibc or
    ``KVSTORE_KEEP_HEAP=0``. A value that is no boolean (``maybe``) raises ``InvalidRequest``
    naming the variable (it counted as on)."""
    if "KVSTORE_KEEP_HEAP" in os.environ and not read_setting(os.environ, "KVSTORE_KEEP_HEAP", parse_bool):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl has no mallopt
        return False
    mmap_set = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    return mmap_set and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
