"""Chunking and in-order assembly of block payloads, without a server."""

import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.service.chunks import BlockAssembler, check_block_bytes, iter_chunks
from kvstore.service.limits import LimitExceeded, ServiceLimits


def payloads(n, size):
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


def test_chunks_never_span_blocks_and_reassemble_exactly():
    blocks = payloads(3, 10)
    chunks = list(iter_chunks(blocks, 4))
    assert [(i, o, len(d)) for i, o, d in chunks] == [
        (0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 4), (1, 4, 4), (1, 8, 2), (2, 0, 4), (2, 4, 4), (2, 8, 2)]
    assembler = BlockAssembler(3, 10, max_chunk_bytes=4)
    for chunk in chunks:
        assembler.add(*chunk)
    assert all(np.array_equal(a, b) for a, b in zip(assembler.finish(), blocks))


def test_assembler_fills_caller_buffers_in_place():
    blocks = payloads(2, 8)
    dsts = [np.zeros(8, np.uint8) for _ in blocks]
    assembler = BlockAssembler(2, 8, 8, buffers=dsts)
    for chunk in iter_chunks(blocks, 3):
        assembler.add(*chunk)
    assert assembler.finish()[0] is dsts[0] and np.array_equal(dsts[1], blocks[1])


def test_a_stream_that_ends_early_names_what_is_missing():
    assembler = BlockAssembler(2, 10, 10)
    assembler.add(0, 0, bytes(10))
    assembler.add(1, 0, bytes(3))
    with pytest.raises(InvalidRequest, match=r"ended early: 13 of 20 bytes arrived \(next expected: block 1 offset 3"):
        assembler.finish()


@pytest.mark.parametrize("chunks, message", [
    ([(1, 0, 4)], "expected block 0 offset 0"),                 # skipped a block
    ([(0, 0, 4), (0, 0, 4)], "expected block 0 offset 4"),      # repeated a chunk
    ([(0, 0, 4), (0, 4, 4), (0, 8, 4)], "runs past the declared 1 blocks of 10 bytes"),  # block too long
    ([(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 1)], "runs past the declared 1 blocks"),  # extra block
])
def test_chunks_out_of_place_are_refused(chunks, message):
    assembler = BlockAssembler(1, 10, 4)
    with pytest.raises(InvalidRequest, match=message):
        for chunk in chunks:
            assembler.add(chunk[0], chunk[1], bytes(chunk[2]))


def test_a_chunk_over_the_limit_names_the_limit():
    with pytest.raises(LimitExceeded, match="max_chunk_bytes=4"):
        BlockAssembler(1, 10, 4).add(0, 0, bytes(5))


def test_declared_size_must_be_the_block_size_unless_there_are_no_blocks():
    check_block_bytes(0, 9216, "block payload", 0)
    with pytest.raises(InvalidRequest, match="block payload has 9215 bytes, expected exactly 9216"):
        check_block_bytes(9215, 9216, "block payload", 1)


def test_limits_are_validated_and_name_themselves():
    with pytest.raises(InvalidRequest, match="max_transfer_blocks must be positive"):
        ServiceLimits(max_transfer_blocks=0)
    with pytest.raises(InvalidRequest, match="must exceed max_chunk_bytes"):
        ServiceLimits(max_chunk_bytes=4 << 20)
    with pytest.raises(LimitExceeded, match="33 blocks in one call exceed max_transfer_blocks=32"):
        ServiceLimits().check_blocks("max_transfer_blocks", 33)
    assert ServiceLimits().chunk_bytes(0) == 1 << 20 and ServiceLimits().chunk_bytes(4 << 20) == 1 << 20


def test_a_streamed_get_extends_the_blocks_once_the_announced_ones_are_complete():
    dsts = [np.zeros(8, np.uint8) for _ in range(3)]
    assembler = BlockAssembler(1, 8, 8, buffers=dsts, what="Get stream")
    with pytest.raises(InvalidRequest, match="before the 1 blocks announced were complete"):
        assembler.extend(1)
    assembler.add(0, 0, b"a" * 8)
    assembler.extend(2)
    assembler.add(1, 0, b"b" * 8)
    assembler.add(2, 0, b"c" * 8)
    assert [d.tobytes() for d in assembler.finish()] == [b"a" * 8, b"b" * 8, b"c" * 8]
    with pytest.raises(InvalidRequest, match="4 blocks announced for 3 requested"):
        assembler.extend(1)
