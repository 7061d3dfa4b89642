"""The same-host fast path for puts: staging slots in a shared-memory segment clients write into.

    client  ReserveSlots(ns, hashes)  ->  reservation id, segment path, one slot per block
    client  maps the segment read-write, writes each payload into its slot
    client  CommitSlots(id, per-layer checksums)
    server  copies each slot out, verifies it against the checksums, then ``store.put``

The blocks become visible only at commit, and only if every slot's bytes match the checksums the
client computed from its own buffer: a block torn by a crashed or racing writer is refused, never
stored. The server verifies a private copy (``StagingArea.take``) rather than the slot itself, so
a client that keeps writing into the slot after committing cannot change what was verified.

The staging segment is separate from the host tier's arena (which the client library maps
read-only), so a client that writes only where the protocol lets it never writes into a block the
store serves. The arena file itself is the sidecar's user's (mode 0600): a process of that same
user could still open it for writing, so run the sidecar under a user of its own where clients
are not trusted. The staging segment is carved by the same slab allocator; a reservation not
committed within its TTL (at most ``MAX_RESERVATION_TTL_S``) lapses and its slots are reused.

A reservation belongs to the client that made it (its ``owner``): its id is random, and a commit
from anyone else is answered as for an unknown id, so another client can neither guess it nor
learn that it exists. ``owner_limit`` caps the reservations one owner holds at once.
"""

from __future__ import annotations

import collections
import logging
import secrets
import shutil
import threading
import time
from dataclasses import dataclass

import numpy as np

from kvstore.buffers import aligned_empty
from kvstore.checksum import layer_checksums
from kvstore.errors import InvalidRequest, KVStoreError, StoreClosed, UnknownLease
from kvstore.service.limits import LimitExceeded
from kvstore.tiers.shm_segment import Segment, default_shm_dir
from kvstore.tiers.slab import SlabAllocator, unused_capacity

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 << 20
STAGING_AUTO = "auto"  # DEFAULT_STAGING_BYTES, within half the room left in the shared-memory directory
MIN_STAGING_BYTES = 4096  # one slot of the smallest size: the slab's alignment
DEFAULT_RESERVATION_TTL_S = 30.0
MAX_RESERVATION_TTL_S = 600.0  # a reservation covers one copy into its slots, not storage


