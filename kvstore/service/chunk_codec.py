"""``GetResponse`` chunk messages encoded and decoded by hand: one copy each way, not four.

The bytes path's cost is copying. Through the protobuf library a Get chunk is copied into a
``bytes`` object, into the message, into the serialized string (server), then out of the parsed
message and into the caller's buffer (client). Here the server writes the few bytes of framing
and joins them with the payload slice (one copy), and the client finds the payload inside the
received message and copies it straight into the destination (one copy).

The wire format is unchanged: what the server sends is exactly a serialized ``GetResponse``
whose ``chunk`` is set (field 2, a ``Chunk`` of ``block_index`` = 1, ``offset`` = 2, ``data`` =
3), so clients built from the .proto read it as usual. The decoder accepts any valid encoding of
that message (fields in any order, zero values omitted).
"""

from __future__ import annotations

from kvstore.errors import InvalidRequest

_VARINT, _LEN = 0, 2
_CHUNK_FIELD = 2  # GetResponse.chunk
_BLOCK_INDEX, _OFFSET, _DATA = 1, 2, 3  # Chunk fields


def encode_chunk(block_index: int, offset: int, data: memoryview) -> bytes:
    """A serialized ``GetResponse(chunk=Chunk(block_index, offset, data))``; ``data`` copied once."""
    fields = _key(_BLOCK_INDEX, _VARINT) + _varint(block_index) + _key(_OFFSET, _VARINT) + _varint(offset) \
        + _key(_DATA, _LEN) + _varint(len(data))
    head = _key(_CHUNK_FIELD, _LEN) + _varint(len(fields) + len(data)) + fields
    return b"".join((head, data))


def decode_chunk(message: bytes) -> tuple[int, int, memoryview] | None:
    """``(block_index, offset, data view)`` of a serialized ``GetResponse`` holding a chunk; None
    when it holds something else (the header). Raises ``InvalidRequest`` for malformed bytes."""
    view = memoryview(message)
    pos, found = 0, None
    while pos < len(view):
        field, kind, pos = _read_key(view, pos)
        if kind == _LEN:
            length, pos = _read_varint(view, pos)
            if field == _CHUNK_FIELD:
                found = view[pos : pos + length]
            pos += length
        elif kind == _VARINT:
            _, pos = _read_varint(view, pos)
        else:
            raise InvalidRequest(f"GetResponse: unexpected wire type {kind} for field {field}")
    if pos != len(view):
        raise InvalidRequest("GetResponse: truncated message")
    return None if found is None else _chunk_fields(found)


def _chunk_fields(view: memoryview) -> tuple[int, int, memoryview]:
    block_index = offset = 0
    data = view[0:0]
    pos = 0
    while pos < len(view):
        field, kind, pos = _read_key(view, pos)
        if kind == _VARINT:
            value, pos = _read_varint(view, pos)
            if field == _BLOCK_INDEX:
                block_index = value
            elif field == _OFFSET:
                offset = value
        elif kind == _LEN:
            length, pos = _read_varint(view, pos)
            if field == _DATA:
                data = view[pos : pos + length]
            pos += length
        else:
            raise InvalidRequest(f"Chunk: unexpected wire type {kind} for field {field}")
    if pos != len(view):
        raise InvalidRequest("Chunk: truncated message")
    return block_index, offset, data


def _key(field: int, kind: int) -> bytes:
    return _varint(field << 3 | kind)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_key(view: memoryview, pos: int) -> tuple[int, int, int]:
    key, pos = _read_varint(view, pos)
    return key >> 3, key & 7, pos


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(view) or shift > 63:
            raise InvalidRequest("GetResponse: malformed varint")
        byte = view[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
