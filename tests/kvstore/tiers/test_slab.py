"""Slab allocator: exact offsets, page recycling across size classes, and books that balance."""

from __future__ import annotations

import logging
import random

import pytest

from kvstore.tiers.slab import SlabAllocator, unused_capacity

KIB = 1024
PAGE = 16 * KIB  # four 4 KiB slots per page in most tests


def test_geometry():
    slab = SlabAllocator(capacity_bytes=4 * PAGE + 123, page_bytes=PAGE)
    assert slab.num_pages == 4 and slab.capacity_bytes == 4 * PAGE  # the tail that is not a page is unused
    assert slab.slot_bytes(1) == 4 * KIB and slab.slot_bytes(4 * KIB) == 4 * KIB
    assert slab.slot_bytes(4 * KIB + 1) == 8 * KIB
    assert slab.fits_in_page(PAGE) and not slab.fits_in_page(PAGE + 1) and not slab.fits_in_page(0)
    with pytest.raises(AssertionError):
        SlabAllocator(PAGE, page_bytes=PAGE + 1)  # a page must be whole slots of align


def test_allocate_until_full():
    slab = SlabAllocator(capacity_bytes=2 * PAGE, page_bytes=PAGE)
    offsets = [slab.allocate(4 * KIB) for _ in range(8)]
    assert offsets == [i * 4 * KIB for i in range(8)]  # page 0 then page 1, slots in order
    assert slab.used_bytes == 2 * PAGE
    assert not slab.can_allocate(4 * KIB) and not slab.can_allocate(1)
    assert slab.allocate(4 * KIB) is None
    assert slab.allocate(PAGE) is None
    slab.check_integrity(offsets)


def test_allocate_refuses_what_cannot_fit_a_page():
    slab = SlabAllocator(capacity_bytes=2 * PAGE, page_bytes=PAGE)
    assert slab.allocate(PAGE + 1) is None
    assert slab.allocate(0) is None
    assert not slab.can_allocate(PAGE + 1)
    assert slab.used_bytes == 0
    slab.check_integrity([])


def test_size_classes_take_whole_pages():
    slab = SlabAllocator(capacity_bytes=3 * PAGE, page_bytes=PAGE)
    small = slab.allocate(100)  # 4 KiB class: page 0
    big = slab.allocate(10 * KIB)  # 12 KiB class: page 1, one slot, 4 KiB waste
    whole = slab.allocate(PAGE)  # 16 KiB class: page 2
    assert (small, big, whole) == (0, PAGE, 2 * PAGE)
    assert slab.slot_class(small) == 4 * KIB and slab.slot_class(big) == 12 * KIB and slab.slot_class(whole) == PAGE
    assert slab.used_bytes == 4 * KIB + 12 * KIB + PAGE
    assert slab.allocate(10 * KIB) is None  # its page is full and no page is free
    assert slab.allocate(4 * KIB) == 4 * KIB  # but page 0 has room for its class
    slab.check_integrity([small, big, whole, 4 * KIB])


def test_free_and_reuse():
    slab = SlabAllocator(capacity_bytes=PAGE, page_bytes=PAGE)
    offsets = [slab.allocate(4 * KIB) for _ in range(4)]
    slab.free(offsets[2])
    assert slab.used_bytes == 3 * 4 * KIB
    assert slab.can_allocate(4 * KIB)
    assert slab.allocate(4 * KIB) == offsets[2]
    slab.free(offsets[0])
    slab.free(offsets[3])
    assert sorted([slab.allocate(4 * KIB), slab.allocate(4 * KIB)]) == [offsets[0], offsets[3]]
    slab.check_integrity(offsets)


def test_emptied_page_returns_to_the_free_pages_and_serves_another_class():
    slab = SlabAllocator(capacity_bytes=PAGE, page_bytes=PAGE)
    offsets = [slab.allocate(4 * KIB) for _ in range(4)]
    assert not slab.can_allocate(8 * KIB) and slab.allocate(8 * KIB) is None
    for offset in offsets[:3]:
        slab.free(offset)
        assert slab.allocate(8 * KIB) is None  # the page still belongs to the 4 KiB class
    assert slab.slot_class(0) == 4 * KIB
    slab.free(offsets[3])
    assert slab.slot_class(0) is None and slab.used_bytes == 0
    slab.check_integrity([])
    assert slab.can_allocate(8 * KIB)
    assert [slab.allocate(8 * KIB), slab.allocate(8 * KIB)] == [0, 8 * KIB]
    assert slab.slot_class(0) == 8 * KIB
    assert slab.allocate(4 * KIB) is None
    slab.check_integrity([0, 8 * KIB])


