"""Block payloads <-> ordered chunks, the unit a payload crosses the wire in.

A call's payloads are one byte stream cut into chunks of at most ``chunk_bytes``; a chunk never
spans two blocks and names its place::

    blocks:  | block 0: block_bytes            | block 1: block_bytes            | ...
    chunks:  | (0, 0) | (0, c) | ... | (0, k*c) | (1, 0) | (1, c) | ...
             (block_index, offset): chunks arrive in exactly this order

Both ends use this module: the server cuts Get payloads and assembles Put payloads, the client
the other way round. It knows byte positions only, nothing about what the bytes mean.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from kvstore.buffers import aligned_empty
from kvstore.errors import InvalidRequest
from kvstore.service.limits import LimitExceeded


def iter_chunks(payloads: Sequence[np.ndarray], chunk_bytes: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """``(block_index, offset, data)`` for every chunk of ``payloads`` (flat uint8 views), in order;
    ``data`` is a view into the payload (no copy)."""
    for index, payload in enumerate(payloads):
        for offset in range(0, payload.nbytes, chunk_bytes):
            yield index, offset, payload[offset : offset + chunk_bytes]


class SentBlocks:
    """How many leading blocks of a stream went out whole. ``chunks`` is ``iter_chunks`` with block
    indices from ``first_index``; it is asked for a chunk only once the one before was written, so
    when it hands out a chunk of block ``i`` every block before ``i`` was sent, and when it is
    asked past the last chunk every block was."""

    def __init__(self) -> None:
        self.count = 0

    def chunks(self, payloads: Sequence[np.ndarray], first_index: int,
               chunk_bytes: int) -> Iterator[tuple[int, int, np.ndarray]]:
        for index, offset, data in iter_chunks(payloads, chunk_bytes):
            self.count = first_index + index
            yield first_index + index, offset, data
        self.count = first_index + len(payloads)


def check_block_bytes(declared: int, expected: int, what: str, num_blocks: int) -> None:
    """The size a caller declared for its ``num_blocks`` payloads or buffers must be the block size."""
    if num_blocks and declared != expected:
        raise InvalidRequest(f"{what} has {declared} bytes, expected exactly {expected}")


class BlockAssembler:
    """Fills ``num_blocks`` payloads of ``block_bytes`` from chunks arriving in order.

    ``buffers`` (flat writable uint8 views) receive the bytes; without them each block's buffer is
    allocated when its first chunk arrives. ``finish`` returns the buffers once every byte is in,
    and raises ``InvalidRequest`` for a stream that ended early.
    """

    def __init__(self, num_blocks: int, block_bytes: int, max_chunk_bytes: int,
                 buffers: Sequence[np.ndarray] | None = None, what: str = "put stream"):
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.what = what
        self.received = 0
        self._buffers = list(buffers) if buffers is not None else []
        self._buffers_given = buffers is not None

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def add(self, block_index: int, offset: int, data: bytes) -> None:
        """Take the next chunk: ``InvalidRequest`` unless it is in place and carries at least one
        byte (an empty chunk moves nothing: ``iter_chunks`` makes none), ``LimitExceeded`` if it
        exceeds ``max_chunk_bytes``."""
        if not len(data):
            raise InvalidRequest(f"{self.what}: an empty chunk at block {block_index} offset {offset}; every chunk "
                                 "carries at least one byte")
        if len(data) > self.max_chunk_bytes:
            raise LimitExceeded(f"a chunk of {len(data)} bytes exceeds max_chunk_bytes={self.max_chunk_bytes}")
        expected = divmod(self.received, self.block_bytes)
        if (block_index, offset) != expected:
            raise InvalidRequest(
                f"{self.what}: chunk at block {block_index} offset {offset} is out of place; expected block "
                f"{expected[0]} offset {expected[1]} (chunks come in order; blocks are {self.block_bytes} bytes)")
        if block_index >= self.num_blocks or offset + len(data) > self.block_bytes:
            raise InvalidRequest(
                f"{self.what}: chunk at block {block_index} offset {offset} of {len(data)} bytes runs past the "
                f"declared {self.num_blocks} blocks of {self.block_bytes} bytes")
        if block_index == len(self._buffers):
            self._buffers.append(aligned_empty(self.block_bytes))  # written to disk with no copy
        self._buffers[block_index][offset : offset + len(data)] = np.frombuffer(data, np.uint8)
        self.received += len(data)

    def extend(self, more_blocks: int) -> None:
        """Expect ``more_blocks`` more blocks (a streamed Get's next header). The blocks announced
        so far must be complete, and buffers given up front must cover the new ones."""
        if self.received != self.total_bytes:
            raise InvalidRequest(f"{self.what}: a header arrived before the {self.num_blocks} blocks announced "
                                 f"were complete")
        if self._buffers_given and self.num_blocks + more_blocks > len(self._buffers):
            raise InvalidRequest(f"{self.what}: {self.num_blocks + more_blocks} blocks announced for "
                                 f"{len(self._buffers)} requested")
        self.num_blocks += more_blocks

    def finish(self) -> list[np.ndarray]:
        if self.received != self.total_bytes:
            block, offset = divmod(self.received, self.block_bytes)
            raise InvalidRequest(
                f"{self.what} ended early: {self.received} of {self.total_bytes} bytes arrived (next expected: "
                f"block {block} offset {offset})")
        return self._buffers[: self.num_blocks]
