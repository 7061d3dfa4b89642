"""The tier interface: what the tiered store asks of every medium (device, host, disk, remote).

Keys are opaque 32-byte strings (namespace id + block hash). A tier stores whole blocks, each a
flat payload split into ``num_layers`` equal layers with one checksum per layer, and reads any
run of whole layers straight into a caller's buffer.

Contract shared by all tiers:
- ``write`` makes a block visible only once all its bytes are in place; it returns False when
  the tier has no room (the store evicts first, by policy) and never evicts on its own. The
  store ``reserve``s the room it made before it writes, so another thread's write cannot take
  that room first; a ``write`` that returns, stored or not, has taken the block's reservation
  (one that raises may not have: the store then calls ``unreserve``).
- ``read`` returns False on a miss. A block whose bytes fail verification is dropped, counted
  and reported as a miss: a tier never hands out wrong bytes.
- Every method is safe to call from several threads. The store guarantees that a block being
  read is not removed concurrently (it pins it).
- ``discard`` does no I/O and never waits for another thread's I/O: the store calls it under its
  lock, which lookups wait for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

KEY_BYTES = 32


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What the store keeps about a resident block besides its bytes."""

    nbytes: int
    num_layers: int
    checksums: tuple[int, ...]
    parent: bytes | None = None  # previous block of the chain (32-byte key), None at a head

    @property
    def layer_bytes(self) -> int:
        return self.nbytes // self.num_layers


@dataclass(frozen=True)
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    bytes_read: int = 0
    bytes_written: int = 0
    checksum_failures: int = 0
    io_errors: int = 0
    # filled in by the store, which alone sees traffic across tiers:
    hit_blocks: int = 0  # lookups whose hit was served from this tier (top copy)
    loaded_blocks: int = 0
    evictions: int = 0
    demotions_in: int = 0
    promotions_in: int = 0
    extra: dict = field(default_factory=dict)


class Tier(ABC):
    name: str
    capacity_bytes: int
    in_memory = False  # reads are memory copies that cannot hang on a device (``view`` may lend them)

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes this tier counts against its capacity (footprints, not payloads)."""

    @abstractmethod
    def footprint(self, nbytes: int) -> int:
        """Bytes a payload of ``nbytes`` occupies here (headers, alignment, slot rounding)."""

    @abstractmethod
    def can_fit(self, nbytes: int) -> bool:
        """Whether a payload of ``nbytes`` fits now without evicting anything."""

    def reserve(self, key: bytes, nbytes: int) -> bool:
        """Set room for one write of ``key`` (a payload of ``nbytes``) aside: it counts as used,
        so neither ``can_fit`` nor another write sees it, until ``write(key, ...)`` takes it or
        ``unreserve(key)`` gives it back. False when it does not fit now. Never waits for I/O:
        the store reserves under its lock, once it has made the room. Default: ``can_fit``, with
        nothing set aside (enough for a tier one thread writes)."""
        return self.can_fit(nbytes)

    def unreserve(self, key: bytes) -> None:
        """Give back ``key``'s reservation when no ``write`` took it (a no-op otherwise)."""

    def max_block_bytes(self) -> int | None:
        """Largest payload footprint one block may have here (None: no limit)."""
        return None

    def max_block_remedy(self) -> str:
        """What bounds ``max_block_bytes`` and what to raise (the end of a refusal's message)."""
        return "raise its page size"

    def max_layers(self) -> int | None:
        """Most layers one block may have here (None: no limit)."""
        return None

    def refusal(self, block_bytes: int, num_layers: int) -> str | None:
        """Why this tier cannot hold blocks of ``block_bytes`` in ``num_layers`` layers, or None."""
        limit = self.max_block_bytes()
        if limit is not None and self.footprint(block_bytes) > limit:
            return f"the {self.name} tier holds at most {limit} bytes per block ({self.max_block_remedy()})"
        if self.max_layers() is not None and num_layers > self.max_layers():
            return f"the {self.name} tier holds at most {self.max_layers()} layers per block"
        return None

    def eviction_helps(self, victim: bytes, nbytes: int) -> bool:
        """Whether evicting ``victim`` brings a payload of ``nbytes`` closer to fitting. A tier
        that answers False for some (pages cut into slots of one size each) also answers
        ``page_of`` and ``page_residents``, so a size with no slot left can have a page emptied."""
        return True

    def page_of(self, key: bytes) -> int | None:
        """The page of a resident ``key`` in a tier of pages (see ``eviction_helps``); else None."""
        return None

    def page_residents(self, page: int) -> list[bytes] | None:
        """The blocks resident in ``page`` when they are all it holds; None when it also holds a
        slot reserved or being written (it cannot be emptied now), or the tier has no pages."""
        return None

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def meta(self, key: bytes) -> BlockMeta | None: ...

    def parent_of(self, key: bytes) -> bytes | None:
        """The parent of resident ``key`` (None at a chain's head or when not resident), with no
        I/O: the store asks it under its lock. Default: from ``meta``, for tiers whose ``meta``
        does no I/O."""
        meta = self.meta(key)
        return None if meta is None else meta.parent

    @abstractmethod
    def items(self) -> Iterator[tuple[bytes, BlockMeta]]:
        """Snapshot of every resident block (for the store to rebuild its directory)."""

    def view(self, key: bytes) -> np.ndarray | None:
        """Zero-copy read-only view of a payload where the medium allows it (else None)."""
        return None

    @abstractmethod
    def write(self, key: bytes, payload: np.ndarray, meta: BlockMeta) -> bool:
        """Store ``payload`` (flat uint8, ``meta.nbytes``) under ``key``, in the room reserved for
        it if there is one (``reserve``); False when out of room."""

    @abstractmethod
    def read(self, key: bytes, dst: np.ndarray, first_layer: int = 0, num_layers: int | None = None) -> bool:
        """Copy whole layers ``[first_layer, first_layer + num_layers)`` into ``dst``; False on a miss."""

    def prefetch(self, keys: list[bytes]) -> None:
        """Hint that these blocks will be read soon, in this order (no-op unless the medium can
        start reading ahead). Never blocks for I/O and never fails."""

    @abstractmethod
    def remove(self, key: bytes) -> bool:
        """Forget ``key`` and reclaim its space; False when it was not resident."""

    def discard(self, key: bytes) -> bool:
        """Forget ``key`` at once, never waiting for I/O or for a write in progress: its space
        counts as free from now on, and the medium gets it back by the next ``reclaim``, write or
        flush. What the store calls under its lock. False when it was not resident. Default:
        ``remove``, for tiers whose removal does no I/O."""
        return self.remove(key)

    def reclaim(self) -> None:
        """Give the medium back the space of discarded blocks now (no-op where ``discard`` did)."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the tier's accounting holds (``free + used == capacity`` and friends)."""

    @abstractmethod
    def stats(self) -> TierStats: ...

    def flush(self) -> bool:
        """Make every completed write durable; whether that succeeded (a volatile tier has nothing
        to make durable: True)."""
        return True

    def close(self) -> None:
        """Release the tier's resources; the tier is unusable afterwards."""
