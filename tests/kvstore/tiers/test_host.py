"""Host tier: shared-memory slab slots, byte-exact, no self-eviction, visible to other processes."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvstore.checksum import layer_checksums
from kvstore.errors import InvalidRequest, StoreClosed
from kvstore.tiers.base import BlockMeta
from kvstore.tiers.host import HostTier

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PAGE = 4096


def key_of(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=32).digest()


def block(i: int, nbytes: int, num_layers: int, parent: bytes | None = None) -> tuple[np.ndarray, BlockMeta]:
    payload = np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8)
    return payload, BlockMeta(nbytes, num_layers, layer_checksums(payload, num_layers), parent)


@pytest.fixture
def tiers(tmp_path):
    made = []

    def make(capacity: int, page_bytes: int = 64 << 10, **kw) -> HostTier:
        tier = HostTier(capacity, page_bytes=page_bytes, shm_dir=str(tmp_path), **kw)
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()
    assert os.listdir(tmp_path) == [], "a host segment file leaked"


def test_segment_lives_in_shm_dir_with_capacity_size(tiers, tmp_path):
    tier = tiers(1 << 20)
    assert os.path.dirname(tier.segment_path) == str(tmp_path)
    assert os.path.getsize(tier.segment_path) == tier.capacity_bytes == 1 << 20
    stats = tier.stats()
    assert stats.extra["segment_path"] == tier.segment_path
    assert (stats.used_bytes, stats.blocks) == (0, 0)
    tier.check_integrity()


def test_two_tiers_get_distinct_segments_and_named_segment_is_exclusive(tiers, tmp_path):
    a, b = tiers(1 << 16), tiers(1 << 16)
    assert a.segment_path != b.segment_path
    named = tiers(1 << 16, segment_name="kv-test-seg")
    assert named.segment_path == str(tmp_path / "kv-test-seg")
    with pytest.raises(FileExistsError):
        HostTier(1 << 16, page_bytes=1 << 16, shm_dir=str(tmp_path), segment_name="kv-test-seg")


def test_capacity_below_a_page_is_rejected(tmp_path):
    with pytest.raises(InvalidRequest):
        HostTier(1000, shm_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_page_size_below_4096_is_refused_as_the_page_size_not_the_capacity(tmp_path):
    """KVSTORE_HOST_PAGE_BYTES=0 was refused as "capacity must be at least 4096 bytes, got 8388608"."""
    for page_bytes in (0, 4095):
        with pytest.raises(InvalidRequest, match=f"host tier page size must be at least 4096 bytes "
                                                 f".KVSTORE_HOST_PAGE_BYTES., got {page_bytes}$"):
            HostTier(1 << 20, page_bytes=page_bytes, shm_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_a_block_too_large_for_the_tier_is_refused_naming_the_limit_that_binds(tiers):
    """Before, every refusal said "raise its page size", also where the capacity was the limit."""
    block_bytes, layers = 589824, 8
    by_capacity = tiers(512 << 10, page_bytes=128 << 20)  # the whole capacity is one page
    assert by_capacity.refusal(block_bytes, layers) == (
        "the host tier holds at most 524288 bytes per block (its whole capacity is one page: raise the capacity, "
        "--host-capacity or KVSTORE_HOST_CAPACITY)")
    by_page = tiers(1 << 20, page_bytes=256 << 10)
    assert by_page.refusal(block_bytes, layers) == (
        "the host tier holds at most 262144 bytes per block (one page: raise the page size, KVSTORE_HOST_PAGE_BYTES)")
    assert tiers(1 << 20, page_bytes=1 << 20).refusal(block_bytes, layers) is None


def test_a_capacity_not_a_whole_number_of_pages_says_what_it_uses(tiers, caplog):
    """100 MiB in 64 MiB pages was 64 MiB without a word; now a warning names the capacity used
    and the nearest that would be used whole. Less than 1% unused (the automatic capacity) is INFO."""
    caplog.set_level(logging.INFO, logger="kvstore.tiers.host")
    assert tiers(100 << 10, page_bytes=64 << 10).capacity_bytes == 64 << 10
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [(
        "WARNING", "host tier capacity 102400 bytes is not a whole number of its 65536-byte pages: using 65536 "
                   "bytes, 36864 unused; 65536 or 131072 would be used whole (or a KVSTORE_HOST_PAGE_BYTES that divides it)")]
    caplog.clear()
    assert tiers((200 << 16) + 4096, page_bytes=64 << 10).capacity_bytes == 200 << 16
    assert [r.levelname for r in caplog.records] == ["INFO"]
    caplog.clear()
    assert tiers(4 << 16, page_bytes=64 << 10).capacity_bytes == 4 << 16
    assert caplog.records == []


def test_a_block_size_that_leaves_much_of_its_pages_unused_is_warned_of_once_with_a_page_size_that_would_not(
        tiers, caplog):
    """A 34 KiB block on a 64 KiB page took a page each and left 30 KiB (47%) of it unused without a word."""
    caplog.set_level(logging.WARNING, logger="kvstore.tiers.host")
    tier = tiers(256 << 10, page_bytes=64 << 10)
    for i in range(3):
        tier.write(key_of(i), *block(i, 34 << 10, 2))
    assert tier.reserve(key_of(3), 34 << 10)
    assert [r.getMessage() for r in caplog.records] == [
        "host tier: blocks of 34816 bytes (36864-byte slots) fit 1 to a 65536-byte page, leaving 28672 bytes (44%) "
        "of every page they take unused; a KVSTORE_HOST_PAGE_BYTES of 73728 would hold 2 with none unused"]
    caplog.clear()
    for i, nbytes in ((10, 16 << 10), (11, 20 << 10)):  # 4 to a page: none unused; 3 to a page: 4 KiB, 6%
        tier.unreserve(key_of(3))
        tier.remove(key_of(i - 10))
        tier.write(key_of(i), *block(i, nbytes, 2))
    assert caplog.records == [], "sizes that fit their pages well say nothing"


def test_write_read_whole_block_and_single_layers(tiers):
    tier = tiers(1 << 20)
    num_layers, nbytes = 6, 6 * 1500
    blocks = {key_of(i): block(i, nbytes, num_layers, parent=key_of(i - 1) if i else None) for i in range(10)}
    for key, (payload, meta) in blocks.items():
        assert tier.write(key, payload, meta)
    assert tier.stats().blocks == 10
    assert tier.stats().bytes_written == 10 * nbytes
    layer = nbytes // num_layers
    for key, (payload, meta) in blocks.items():
        assert tier.contains(key)
        assert tier.meta(key) == meta
        dst = np.zeros(nbytes, np.uint8)
        assert tier.read(key, dst)
        assert np.array_equal(dst, payload)
        for first in range(num_layers):
            one = np.zeros(layer, np.uint8)
            assert tier.read(key, one, first_layer=first, num_layers=1)
            assert np.array_equal(one, payload[first * layer : (first + 1) * layer])
        tail = np.zeros(3 * layer, np.uint8)
        assert tier.read(key, tail, first_layer=3)  # num_layers None: to the last layer
        assert np.array_equal(tail, payload[3 * layer :])
        view = tier.view(key)
        assert view is not None and not view.flags.writeable
        assert np.array_equal(view, payload)
    assert dict(tier.items()) == {k: m for k, (_, m) in blocks.items()}
    tier.check_integrity()


def test_miss_and_unknown_key(tiers):
    tier = tiers(1 << 16)
    dst = np.zeros(100, np.uint8)
    assert not tier.read(key_of(1), dst)
    assert (dst == 0).all()
    assert tier.meta(key_of(1)) is None and tier.view(key_of(1)) is None and tier.slot_of(key_of(1)) is None
    assert not tier.remove(key_of(1))
    assert not tier.contains(key_of(1))


def test_payload_is_copied_not_aliased(tiers):
    tier = tiers(1 << 16)
    payload, meta = block(1, 5000, 1)
    original = payload.copy()
    assert tier.write(key_of(1), payload, meta)
    payload[:] = 0  # the caller reuses its buffer
    dst = np.empty(5000, np.uint8)
    assert tier.read(key_of(1), dst)
    assert np.array_equal(dst, original)


def test_write_returns_false_when_full_and_never_evicts(tiers):
    # 4 pages of 16 KiB; an 8000-byte block takes an 8 KiB slot: exactly 8 blocks fit
    tier = tiers(4 * 16384, page_bytes=16384)
    blocks = [block(i, 8000, 2) for i in range(9)]
    for i in range(8):
        assert tier.can_fit(8000)
        assert tier.write(key_of(i), *blocks[i])
    assert tier.used_bytes == tier.capacity_bytes
    assert not tier.can_fit(8000)
    assert not tier.write(key_of(8), *blocks[8])
    assert not tier.contains(key_of(8))
    # nothing was evicted to make room
    assert tier.stats().blocks == 8
    for i in range(8):
        dst = np.empty(8000, np.uint8)
        assert tier.read(key_of(i), dst) and np.array_equal(dst, blocks[i][0])
    tier.check_integrity()
    # a payload bigger than a page never fits, whatever is free
    big, big_meta = block(99, 16384 + 1, 1)
    assert tier.max_block_bytes() == 16384
    assert not tier.write(key_of(99), big, big_meta)
    tier.check_integrity()


def test_remove_frees_space(tiers):
    tier = tiers(4 * 16384, page_bytes=16384)
    blocks = [block(i, 8000, 2) for i in range(9)]
    for i in range(8):
        assert tier.write(key_of(i), *blocks[i])
    assert not tier.write(key_of(8), *blocks[8])
    assert tier.eviction_helps(key_of(3), 8000)
    assert tier.remove(key_of(3))
    assert not tier.remove(key_of(3))
    assert not tier.contains(key_of(3))
    assert tier.used_bytes == 7 * 8192
    assert tier.can_fit(8000)
    assert tier.write(key_of(8), *blocks[8])
    dst = np.empty(8000, np.uint8)
    assert tier.read(key_of(8), dst) and np.array_equal(dst, blocks[8][0])
    tier.check_integrity()


def test_emptied_pages_return_to_other_size_classes(tiers):
    tier = tiers(4 * 16384, page_bytes=16384)
    small = [block(i, 4000, 1) for i in range(16)]  # 4 KiB slots: 16 fill every page
    for i, (payload, meta) in enumerate(small):
        assert tier.write(key_of(i), payload, meta)
    big, big_meta = block(100, 16000, 4)
    assert not tier.can_fit(16000)
    assert not tier.eviction_helps(key_of(0), 16000)  # a 4 KiB slot cannot hold a 16 KiB block
    assert not tier.write(key_of(100), big, big_meta)
    for i in range(4):  # empty exactly one page (page 0 got slots 0..3)
        assert tier.remove(key_of(i))
    assert tier.can_fit(16000)
    assert tier.write(key_of(100), big, big_meta)
    dst = np.empty(16000, np.uint8)
    assert tier.read(key_of(100), dst) and np.array_equal(dst, big)
    for i in range(4, 16):
        dst = np.empty(4000, np.uint8)
        assert tier.read(key_of(i), dst) and np.array_equal(dst, small[i][0])
    tier.check_integrity()


_CHILD = r"""
import hashlib, json, mmap, sys
import numpy as np
path, slots = sys.argv[1], json.loads(sys.argv[2])
with open(path, "r+b") as f:
    m = mmap.mmap(f.fileno(), 0)
