"""The same-host fast path for puts: staging slots in a shared-memory segment clients write into.

    client  ReserveSlots(ns, hashes)  ->  reservation id, segment path, one slot per block
    client  maps the segment read-write, writes each payload into its slot
    client  CommitSlots(id, per-layer checksums)
    server  copies each slot out, verifies it against the checksums, then ``store.put``

The blocks become visible only at commit, and only if every slot's bytes match the checksums the
client computed from its own buffer: a block torn by a crashed or racing writer is refused, never
stored. The server verifies a private copy (``StagingArea.take``) rather than the slot itself, so
a client that keeps writing into the slot after committing cannot change what was verified.

The staging segment is separate from the host tier's arena (which clients map read-only), so a
client can never write into a block the store serves. It is carved by the same slab allocator;
a reservation not committed within its TTL lapses and its slots are reused.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvstore.buffers import aligned_empty
from kvstore.checksum import layer_checksums
from kvstore.errors import InvalidRequest, StoreClosed, UnknownLease
from kvstore.service.limits import LimitExceeded
from kvstore.tiers.shm_segment import Segment
from kvstore.tiers.slab import SlabAllocator

DEFAULT_STAGING_BYTES = 256 << 20
DEFAULT_RESERVATION_TTL_S = 30.0


class StagingFull(LimitExceeded):
    """No room for a reservation now: the staging area is reserved up to ``staging_bytes``."""


@dataclass(frozen=True)
class Reservation:
    reservation_id: int
    ns_id: bytes
    block_hashes: tuple[bytes, ...]
    parent: bytes | None
    block_bytes: int
    num_layers: int
    offsets: tuple[int, ...]
    expires_s: float


class StagingArea:
    """Reservable slots in one shared-memory file. Thread-safe."""

    def __init__(self, capacity_bytes: int = DEFAULT_STAGING_BYTES, shm_dir: str | None = None,
                 page_bytes: int = 64 << 20):
        page_bytes = max(4096, min(page_bytes, capacity_bytes) // 4096 * 4096)
        self._slab = SlabAllocator(capacity_bytes, page_bytes)
        self._segment = Segment(self._slab.capacity_bytes, shm_dir, kind="staging", prefault=True)
        self.segment_path = self._segment.path
        self._arena = np.frombuffer(self._segment.mmap, np.uint8)  # [capacity] bytes
        self._reservations: dict[int, Reservation] = {}
        self._spare: dict[int, list[np.ndarray]] = {}  # recycled private copies by size: no page faults
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self.lapsed = 0  # reservations dropped by TTL, never committed

    @property
    def capacity_bytes(self) -> int:
        return self._slab.capacity_bytes

    def reserve(self, ns_id: bytes, block_hashes: tuple[bytes, ...], parent: bytes | None, block_bytes: int,
                num_layers: int, ttl_s: float) -> Reservation:
        """Slots for ``len(block_hashes)`` payloads of ``block_bytes``; raises ``StagingFull`` if none fit."""
        if not block_hashes:
            raise InvalidRequest("ReserveSlots needs at least one block hash")
        if ttl_s <= 0:
            raise InvalidRequest(f"a reservation's ttl_s must be positive, got {ttl_s}")
        if not self._slab.fits_in_page(block_bytes):
            raise InvalidRequest(f"a {block_bytes}-byte block does not fit a {self._slab.page_bytes}-byte "
                                 "staging page; use Put")
        with self._lock:
            self._check_open()
            self._lapse_expired()
            offsets: list[int] = []
            for _ in block_hashes:
                offset = self._slab.allocate(block_bytes)
                if offset is None:
                    for taken in offsets:
                        self._slab.free(taken)
                    raise StagingFull(f"staging_bytes={self.capacity_bytes}: the staging area has no room for "
                                      f"{len(block_hashes)} blocks of {block_bytes} bytes now; retry or use Put")
                offsets.append(offset)
            reservation = Reservation(next(self._ids), ns_id, block_hashes, parent, block_bytes, num_layers,
                                      tuple(offsets), time.monotonic() + ttl_s)
            self._reservations[reservation.reservation_id] = reservation
            return reservation

    def take(self, reservation_id: int, checksums: list[tuple[int, ...]]) -> tuple[Reservation, list[np.ndarray]]:
        """End the reservation: private copies of its slots, each verified against ``checksums``.

        Raises ``UnknownLease`` for an unknown or lapsed reservation and ``InvalidRequest`` when a
        slot's bytes do not match its checksums (or their count is wrong); the slots are freed in
        every case, so a failed commit must reserve again.
        """
        with self._lock:
            self._check_open()
            self._lapse_expired()
            reservation = self._reservations.pop(reservation_id, None)
            if reservation is None:
                raise UnknownLease(f"reservation {reservation_id} is unknown or lapsed (reservations last "
                                   "their ttl_s); reserve again")
            copies = [self._copy_out(o, reservation.block_bytes) for o in reservation.offsets]
            for offset in reservation.offsets:
                self._slab.free(offset)
        try:
            _verify(reservation, copies, checksums)
        except InvalidRequest:
            self.recycle(copies)
            raise
        return reservation, copies

    def recycle(self, copies: list[np.ndarray]) -> None:
        """Give back the copies ``take`` returned once they are no longer used (optional: a faster next take)."""
        with self._lock:
            for copy in copies:
                spare = self._spare.setdefault(copy.nbytes, [])
                if len(spare) < 64:
                    spare.append(copy)

    def _copy_out(self, offset: int, nbytes: int) -> np.ndarray:
        spare = self._spare.get(nbytes)
        copy = spare.pop() if spare else aligned_empty(nbytes)  # [nbytes] uint8, page-aligned for the disk tier
        np.copyto(copy, self._arena[offset : offset + nbytes])
        return copy

    def active(self) -> int:
        with self._lock:
            self._lapse_expired()
            return len(self._reservations)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reservations.clear()
            self._arena = None
        self._segment.close()

    def _lapse_expired(self) -> None:
        now = time.monotonic()
        for reservation_id in [r for r, res in self._reservations.items() if res.expires_s <= now]:
            for offset in self._reservations.pop(reservation_id).offsets:
                self._slab.free(offset)
            self.lapsed += 1

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("the staging area is closed")


def _verify(reservation: Reservation, copies: list[np.ndarray], checksums: list[tuple[int, ...]]) -> None:
    if len(checksums) != len(copies):
        raise InvalidRequest(f"CommitSlots carries checksums for {len(checksums)} blocks, the reservation "
                             f"has {len(copies)} slots")
    for index, (copy, expected) in enumerate(zip(copies, checksums)):
        if len(expected) != reservation.num_layers:
            raise InvalidRequest(f"block {index}: {len(expected)} layer checksums, the namespace has "
                                 f"{reservation.num_layers} layers")
        if layer_checksums(copy, reservation.num_layers) != tuple(expected):
            raise InvalidRequest(f"block {index}: the staged bytes do not match their checksums (written "
                                 "partly, or changed after the checksum was taken); nothing was stored")
