"""Accounting tier: keeps the books of a tier (keys, sizes, capacity) and none of the bytes.

Trace replay runs the store's real lookup, load, put and eviction code over tiers of this kind,
so hit rates come from the production policy path without moving payloads. ``read`` leaves the
destination untouched and reports a hit: never use this tier where bytes matter.
"""

from __future__ import annotations

import threading
from typing import Iterator

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.tiers.base import BlockMeta, Tier, TierStats


class AccountingTier(Tier):
    def __init__(self, name: str, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise InvalidRequest(f"tier {name!r} needs a positive capacity, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._blocks: dict[bytes, BlockMeta] = {}
        self._used = 0  # bytes of the blocks held
        self._reservations: dict[bytes, int] = {}  # key -> bytes set aside for its write (``reserve``)
        self._taken = 0  # _used and the reservations: one field, so a reader without the lock sees both at once
        self._lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._taken

    def footprint(self, nbytes: int) -> int:
        return nbytes

    def can_fit(self, nbytes: int) -> bool:
        return self._taken + nbytes <= self.capacity_bytes

    def reserve(self, key: bytes, nbytes: int) -> bool:
        with self._lock:
            assert key not in self._blocks and key not in self._reservations, "duplicate reservation (store bug)"
            if not self.can_fit(nbytes):
                return False
            self._reservations[key] = nbytes
            self._taken += nbytes
            return True

    def unreserve(self, key: bytes) -> None:
        with self._lock:
            self._taken -= self._reservations.pop(key, 0)

    def contains(self, key: bytes) -> bool:
        return key in self._blocks

    def meta(self, key: bytes) -> BlockMeta | None:
        return self._blocks.get(key)

    def items(self) -> Iterator[tuple[bytes, BlockMeta]]:
        with self._lock:
            return iter(list(self._blocks.items()))

    def write(self, key: bytes, payload: np.ndarray, meta: BlockMeta) -> bool:
        with self._lock:
            assert key not in self._blocks, "duplicate write (store bug)"
            reserved = self._reservations.pop(key, 0)  # its reserved room, if any, is this write's
            if self._taken - reserved + meta.nbytes > self.capacity_bytes:
                self._taken -= reserved
                return False
            self._blocks[key] = meta
            self._used += meta.nbytes
            self._taken += meta.nbytes - reserved
            return True

    def read(self, key: bytes, dst: np.ndarray, first_layer: int = 0, num_layers: int | None = None) -> bool:
        return key in self._blocks

    def remove(self, key: bytes) -> bool:
        with self._lock:
            meta = self._blocks.pop(key, None)
            if meta is None:
                return False
            self._used -= meta.nbytes
            self._taken -= meta.nbytes
            return True

    discard = remove  # no I/O to defer (``Tier.discard``): the store calls it for every eviction

    def check_integrity(self) -> None:
        with self._lock:
            assert self._used == sum(m.nbytes for m in self._blocks.values()), "used bytes disagree with blocks"
            assert self._taken == self._used + sum(self._reservations.values()), "taken bytes disagree with reservations"
            assert 0 <= self._taken <= self.capacity_bytes, "accounting tier over capacity"

    def stats(self) -> TierStats:
        return TierStats(self.name, self.capacity_bytes, self.used_bytes, len(self._blocks))
