"""An LMCache object rebuilt from the block the sidecar framed it in: its header checked against
the key's digest and this configuration's geometry, then copied into memory LMCache allocates and
verified there (the copy, not the source: a shared-memory slot may change under the copy)."""

from __future__ import annotations

import numpy as np
from lmcache.v1.memory_management import MemoryObj

from connectors.lmcache import framing
from connectors.lmcache.chunk_meta import ChunkGeometry
from connectors.lmcache.framing import CorruptObject
from kvstore.buffers import byte_view


def rebuild(block: np.ndarray, digest: bytes, geometry: ChunkGeometry, backend) -> MemoryObj | None:
    """A verified copy of the object framed in ``block`` ([block_bytes] uint8) in memory that
    ``backend`` (LMCache's local CPU backend) allocates, holding one reference; None when it has
    no memory now. Raises ``CorruptObject`` when the block is not a valid object of ``digest``
    (nothing stays allocated then)."""
    header = framing.read_header(block, digest)
    shapes, dtypes, fmt = geometry.allocation(header.meta)
    try:
        obj = backend.allocate(shapes, dtypes, fmt, busy_loop=False)
    except Exception as exc:  # LMCache refused the description: as corrupt as a bad checksum
        raise CorruptObject(f"LMCache cannot allocate it: {exc}") from None
    if obj is None:
        return None
    try:
        copy = byte_view(obj.byte_array, writable=True)
        if copy.nbytes != header.nbytes:
            raise CorruptObject(f"its metadata describes {copy.nbytes} bytes, its header {header.nbytes}")
        np.copyto(copy, framing.body(block, header))  # [nbytes] uint8
        framing.verify(copy, header)
    except CorruptObject:
        obj.ref_count_down()
        raise
    return obj
