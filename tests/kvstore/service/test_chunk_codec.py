"""The hand codec of Get chunks agrees with the protobuf library byte for byte, both ways."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.errors import InvalidRequest
from kvstore.service.chunk_codec import decode_chunk, encode_chunk
from kvstore.service.v1 import kvstore_pb2 as pb


@given(block_index=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=3000))
def test_encoded_chunks_parse_as_get_responses_and_library_encodings_decode(block_index, offset, data):
    encoded = encode_chunk(block_index, offset, memoryview(data))
    parsed = pb.GetResponse.FromString(encoded)
    assert parsed.WhichOneof("kind") == "chunk"
    assert (parsed.chunk.block_index, parsed.chunk.offset, parsed.chunk.data) == (block_index, offset, data)

    library = pb.GetResponse(chunk=pb.Chunk(block_index=block_index, offset=offset, data=data)).SerializeToString()
    index, off, view = decode_chunk(library)  # zero fields omitted by the library
    assert (index, off, bytes(view)) == (block_index, offset, data)
    index, off, view = decode_chunk(encoded)
    assert (index, off, bytes(view)) == (block_index, offset, data)


def test_a_header_message_is_not_a_chunk_and_malformed_bytes_are_refused():
    header = pb.GetResponse(header=pb.GetHeader(requested_blocks=3, tiers=["host"], block_bytes=9)).SerializeToString()
    assert decode_chunk(header) is None
    encoded = encode_chunk(1, 2, memoryview(b"abcdef"))
    with pytest.raises(InvalidRequest):
        decode_chunk(encoded[:-2])
    with pytest.raises(InvalidRequest):
        decode_chunk(b"\xff" * 12)
