"""One LMCache object in one fixed-size store block, and back, verified.

The store keeps blocks of one size per namespace; LMCache's objects vary in size (the last chunk
of a prompt is shorter). So an object is framed at the start of a block and the rest is zeros::

    block  = | header: HEADER_BYTES | object: nbytes | zeros up to the block size |
    header = | MAGIC 8 | key digest 16 | nbytes <u8 | xxh3-64 of the object <u8 | n <u4 | JSON: n bytes | zeros |
    JSON   = {"dtypes": ["bfloat16"], "fmt": "KV_MLA_FMT", "shapes": [[1, 61, 256, 576]]}

The JSON is what LMCache needs to allocate the same object again (its shapes, dtypes and memory
format, by name). The key digest is the block's own hash (``key_digest``), so a block served for
another key is refused; the object checksum covers the copy the caller keeps, whatever path it came
by (shared memory, the wire, disk).

Any mismatch raises ``CorruptObject``, which the connector turns into a miss. This module knows
bytes and LMCache's metadata by name only: no torch, no gRPC.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import numpy as np
import xxhash

MAGIC = b"KVLMC001"
HEADER_BYTES = 4096
_FIXED = struct.Struct("<8s16sQQI")  # magic, key digest, nbytes, object checksum, JSON length


class CorruptObject(Exception):
    """A block that does not hold a valid framed object for the key asked: a miss, never a crash."""


@dataclass(frozen=True)
class ObjectMeta:
    """How LMCache describes an object, by name: ``shapes`` per group, torch dtype names, MemoryFormat name."""

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    fmt: str

    def to_json(self) -> bytes:
        fields = {"dtypes": list(self.dtypes), "fmt": self.fmt, "shapes": [list(s) for s in self.shapes]}
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ObjectMeta:
        fields = json.loads(raw)
        return cls(tuple(tuple(int(d) for d in s) for s in fields["shapes"]), tuple(fields["dtypes"]), fields["fmt"])


@dataclass(frozen=True)
class Header:
    meta: ObjectMeta
    nbytes: int
    checksum: int  # xxh3-64 of the object's bytes


def key_digest(key: str) -> bytes:
    """The 16-byte block hash of an LMCache key: xxh3-128 of ``CacheEngineKey.to_string()`` in UTF-8."""
    return xxhash.xxh3_128_digest(key.encode())


def frame(block: np.ndarray, digest: bytes, payload: np.ndarray, meta: ObjectMeta) -> None:
    """Write ``payload`` (flat ``uint8``) framed for ``digest`` into ``block`` (flat ``uint8``), in place."""
    raw_meta = meta.to_json()
    end = HEADER_BYTES + payload.nbytes
    if _FIXED.size + len(raw_meta) > HEADER_BYTES or end > block.nbytes:
        raise ValueError(f"an object of {payload.nbytes} bytes with {len(raw_meta)} bytes of metadata does not "
                         f"fit a {block.nbytes}-byte block")
    fixed = _FIXED.pack(MAGIC, digest, payload.nbytes, xxhash.xxh3_64_intdigest(payload), len(raw_meta))
    header = fixed + raw_meta
    block[: len(header)] = np.frombuffer(header, np.uint8)
    block[len(header) : HEADER_BYTES] = 0
    block[HEADER_BYTES:end] = payload
    block[end:] = 0


def read_header(block: np.ndarray, digest: bytes) -> Header:
    """The header of ``block`` (flat ``uint8``) if it frames an object of key ``digest`` that fits the
    block; raises ``CorruptObject`` otherwise. Reads the header only: check the copy with ``verify``."""
    magic, stored_digest, nbytes, checksum, meta_len = _FIXED.unpack_from(block[: _FIXED.size])
    if magic != MAGIC:
        raise CorruptObject(f"no framed object (magic {magic!r})")
    if stored_digest != digest:
        raise CorruptObject(f"the block frames key {stored_digest.hex()}, not {digest.hex()}")
    if HEADER_BYTES + nbytes > block.nbytes or _FIXED.size + meta_len > HEADER_BYTES:
        raise CorruptObject(f"an object of {nbytes} bytes (metadata {meta_len}) cannot sit in {block.nbytes} bytes")
    try:
        meta = ObjectMeta.from_json(block[_FIXED.size : _FIXED.size + meta_len].tobytes())
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptObject(f"unreadable object metadata: {exc}") from None
    return Header(meta, nbytes, checksum)


def body(block: np.ndarray, header: Header) -> np.ndarray:
    """The object's bytes inside ``block`` (a view, no copy)."""
    return block[HEADER_BYTES : HEADER_BYTES + header.nbytes]


def verify(copy: np.ndarray, header: Header) -> None:
    """Raise ``CorruptObject`` unless ``copy`` holds exactly the object ``header`` describes."""
    if copy.nbytes != header.nbytes:
        raise CorruptObject(f"{copy.nbytes} bytes where the header says {header.nbytes}")
    if xxhash.xxh3_64_intdigest(copy) != header.checksum:
        raise CorruptObject("the object's bytes do not match their checksum")