def test_check_integrity_after_random_operations():
    rng = random.Random(20240601)
    align = 4 * KIB
    slab = SlabAllocator(capacity_bytes=16 * PAGE, page_bytes=PAGE, align=align)
    sizes = [1, 100, 4 * KIB, 4 * KIB + 1, 6000, 10 * KIB, PAGE, PAGE + 1]
    owned: dict[int, int] = {}  # offset -> slot bytes
    units = [False] * (slab.capacity_bytes // align)  # our own map of which 4 KiB units are taken
    allocations = refusals = 0
    for step in range(4000):
        if owned and (rng.random() < 0.45 or len(owned) > 40):
            offset = rng.choice(list(owned))
            slot = owned.pop(offset)
            slab.free(offset)
            for unit in range(offset // align, (offset + slot) // align):
                units[unit] = False
        else:
            nbytes = rng.choice(sizes)
            expect_room = slab.can_allocate(nbytes)
            offset = slab.allocate(nbytes)
            assert (offset is not None) == expect_room
            if offset is None:
                refusals += 1
                continue
            allocations += 1
            slot = slab.slot_bytes(nbytes)
            assert slot >= nbytes and slab.slot_class(offset) == slot
            assert offset % align == 0 and offset + slot <= slab.capacity_bytes
            assert offset // PAGE == (offset + slot - 1) // PAGE  # a slot never straddles pages
            for unit in range(offset // align, (offset + slot) // align):
                assert not units[unit], f"step {step}: slot at {offset} overlaps a live slot"
                units[unit] = True
            owned[offset] = slot
        assert slab.used_bytes == sum(owned.values())
        if step % 100 == 0:
            slab.check_integrity(list(owned))
    slab.check_integrity(list(owned))
    assert allocations > 1000 and refusals > 0  # both paths were exercised
    for offset in list(owned):
        slab.free(offset)
    slab.check_integrity([])
    assert slab.used_bytes == 0
    assert sorted(slab.allocate(PAGE) for _ in range(16)) == [i * PAGE for i in range(16)]  # every page came back
    assert slab.allocate(1) is None


def _populated() -> tuple[SlabAllocator, list[int]]:
    slab = SlabAllocator(capacity_bytes=4 * PAGE, page_bytes=PAGE)
    offsets = [slab.allocate(4 * KIB) for _ in range(3)] + [slab.allocate(8 * KIB)]
    assert offsets == [0, 4 * KIB, 8 * KIB, PAGE]
    slab.check_integrity(offsets)
    return slab, offsets


@pytest.mark.parametrize(
    "wrong",
    [
        [0, 4 * KIB, PAGE],  # one allocated slot missing
        [0, 4 * KIB, 8 * KIB, 12 * KIB, PAGE],  # a free slot claimed
        [0, 4 * KIB, 8 * KIB, PAGE, 2 * PAGE],  # an offset in a free page
        [0, 4 * KIB, 8 * KIB, PAGE + 4 * KIB],  # not the start of an 8 KiB slot
        [0, 0, 4 * KIB, 8 * KIB, PAGE],  # one slot twice
    ],
)
def test_check_integrity_fails_on_a_wrong_offset_list(wrong):
    slab, _ = _populated()
    with pytest.raises(AssertionError):
        slab.check_integrity(wrong)


def test_double_free_is_caught_at_the_free():
    slab, offsets = _populated()
    slab.free(offsets[0])
    with pytest.raises(AssertionError):
        slab.free(offsets[0])  # would otherwise return page 0 while two of its slots are live
    slab.check_integrity(offsets[1:])


def test_free_of_a_non_slot_offset_is_caught():
    slab, offsets = _populated()
    with pytest.raises(AssertionError):
        slab.free(PAGE + 4 * KIB)  # inside the 8 KiB slot at PAGE
    with pytest.raises(AssertionError):
        slab.free(3 * PAGE)  # a free page
    slab.check_integrity(offsets)


def test_a_capacity_that_is_not_whole_pages_is_named_with_what_is_used_and_a_warning_past_one_percent():
    assert unused_capacity("arena", 4 * PAGE, SlabAllocator(4 * PAGE, PAGE)) is None
    level, message = unused_capacity("arena", 5 * PAGE - 1, SlabAllocator(5 * PAGE - 1, PAGE), "PAGE_KNOB")
    assert level == logging.WARNING and message == (
        f"arena capacity {5 * PAGE - 1} bytes is not a whole number of its {PAGE}-byte pages: using {4 * PAGE} bytes, "
        f"{PAGE - 1} unused; {4 * PAGE} or {5 * PAGE} would be used whole (or a PAGE_KNOB that divides it)")
    level, _ = unused_capacity("arena", 200 * PAGE + 4 * KIB, SlabAllocator(200 * PAGE + 4 * KIB, PAGE))
    assert level == logging.INFO, "0.1% unused, as an automatic capacity leaves: no warning"
