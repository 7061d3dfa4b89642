"""Checks of the block hashes a caller hands the store: what every public method validates
before it touches anything. Pure functions (the store passes what they need to look up);
``InvalidRequest`` says what would be valid."""

from __future__ import annotations

from typing import Callable, Sequence

from kvstore.errors import InvalidRequest
from kvstore.keys import DIGEST_BYTES


def check_hashes(block_hashes: Sequence[bytes]) -> None:
    """Reject anything but 16-byte ``bytes`` digests (C-speed checks: this is on the lookup path)."""
    if not block_hashes:
        return
    types = set(map(type, block_hashes))
    if types != {bytes} or set(map(len, block_hashes)) != {DIGEST_BYTES}:  # len() only once all are bytes
        lengths = {len(h) for h in block_hashes if hasattr(h, "__len__")}
        raise InvalidRequest(
            f"block hashes must be {DIGEST_BYTES}-byte digests (kvstore.keys.chain_hashes); "
            f"got types {sorted(t.__name__ for t in types)} with lengths {sorted(lengths)}"
        )


def check_chain(block_hashes: Sequence[bytes], parent: bytes | None) -> None:
    """Reject a chain that names a block twice or has its own block as ``parent``: each block
    would be its own ancestor, and a loop of blocks that are each other's children is never a
    leaf, so it could never be evicted."""
    if len(set(block_hashes)) != len(block_hashes) or (parent is not None and parent in block_hashes):
        raise InvalidRequest(
            "a put's blocks must be distinct and must not include its parent: pass the hash of the block "
            "before block_hashes[0] as parent, or None at the start of a prompt"
        )


def closes_loop(new: set[bytes], parent: bytes, named_as_parent: Callable[[bytes], bool],
                parent_of: Callable[[bytes], bytes | None]) -> bool:
    """Whether storing the ``new`` keys under ``parent`` makes a key its own ancestor, as after
    ``put([A], parent=B)`` then ``put([B], parent=A)``: blocks that are each other's ancestors are
    never leaves, so they could never be evicted.

    Only a new key that resident blocks already name as their parent (``named_as_parent``) can
    close a loop, so the walk up from ``parent`` (``parent_of``: a resident key's parent, None at
    a head or past the resident blocks) happens only then: after a block was dropped while its
    children stayed, not on the common path.
    """
    for key in new:  # a loop, not any() over a generator: this runs for every block stored
        if named_as_parent(key):
            break
    else:
        return False
    key, seen = parent, set()
    while key is not None and key not in seen:
        if key in new:
            return True
        seen.add(key)
        key = parent_of(key)
    return False