arena = np.frombuffer(m, dtype=np.uint8)
out = {k: hashlib.sha256(arena[o : o + n].tobytes()).hexdigest() for k, (o, n) in slots.items()}
# write into a slot the parent has not filled yet, to show the mapping is shared both ways
o, n = json.loads(sys.argv[3])
arena[o : o + n] = 0xAB
m.flush()
print(json.dumps(out))
"""


def test_second_process_maps_the_same_bytes(tiers):
    tier = tiers(1 << 20, page_bytes=1 << 18)
    blocks = {key_of(i): block(i, 3000 + 4096 * (i % 3), 1) for i in range(6)}  # three slot classes
    for key, (payload, meta) in blocks.items():
        assert tier.write(key, payload, meta)
    slots = {key.hex(): tier.slot_of(key) for key in blocks}
    for key, (payload, meta) in blocks.items():
        offset, nbytes = tier.slot_of(key)
        assert nbytes == meta.nbytes and offset % PAGE == 0
    # a slot that is still free: the parent writes it afterwards and must see the child's bytes first
    spare_key = key_of(50)
    spare_payload, spare_meta = block(50, 3000, 1)
    assert tier.write(spare_key, spare_payload, spare_meta)
    spare = tier.slot_of(spare_key)
    result = subprocess.run(
        [sys.executable, "-c", _CHILD, tier.segment_path, json.dumps(slots), json.dumps(list(spare))],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO},
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {key.hex(): hashlib.sha256(payload.tobytes()).hexdigest() for key, (payload, _) in blocks.items()}
    view = tier.view(spare_key)
    assert (view == 0xAB).all()  # the child's store landed in our mapping: same physical bytes


def test_integrity_holds_after_random_operations(tiers):
    rng = np.random.default_rng(1234)
    tier = tiers(24 * 16384, page_bytes=16384)
    sizes = [100, 4096, 4097, 7000, 12000, 16384]
    resident: dict[bytes, np.ndarray] = {}
    next_id = 0
    for step in range(600):
        if resident and (rng.random() < 0.4 or not tier.can_fit(16384)):
            key = list(resident)[rng.integers(len(resident))]
            assert tier.remove(key)
            del resident[key]
        else:
            nbytes = int(sizes[rng.integers(len(sizes))])
            payload, meta = block(next_id, nbytes, 1)
            key = key_of(next_id)
            next_id += 1
            fits = tier.can_fit(nbytes)
            ok = tier.write(key, payload, meta)
            assert ok == fits
            if ok:
                resident[key] = payload
        tier.check_integrity()
        assert tier.used_bytes == sum(tier.footprint(p.nbytes) for p in resident.values())
        assert tier.used_bytes <= tier.capacity_bytes
    assert tier.stats().blocks == len(resident) > 0
    offsets = []
    for key, payload in resident.items():
        dst = np.empty(payload.nbytes, np.uint8)
        assert tier.read(key, dst) and np.array_equal(dst, payload)
        offset, nbytes = tier.slot_of(key)
        offsets.append((offset, offset + tier.footprint(nbytes)))
    offsets.sort()
    assert all(a[1] <= b[0] for a, b in zip(offsets, offsets[1:])), "two slots overlap"


def test_a_new_host_tier_removes_the_arena_of_a_sigkilled_in_process_store_and_keeps_live_ones(tiers, tmp_path):
    """An engine with an in-process store (no sidecar) killed with SIGKILL cannot unlink its arena;
    before, only ``kvstore serve`` swept, so every such crash leaked a whole prefaulted arena."""
    live = tiers(1 << 16, page_bytes=1 << 16)  # this process's: its lock holds, even against itself
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from kvstore.config import StoreConfig
        store = StoreConfig.from_env({{"KVSTORE_HOST_CAPACITY": "1MiB", "KVSTORE_DISK_CAPACITY": "0",
                                      "KVSTORE_SHM_DIR": {str(tmp_path)!r}}}).open_store()
        print(store.tiers[0].segment_path, flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": REPO})
    try:
        dead = child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait(10)
    assert os.path.exists(dead), "SIGKILL left the arena behind"
    fresh = tiers(1 << 16, page_bytes=1 << 16)
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(t.segment_path) for t in (live, fresh))


def test_close_unlinks_segment_and_later_operations_raise(tmp_path):
    tier = HostTier(1 << 16, page_bytes=1 << 16, shm_dir=str(tmp_path))
    payload, meta = block(1, 1000, 1)
    assert tier.write(key_of(1), payload, meta)
    path = tier.segment_path
    assert os.path.exists(path)
    tier.close()
    assert not os.path.exists(path)
    assert os.listdir(tmp_path) == []
    with pytest.raises(StoreClosed):
        tier.write(key_of(2), *block(2, 1000, 1))
    with pytest.raises(StoreClosed):
        tier.read(key_of(1), np.empty(1000, np.uint8))
    with pytest.raises(StoreClosed):
        tier.remove(key_of(1))
    tier.close()  # idempotent


def test_a_read_that_close_overtakes_after_its_check_is_a_miss(tmp_path):
    """A read past its open check whose block entry was found just before close() unset the arena
    raised TypeError (slicing None); reads take no lock, so this is a real interleaving."""
    tier = HostTier(1 << 16, page_bytes=1 << 16, shm_dir=str(tmp_path))
    payload, meta = block(1, 1000, 1)
    assert tier.write(key_of(1), payload, meta)

    class ClosedAfterTheLookup(dict):
        def get(self, key, default=None):
            found = super().get(key, default)
            tier.close()  # closes between the entry's lookup and the copy
            return found

    tier._index = ClosedAfterTheLookup(tier._index)
    assert not tier.read(key_of(1), np.empty(1000, np.uint8))


def test_close_with_an_outstanding_view_still_unlinks(tmp_path):
    tier = HostTier(1 << 16, page_bytes=1 << 16, shm_dir=str(tmp_path))
    payload, meta = block(1, 1000, 1)
    assert tier.write(key_of(1), payload, meta)
    view = tier.view(key_of(1))
    tier.close()
    assert not os.path.exists(tier.segment_path)
    assert np.array_equal(view, payload)  # the mapping lives as long as the view