def open_staging(capacity: int | str, shm_dir: str | None = None) -> StagingArea | None:
    """The sidecar's staging area: ``capacity`` bytes (0: none), or ``"auto"``: DEFAULT_STAGING_BYTES,
    at most half the room left in ``shm_dir`` (call it once the host tier has its segment; a
    container's /dev/shm is often 64 MiB), in whole 4 KiB; none where that is not one page (logged:
    clients then put through Put). A given capacity that does not fit raises ``NoSpaceForSegment``."""
    if capacity != STAGING_AUTO:
        return StagingArea(capacity, shm_dir) if capacity else None
    directory = shm_dir or default_shm_dir()
    room = shutil.disk_usage(directory).free
    auto = min(DEFAULT_STAGING_BYTES, room // 2) // MIN_STAGING_BYTES * MIN_STAGING_BYTES
    if auto < MIN_STAGING_BYTES:
        log.warning("no staging area for same-host puts: %s has %d bytes free (clients put through Put); "
                    "free room there or point KVSTORE_SHM_DIR at a larger tmpfs", directory, room)
        return None
    if auto < DEFAULT_STAGING_BYTES:
        log.info("staging area of %d bytes, half the %d bytes free in %s (set --staging-capacity or "
                 "KVSTORE_STAGING_BYTES to choose)", auto, room, directory)
    return StagingArea(auto, shm_dir)


class StagingFull(LimitExceeded):
    """No room for a reservation now: the staging area is reserved up to ``staging_bytes``; or
    ever, for a block larger than its page (the client sends such blocks through Put)."""


class StagedBytesChanged(KVStoreError):
    """A commit's slots do not hold the bytes its checksums were taken of: written partly, changed
    afterwards, or overwritten by a late writer of a lapsed reservation whose slots were reused.
    Nothing was stored; the client sends the blocks again (``KVStoreClient.put_shm`` takes Put)."""


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
    owner: str = ""  # the client that reserved: the only one that may commit


class StagingArea:
    """Reservable slots in one shared-memory file. Thread-safe."""

    def __init__(self, capacity_bytes: int = DEFAULT_STAGING_BYTES, shm_dir: str | None = None,
                 page_bytes: int = 64 << 20):
        if capacity_bytes < MIN_STAGING_BYTES:
            raise InvalidRequest(f"staging capacity must be at least {MIN_STAGING_BYTES} bytes, got {capacity_bytes}")
        page_bytes = max(4096, min(page_bytes, capacity_bytes) // 4096 * 4096)
        self._slab = SlabAllocator(capacity_bytes, page_bytes)
        if note := unused_capacity("staging", capacity_bytes, self._slab):
            log.log(*note)
        self._segment = Segment(self._slab.capacity_bytes, shm_dir, kind="staging", prefault=True)
        self.segment_path = self._segment.path
        self._arena = np.frombuffer(self._segment.mmap, np.uint8)  # [capacity] bytes
        self._reservations: dict[int, Reservation] = {}
        self._held: collections.Counter[str] = collections.Counter()  # owner -> reservations now
        self._spare: dict[int, list[np.ndarray]] = {}  # recycled private copies by size, least recent first
        self._spare_bytes = 0  # held in _spare: at most the area's capacity (no page faults on a next take)
        self._lock = threading.Lock()
        self._closed = False
        self.lapsed = 0  # reservations dropped by TTL, never committed

    @property
    def capacity_bytes(self) -> int:
        return self._slab.capacity_bytes

    def fits(self, block_bytes: int) -> bool:
        """Whether a block of ``block_bytes`` fits one of this area's pages (else only Put takes it)."""
        return self._slab.fits_in_page(block_bytes)

    def reserve(self, ns_id: bytes, block_hashes: tuple[bytes, ...], parent: bytes | None, block_bytes: int,
                num_layers: int, ttl_s: float, *, owner: str = "", owner_limit: int | None = None) -> Reservation:
        """Slots for ``len(block_hashes)`` payloads of ``block_bytes``, held for ``owner`` alone.

        Raises ``InvalidRequest`` for a ``ttl_s`` outside (0, MAX_RESERVATION_TTL_S], ``LimitExceeded``
        when ``owner`` already holds ``owner_limit`` reservations, ``StagingFull`` if the slots do not fit.
        """
        if not block_hashes:
            raise InvalidRequest("ReserveSlots needs at least one block hash")
        if not 0 < ttl_s <= MAX_RESERVATION_TTL_S:  # also refuses NaN
            raise InvalidRequest(f"a reservation's ttl_s must be in (0, {MAX_RESERVATION_TTL_S:g}] seconds, got "
                                 f"{ttl_s}: it covers one copy into the slots (0 or unset: the default "
                                 f"{DEFAULT_RESERVATION_TTL_S:g})")
        if not self.fits(block_bytes):
            raise StagingFull(f"a {block_bytes}-byte block does not fit a {self._slab.page_bytes}-byte "
                              "staging page; use Put (or raise --staging-capacity)")
        with self._lock:
            self._check_open()
            self._lapse_expired()
            if owner_limit is not None and self._held[owner] >= owner_limit:
                raise LimitExceeded(f"max_reservations_per_client={owner_limit}: this client holds that many "
                                    "staging reservations; commit them (or let them lapse) before reserving more")
            reservation = Reservation(self._new_id(), ns_id, block_hashes, parent, block_bytes, num_layers,
                                      self._allocate(len(block_hashes), block_bytes), time.monotonic() + ttl_s, owner)
            self._reservations[reservation.reservation_id] = reservation
            self._held[owner] += 1
            return reservation

    def _allocate(self, count: int, block_bytes: int) -> tuple[int, ...]:
        """Offsets of ``count`` free slots, or ``StagingFull`` (none taken). Caller holds the lock."""
        offsets: list[int] = []
        for _ in range(count):
            offset = self._slab.allocate(block_bytes)
            if offset is None:
                for taken in offsets:
                    self._slab.free(taken)
                raise StagingFull(f"staging_bytes={self.capacity_bytes}: the staging area has no room for "
                                  f"{count} blocks of {block_bytes} bytes now; retry or use Put")
            offsets.append(offset)
        return tuple(offsets)

    def _new_id(self) -> int:
        """A random, unused, non-zero 63-bit id: not guessable from one's own. Caller holds the lock."""
        while True:
            reservation_id = secrets.randbits(63)
            if reservation_id and reservation_id not in self._reservations:
                return reservation_id

    def take(self, reservation_id: int, checksums: list[tuple[int, ...]],
             owner: str = "") -> tuple[Reservation, list[np.ndarray]]:
        """End ``owner``'s reservation: private copies of its slots, each verified against ``checksums``.

        Raises ``UnknownLease`` for an unknown or lapsed reservation, or one of another owner (the
        same answer: that one is left as it is), ``StagedBytesChanged`` when a slot's bytes do not
        match its checksums, and ``InvalidRequest`` when their count is wrong; the owner's slots
        are freed in every case (the copies recycled), so a failed commit must reserve again.
        """
        with self._lock:
            self._check_open()
            self._lapse_expired()
            reservation = self._reservations.get(reservation_id)
            if reservation is None or reservation.owner != owner:
                raise UnknownLease(f"reservation {reservation_id} is unknown or lapsed (reservations last "
                                   "their ttl_s); reserve again")
            copies = [self._copy_out(o, reservation.block_bytes) for o in reservation.offsets]
            self._end(reservation_id)
        try:
            _verify(reservation, copies, checksums)
        except KVStoreError:  # InvalidRequest, StagedBytesChanged: the copies are no block's
            self.recycle(copies)
            raise
        return reservation, copies

    def cancel(self, reservation: Reservation) -> None:
        """End ``reservation`` unused (its slots are free again); nothing if it ended already."""
        with self._lock:
            if self._reservations.get(reservation.reservation_id) is reservation:
                self._end(reservation.reservation_id)

    def drop(self, reservation_id: int, owner: str = "") -> None:
        """End ``owner``'s reservation unused, by id (a commit refused before ``take``); nothing if
        it is unknown, lapsed or another owner's."""
        with self._lock:
            reservation = self._reservations.get(reservation_id)
            if reservation is not None and reservation.owner == owner:
                self._end(reservation_id)

    def recycle(self, copies: list[np.ndarray]) -> None:
        """Give back the copies ``take`` returned once they are no longer read (optional: a faster
        next take). At most the area's capacity is kept, of the sizes recycled most recently."""
        with self._lock:
            for copy in copies:
                if copy.nbytes > self.capacity_bytes:
                    continue
                while self._spare_bytes + copy.nbytes > self.capacity_bytes:
                    self._take_spare(next(iter(self._spare)))  # of the size recycled least recently
                spare = self._spare.pop(copy.nbytes, [])
                spare.append(copy)
                self._spare[copy.nbytes] = spare  # now the size recycled most recently
                self._spare_bytes += copy.nbytes

    def _take_spare(self, nbytes: int) -> np.ndarray | None:
        """A held copy of ``nbytes``, no longer held, or None. Caller holds the lock."""
        spare = self._spare.get(nbytes)
        if not spare:
            return None
        copy = spare.pop()
        if not spare:
            del self._spare[nbytes]
        self._spare_bytes -= nbytes
        return copy

    def _copy_out(self, offset: int, nbytes: int) -> np.ndarray:
        copy = self._take_spare(nbytes)
        if copy is None:
            copy = aligned_empty(nbytes)  # [nbytes] uint8, page-aligned for the disk tier
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
            self._held.clear()
            self._arena = None
        self._segment.close()

    def _lapse_expired(self) -> None:
        now = time.monotonic()
        for reservation_id in [r for r, res in self._reservations.items() if res.expires_s <= now]:
            self._end(reservation_id)
            self.lapsed += 1

    def _end(self, reservation_id: int) -> None:
        """Forget a reservation and free its slots. Caller holds the lock."""
        reservation = self._reservations.pop(reservation_id)
        for offset in reservation.offsets:
            self._slab.free(offset)
        self._held[reservation.owner] -= 1
        if not self._held[reservation.owner]:
            del self._held[reservation.owner]

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
            raise StagedBytesChanged(f"block {index}: the staged bytes do not match their checksums (written "
                                 "partly, or changed after the checksum was taken); nothing was stored")
