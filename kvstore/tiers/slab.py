"""Slab allocator: fixed-size slots carved from fixed-size pages of one arena.

Pure bookkeeping over offsets; it never touches bytes. Each page, when first needed, is given to
one size class (slot size = payload rounded up to ``align``) and cut into equal slots. A page
whose last slot is freed goes back to the free pages, so a class that shrinks returns memory to
the others. No per-block malloc, no fragmentation beyond one partly used page per class::

    arena = | page 0 (class A: slot|slot|slot|waste) | page 1 (free) | page 2 (class B: ...) |
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

UNUSED_WARNING_FRACTION = 0.01  # less unused than this (an automatic capacity, say) is only INFO
PAGE_WASTE_WARNING_FRACTION = 0.10  # a block size that leaves more of each of its pages unused is warned of


@dataclass
class _SizeClass:
    slot_bytes: int
    free_slots: dict[int, list[int]] = field(default_factory=dict)  # page -> free offsets


class SlabAllocator:
    def __init__(self, capacity_bytes: int, page_bytes: int, align: int = 4096):
        assert page_bytes > 0 and align > 0 and page_bytes % align == 0, "page must be aligned"
        self.page_bytes = page_bytes
        self.align = align
        self.num_pages = capacity_bytes // page_bytes
        self.capacity_bytes = self.num_pages * page_bytes
        self._free_pages = list(range(self.num_pages - 1, -1, -1))  # pop() gives page 0 first
        self._page_class: list[int | None] = [None] * self.num_pages
        self._page_used = [0] * self.num_pages
        self._classes: dict[int, _SizeClass] = {}
        self.used_bytes = 0  # sum of allocated slot sizes

    def slot_bytes(self, nbytes: int) -> int:
        return -(-nbytes // self.align) * self.align

    def fits_in_page(self, nbytes: int) -> bool:
        return 0 < self.slot_bytes(nbytes) <= self.page_bytes

    def can_allocate(self, nbytes: int) -> bool:
        if not self.fits_in_page(nbytes):
            return False
        size_class = self._classes.get(self.slot_bytes(nbytes))
        return bool(self._free_pages) or bool(size_class and size_class.free_slots)

    def allocate(self, nbytes: int) -> int | None:
        """Offset of a free slot of at least ``nbytes``; None when none is free."""
        if not self.fits_in_page(nbytes):
            return None
        slot = self.slot_bytes(nbytes)
        size_class = self._classes.setdefault(slot, _SizeClass(slot))
        if not size_class.free_slots:
            if not self._free_pages:
                return None
            self._assign_page(self._free_pages.pop(), size_class)
        page, offsets = next(iter(size_class.free_slots.items()))
        offset = offsets.pop()
        if not offsets:
            del size_class.free_slots[page]
        self._page_used[page] += 1
        self.used_bytes += slot
        return offset

    def free(self, offset: int) -> None:
        page = offset // self.page_bytes
        slot = self._page_class[page]
        assert slot is not None and self._page_used[page] > 0, "free of an unallocated slot (bug)"
        size_class = self._classes[slot]
        assert (offset - page * self.page_bytes) % slot == 0, f"free of {offset}: not a slot start (bug)"
        assert offset not in size_class.free_slots.get(page, ()), f"double free of {offset} (bug)"
        self._page_used[page] -= 1
        self.used_bytes -= slot
        if self._page_used[page] == 0:
            size_class.free_slots.pop(page, None)
            self._page_class[page] = None
            self._free_pages.append(page)
        else:
            size_class.free_slots.setdefault(page, []).append(offset)

    def page_used(self, page: int) -> int:
        """Slots allocated in ``page``."""
        return self._page_used[page]

    def slot_class(self, offset: int) -> int | None:
        return self._page_class[offset // self.page_bytes]

    def _assign_page(self, page: int, size_class: _SizeClass) -> None:
        self._page_class[page] = size_class.slot_bytes
        base = page * self.page_bytes
        count = self.page_bytes // size_class.slot_bytes
        size_class.free_slots[page] = [base + i * size_class.slot_bytes for i in range(count - 1, -1, -1)]

    def check_integrity(self, allocated_offsets: list[int]) -> None:
        """Assert the books balance against the offsets the owner believes are allocated."""
        used = [0] * self.num_pages
        for offset in allocated_offsets:
            page = offset // self.page_bytes
            slot = self._page_class[page]
            assert slot is not None, f"offset {offset} lives in a free page"
            assert (offset - page * self.page_bytes) % slot == 0, f"offset {offset} is not a slot start"
            used[page] += 1
        assert used == self._page_used, "per-page used counts disagree with the owner's slots"
        free_pages = set(self._free_pages)
        assert len(free_pages) == len(self._free_pages), "a page is free twice"
        total_used = 0
        for page in range(self.num_pages):
            slot = self._page_class[page]
            if slot is None:
                assert page in free_pages and used[page] == 0, f"page {page} unassigned but not free"
                continue
            assert page not in free_pages, f"page {page} is both free and assigned"
            free_here = len(self._classes[slot].free_slots.get(page, ()))
            assert used[page] + free_here == self.page_bytes // slot, f"page {page}: used + free != slots"
            total_used += used[page] * slot
        assert total_used == self.used_bytes, "used bytes disagree with the slots in use"


def unused_capacity(what: str, asked_bytes: int, slab: SlabAllocator, page_knob: str = "") -> tuple[int, str] | None:
    """The log level and message telling an operator that ``asked_bytes`` is not a whole number of
    ``slab``'s pages (the rest goes unused); None when it is. WARNING when more than 1% goes unused.
    ``page_knob`` names the setting of the page size, where an operator has one."""
    used = slab.capacity_bytes
    if used == asked_bytes:
        return None
    unused = asked_bytes - used
    level = logging.WARNING if unused > asked_bytes * UNUSED_WARNING_FRACTION else logging.INFO
    return level, (f"{what} capacity {asked_bytes} bytes is not a whole number of its {slab.page_bytes}-byte pages: "
                   f"using {used} bytes, {unused} unused; {used} or {used + slab.page_bytes} would be used whole"
                   + (f" (or a {page_knob} that divides it)" if page_knob else ""))


def page_waste(what: str, slab: SlabAllocator, nbytes: int, page_knob: str) -> str | None:
    """A warning that blocks of ``nbytes`` leave more than PAGE_WASTE_WARNING_FRACTION of each page
    they take unused (a 34 MiB block on a 64 MiB page: 47%), naming the ``page_knob`` value that
    would leave none; None when they fit well (or not at all: that is refused elsewhere)."""
    slot = slab.slot_bytes(nbytes)
    per_page = slab.page_bytes // slot
    unused = slab.page_bytes - per_page * slot
    if not per_page or unused <= slab.page_bytes * PAGE_WASTE_WARNING_FRACTION:
        return None
    whole = slot * -(-slab.page_bytes // slot)
    return (f"{what}: blocks of {nbytes} bytes ({slot}-byte slots) fit {per_page} to a {slab.page_bytes}-byte page, "
            f"leaving {unused} bytes ({unused / slab.page_bytes:.0%}) of every page they take unused; "
            f"a {page_knob} of {whole} would hold {whole // slot} with none unused")
