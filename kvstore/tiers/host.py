"""Host tier: block payloads in one shared-memory segment of fixed-size slab slots.

The arena is a file under ``/dev/shm`` (any tmpfs directory), mapped into this process, so other
processes on the host can map the same bytes (the sidecar's zero-copy path): ``segment_path``
and ``slot_of(key)`` describe where a block lives. The index (key -> slot, meta) lives in the
owning process only. Payloads are copied with ``numpy.copyto`` (memcpy speed, GIL released).

This tier trusts DRAM: reads are not re-verified (the per-layer checksums travel with the block
so a lower tier, or a remote client committing into a slot, can verify).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Iterator

import numpy as np

from kvstore.errors import InvalidRequest, StoreClosed
from kvstore.tiers.base import BlockMeta, Tier, TierStats
from kvstore.tiers.shm_segment import Segment
from kvstore.tiers.slab import SlabAllocator, page_waste, unused_capacity

DEFAULT_PAGE_BYTES = 64 << 20
PAGE_ALIGN = 4096  # slots and pages start on 4 KiB boundaries

log = logging.getLogger(__name__)


class HostTier(Tier):
    """Blocks in slab slots of one shared-memory arena. ``capacity_bytes`` is used in whole pages of
    ``page_bytes`` (one page of the capacity when that is smaller; both rounded down to 4096): the
    rest goes unused, and a log line says how much. A page is also the largest block it holds."""

    name = "host"
    in_memory = True

    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int = DEFAULT_PAGE_BYTES,
        shm_dir: str | None = None,
        segment_name: str | None = None,
        prefault: bool = True,
    ):
        self._slab = _slab_for(capacity_bytes, page_bytes)
        self._page_is_capacity = page_bytes > capacity_bytes  # the capacity, not the page size, bounds a block
        self.capacity_bytes = self._slab.capacity_bytes
        # Prefault by default: a host tier is reserved memory anyway (see shm_segment.Segment).
        self._segment = Segment(self.capacity_bytes, shm_dir, name=segment_name, prefault=prefault)
        self.segment_path = self._segment.path
        self._arena = np.frombuffer(self._segment.mmap, dtype=np.uint8)  # [capacity] bytes
        self._index: dict[bytes, tuple[int, BlockMeta]] = {}
        self._on_page: dict[int, set[bytes]] = {}  # page -> its keys in _index
        self._reserved: dict[bytes, int] = {}  # key -> slot set aside for its write (``reserve``)
        self._copying: dict[bytes, int] = {}  # key -> slot its write is copying into (not yet readable)
        self._slot_sizes: set[int] = set()  # slot sizes allocated so far (each checked for waste once)
        self._lock = threading.Lock()
        self._bytes_read = 0
        self._bytes_read_lock = threading.Lock()  # reads run on many threads without ``_lock``
        self._bytes_written = 0
        self._closed = False

    @property
    def used_bytes(self) -> int:
        return self._slab.used_bytes

    def footprint(self, nbytes: int) -> int:
        return self._slab.slot_bytes(nbytes)

    def can_fit(self, nbytes: int) -> bool:
        with self._lock:
            return self._slab.can_allocate(nbytes)

    def max_block_bytes(self) -> int:
        return self._slab.page_bytes

    def max_block_remedy(self) -> str:
        if self._page_is_capacity:
            return "its whole capacity is one page: raise the capacity, --host-capacity or KVSTORE_HOST_CAPACITY"
        return "one page: raise the page size, KVSTORE_HOST_PAGE_BYTES"

    def eviction_helps(self, victim: bytes, nbytes: int) -> bool:
        entry = self._index.get(victim)
        return entry is not None and self._slab.slot_class(entry[0]) == self._slab.slot_bytes(nbytes)

    def page_of(self, key: bytes) -> int | None:
        entry = self._index.get(key)
        return None if entry is None else entry[0] // self._slab.page_bytes

    def page_residents(self, page: int) -> list[bytes] | None:
        with self._lock:
            keys = self._on_page.get(page, ())
            return list(keys) if keys and self._slab.page_used(page) == len(keys) else None

    def contains(self, key: bytes) -> bool:
        return key in self._index

    def meta(self, key: bytes) -> BlockMeta | None:
        entry = self._index.get(key)
        return entry[1] if entry else None

    def items(self) -> Iterator[tuple[bytes, BlockMeta]]:
        with self._lock:
            snapshot = [(key, meta) for key, (_, meta) in self._index.items()]
        return iter(snapshot)

    def slot_of(self, key: bytes) -> tuple[int, int] | None:
        """``(offset, nbytes)`` of a resident block inside ``segment_path``."""
        entry = self._index.get(key)
        return (entry[0], entry[1].nbytes) if entry else None

    def view(self, key: bytes) -> np.ndarray | None:
        """Zero-copy read-only view of a resident payload; valid while the caller pins the key."""
        entry = self._index.get(key)
        if entry is None:
            return None
        offset, meta = entry
        view = self._arena[offset : offset + meta.nbytes]
        view.flags.writeable = False
        return view

    def write(self, key: bytes, payload: np.ndarray, meta: BlockMeta) -> bool:
        self._check_open()
        assert payload.nbytes == meta.nbytes, "payload size disagrees with its meta (store bug)"
        with self._lock:
            assert key not in self._index and key not in self._copying, "duplicate host write (store bug)"
            offset = self._reserved.pop(key, None)  # the slot reserved for it, else a free one now
            if offset is None:
                offset = self._allocate(meta.nbytes)
                if offset is None:
                    return False
            assert self._slab.slot_class(offset) == self._slab.slot_bytes(meta.nbytes), "reserved for another size (bug)"
            self._copying[key] = offset
        try:
            np.copyto(self._arena[offset : offset + meta.nbytes], payload)
        except BaseException:
            with self._lock:
                del self._copying[key]
                if not self._closed:
                    self._slab.free(offset)
            raise
        with self._lock:
            del self._copying[key]
            self._index[key] = (offset, meta)
            self._on_page.setdefault(offset // self._slab.page_bytes, set()).add(key)
            self._bytes_written += meta.nbytes
        return True

    def reserve(self, key: bytes, nbytes: int) -> bool:
        """Take a slot for ``key`` now (``Tier.reserve``); ``write`` fills it."""
        self._check_open()
        with self._lock:
            assert key not in self._index and key not in self._reserved and key not in self._copying, \
                "duplicate host reservation (store bug)"
            offset = self._allocate(nbytes)
            if offset is None:
                return False
            self._reserved[key] = offset
            return True

    def _allocate(self, nbytes: int) -> int | None:
        """A free slot for ``nbytes``, or None; the first of a size warns where that size leaves
        much of each page unused. Caller holds the lock."""
        slot = self._slab.slot_bytes(nbytes)
        if slot not in self._slot_sizes:
            self._slot_sizes.add(slot)
            knob = "KVSTORE_HOST_CAPACITY (one page)" if self._page_is_capacity else "KVSTORE_HOST_PAGE_BYTES"
            if warning := page_waste("host tier", self._slab, nbytes, knob):
                log.warning(warning)
        return self._slab.allocate(nbytes)

    def unreserve(self, key: bytes) -> None:
        with self._lock:
            offset = self._reserved.pop(key, None)
            if offset is not None and not self._closed:
                self._slab.free(offset)

    def read(self, key: bytes, dst: np.ndarray, first_layer: int = 0, num_layers: int | None = None) -> bool:
        self._check_open()
        entry, arena = self._index.get(key), self._arena  # one look at the arena: close() unsets it
        if entry is None or arena is None:
            return False
        offset, meta = entry
        count = meta.num_layers - first_layer if num_layers is None else num_layers
        assert 0 <= first_layer and first_layer + count <= meta.num_layers, "layer range checked by the store (bug)"
        start = offset + first_layer * meta.layer_bytes
        np.copyto(dst, arena[start : start + count * meta.layer_bytes])
        with self._bytes_read_lock:
            self._bytes_read += dst.nbytes
        return True

    def remove(self, key: bytes) -> bool:
        self._check_open()
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return False
            page = entry[0] // self._slab.page_bytes
            self._on_page[page].discard(key)
            if not self._on_page[page]:
                del self._on_page[page]
            self._slab.free(entry[0])
            return True

    def check_integrity(self) -> None:
        with self._lock:
            offsets = ([offset for offset, _ in self._index.values()] + list(self._reserved.values())
                       + list(self._copying.values()))
            self._slab.check_integrity(offsets)
            assert len(set(offsets)) == len(offsets), "two blocks share a slot"
            by_page: dict[int, set[bytes]] = {}
            for key, (offset, _) in self._index.items():
                by_page.setdefault(offset // self._slab.page_bytes, set()).add(key)
            assert by_page == self._on_page, "the pages' resident keys disagree with the index"
            free = self.capacity_bytes - self._slab.used_bytes
            assert free >= 0 and free + self._slab.used_bytes == self.capacity_bytes

    def stats(self) -> TierStats:
        return TierStats(
            name=self.name,
            capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes,
            blocks=len(self._index),
            bytes_read=self._bytes_read,
            bytes_written=self._bytes_written,
            extra={"segment_path": self.segment_path, "page_bytes": self._slab.page_bytes},
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._index.clear()
        self._on_page.clear()
        self._arena = None
        self._segment.close()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("host tier is closed")


def host_capacity_problem(capacity_bytes: int) -> str | None:
    """Why a host tier cannot have ``capacity_bytes``, or None. Past the machine's memory it is
    refused before the slab: its page list alone could exhaust it."""
    if capacity_bytes < PAGE_ALIGN:
        return f"host tier capacity must be at least {PAGE_ALIGN} bytes (0 disables the tier), got {capacity_bytes}"
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if capacity_bytes > memory:
        return f"host tier capacity {capacity_bytes} bytes is more than this machine's memory ({memory} bytes)"
    return None


def _slab_for(capacity_bytes: int, page_bytes: int) -> SlabAllocator:
    """The slab over a host arena: pages of ``page_bytes`` (the capacity when smaller), both rounded
    down to 4096; a capacity that is not a whole number of pages loses the rest, and says so."""
    if page_bytes < PAGE_ALIGN:
        raise InvalidRequest(f"host tier page size must be at least {PAGE_ALIGN} bytes (KVSTORE_HOST_PAGE_BYTES), "
                             f"got {page_bytes}")
    if problem := host_capacity_problem(capacity_bytes):
        raise InvalidRequest(f"{problem}; --host-capacity or KVSTORE_HOST_CAPACITY")
    slab = SlabAllocator(capacity_bytes, min(page_bytes, capacity_bytes) // PAGE_ALIGN * PAGE_ALIGN)
    if note := unused_capacity("host tier", capacity_bytes, slab, "KVSTORE_HOST_PAGE_BYTES"):
        log.log(*note)
    return slab
