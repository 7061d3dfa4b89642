"""The same-host fast path: blocks read straight out of the host tier's shared-memory segment.

The host tier's arena is a file under /dev/shm (``HostTier.segment_path``). A client on the same
host maps it read-only and copies a leased block's slot into its own buffer: one memcpy, no
bytes through gRPC. Both ends live here:

    server  leased_slots(store, ...) -> SlotGrant   lookup with a lease, then where each leading
                                                     host-resident hit block sits in the segment
    client  SegmentMaps.slot(path, offset, nbytes)   a read-only view of one slot (None: cannot map)

Reach-in, on purpose: the store's public API has no "where does this block live" call, so
``leased_slots`` takes ``store.lookup`` (public) and then reads the ``HostTier`` among
``store.tiers`` (``slot_of``, ``meta``). That is safe only under the lease it just took: a pinned
block is never evicted or removed, so its slot keeps its bytes until the lease ends. The lookup
neither counts a load nor refreshes the policy's recency (``store.load`` does both).

What this module does not know: anything about the wire (servicer.py and client.py translate),
and whether the file a client maps is the server's: segment names carry the server's pid and a
random suffix, and the per-layer checksums in each slot let a careful client verify.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvstore.store import TieredStore
from kvstore.tiers.host import HostTier

ARENA_NAME = re.compile(r"^kvstore-\d+-[0-9a-f]{8}$")  # kvstore.tiers.shm_segment.Segment's names
STAGING_NAME = re.compile(r"^kvstore-staging-\d+-[0-9a-f]{8}$")


@dataclass(frozen=True)
class Slot:
    offset: int
    nbytes: int
    layer_checksums: tuple[int, ...]


@dataclass(frozen=True)
class SlotGrant:
    """A lease on the ``hit_blocks`` leading hit blocks; ``slots[i]`` locates hit block ``i`` for
    ``i < len(slots)`` (the leading run held by the host tier). The holder must release the lease.
    ``data_grant`` and ``data_port``: set where the sidecar's native data plane can stream the slots
    to a client that cannot map the segment (kvstore.service.dataplane)."""

    requested_blocks: int
    hit_blocks: int
    segment_path: str
    slots: tuple[Slot, ...]
    lease_id: int | None
    lease_refused: bool
    block_bytes: int
    data_grant: bytes = b""
    data_port: int = 0


def host_tier(store: TieredStore) -> HostTier | None:
    return next((t for t in store.tiers if isinstance(t, HostTier)), None)


def leased_slots(store: TieredStore, ns_id: bytes, block_hashes: Sequence[bytes], lease_ttl_s: float,
                 max_slots: int) -> SlotGrant:
    """Lease the hit of ``block_hashes`` and locate its leading host-tier run, at most ``max_slots``
    of it (reach-in: see above); the client fetches the rest of the hit with Get. The client copies
    the slots itself: the caller tells the store which it copied (``TieredStore.record_access``)
    once it knows, at the lease's Release. Not counted as a lookup: a connector's Lookup before it
    was (the same request counted twice until session 35), as in the Prometheus metrics."""
    hit = store.lookup(ns_id, block_hashes, lease_ttl_s, counted=False)
    host = host_tier(store)
    slots = []
    if host is not None and hit.lease_id is not None:
        for block_hash, tier in zip(block_hashes[:max_slots], hit.tiers):
            key = ns_id + block_hash
            where, meta = host.slot_of(key), host.meta(key)
            if tier != host.name or where is None or meta is None:
                break
            slots.append(Slot(where[0], where[1], tuple(meta.checksums)))
    return SlotGrant(len(block_hashes), hit.hit_blocks, host.segment_path if slots else "", tuple(slots),
                     hit.lease_id, hit.lease_refused, store.spec(ns_id).block_bytes)


class SegmentMaps:
    """Mappings of segment files, kept until ``close``. Thread-safe.

    Read-only by default (the host tier's arena); ``writable=True`` for the staging segment of
    shared-memory puts (kvstore.service.staging). A path that cannot be opened or mapped (another
    host, another container's /dev/shm, no permission) is remembered as unmappable, so the caller
    falls back to bytes once per path.

    The path comes from the sidecar's answer, so it is not trusted: only a regular file (no
    symbolic link) named as a segment of that kind is mapped (``kvstore-PID-RANDOM``, the
    staging one ``kvstore-staging-PID-RANDOM``). Else a sidecar, or whoever answers in its place,
    could name any file this process may read, or write (``/home/me/.bashrc``).

    A sidecar has one segment of each kind, named afresh by every sidecar process, so a new path
    means the sidecar restarted: the mappings of the old paths are dropped then (unmapped once no
    view of them is left), or a client would keep every dead sidecar's whole arena mapped. A
    sidecar that died is not there to hand out a new path, so ``drop_unlinked`` (called while it
    does not answer) drops the mappings of files its successor's sweep unlinked.
    """

    def __init__(self, writable: bool = False):
        self._writable = writable
        self._name = STAGING_NAME if writable else ARENA_NAME
        self._maps: dict[str, _Mapped | None] = {}
        self._lock = threading.Lock()

    def slot(self, path: str, offset: int, nbytes: int) -> np.ndarray | None:
        """``[nbytes]`` uint8 view of ``path`` at ``offset``; None if it cannot be mapped."""
        with self._lock:
            if path not in self._maps:
                stale = [self._maps.pop(old) for old in list(self._maps)]
                self._maps[path] = _map(path, self._writable) if self._name.match(os.path.basename(path)) else None
            else:
                stale = []
            mapped = self._maps[path]
        _unmap(stale)
        if mapped is None or offset + nbytes > mapped.view.nbytes:
            return None
        return mapped.view[offset : offset + nbytes]

    def drop_unlinked(self) -> list[str]:
        """Drop the mappings of files no longer at their path, and return those paths. A sidecar
        killed with SIGKILL leaves its segments behind; the next one's start unlinks them, but
        their memory stays allocated while any process maps them, and a small /dev/shm may need
        it for the new sidecar's own segment (which then cannot start until the clients let go)."""
        with self._lock:
            gone = [path for path, mapped in self._maps.items() if mapped is not None and not mapped.still_at(path)]
            stale = [self._maps.pop(path) for path in gone]
        _unmap(stale)
        return gone

    def mapped_paths(self) -> list[str]:
        """The paths mapped now (unmappable ones left out)."""
        with self._lock:
            return [path for path, mapped in self._maps.items() if mapped is not None]

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        _unmap(list(maps.values()))


@dataclass
class _Mapped:
    mapping: mmap.mmap
    view: np.ndarray  # [segment bytes] uint8, read-only unless writable
    file_id: tuple[int, int]  # (st_dev, st_ino) of the file mapped

    def still_at(self, path: str) -> bool:
        """Whether ``path`` is still the file mapped (not unlinked, nor replaced by another)."""
        try:
            status = os.stat(path)
        except OSError:
            return False
        return (status.st_dev, status.st_ino) == self.file_id


def _unmap(maps: list[_Mapped | None]) -> None:
    """Close mappings no view holds any more; the rest go with their last view."""
    while maps:
        mapped = maps.pop()
        if mapped is not None:
            mapping = mapped.mapping
            del mapped  # our own view of the whole segment would keep the mapping exported
            try:
                mapping.close()
            except BufferError:
                pass  # a caller still holds a view; the mapping goes with the last reference


def _map(path: str, writable: bool) -> _Mapped | None:
    """``path`` mapped whole, or None where it cannot be (or is a symbolic link, or no regular file)."""
    try:
        fd = os.open(path, (os.O_RDWR if writable else os.O_RDONLY) | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):  # a FIFO, a device: nothing a segment is
            return None
        # a writable map is the staging segment (small): populate its page tables now, not per write
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if writable else 0)
        mapping = mmap.mmap(fd, 0, flags=flags, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    except (OSError, ValueError):  # ValueError: an empty file
        return None
    finally:
        os.close(fd)
    return _Mapped(mapping, np.frombuffer(mapping, np.uint8), (status.st_dev, status.st_ino))
