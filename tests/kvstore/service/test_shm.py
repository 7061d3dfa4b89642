"""The same-host fast path end to end: GetSlots + a read-only mapping of the host tier's segment.

A real server on port 0 over a real host + disk store. Whether a block came through the mapping
or through Get shows in the host tier's ``loaded_blocks`` counter: only Get counts a load.
"""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest

from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.service import wire
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.service.shm import SegmentMaps, Slot, SlotGrant
from tests.conftest import payloads_for, tiny_namespace
from tests.kvstore.service.test_service import rpc_error

# Four 9,216-byte tiny blocks fill the host tier (12,288-byte slab slots): eviction is easy to cause.
FOUR_BLOCK_HOST = dict(host_bytes=4 * 12288, page_bytes=4 * 12288, disk_bytes=4 << 20)


def put_one_by_one(client, store, ns_id, hashes, payloads):
    """Each block a chain head of its own (every one an eviction candidate), written through before the next."""
    for block_hash, payload in zip(hashes, payloads):
        client.put(ns_id, [block_hash], [payload])
        store.flush()


def zeros(spec: BlockSpec, count: int) -> list[np.ndarray]:
    return [np.zeros(spec.block_bytes, np.uint8) for _ in range(count)]


def host_loads(client) -> int:
    return client.stats().tier("host").loaded_blocks


@pytest.fixture
def small(make_store, start_server):
    store = make_store(**FOUR_BLOCK_HOST)
    server = start_server(store)
    with KVStoreClient(server.target, timeout_s=30) as client:
        yield store, client


def test_fast_path_get_is_byte_exact_and_moves_no_bytes_through_grpc(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:5])
    client.put(ns_id, chain[:5], payloads)
    dsts = zeros(spec, 6)
    result = client.load_shm(ns_id, chain[:6], dsts, verify=True)
    assert result.tiers == ("host",) * 5 and result.requested_blocks == 6 and result.nbytes == 5 * spec.block_bytes
    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
    assert not dsts[5].any(), "a block past the hit is untouched"
    stats = client.stats()
    # the client copied from the mapping: the tier itself read nothing, yet the reads were recorded
    assert stats.tier("host").bytes_read == 0, "every block came through the mapping"
    assert stats.tier("host").loaded_blocks == 5, "shared-memory reads count as loads (record_access)"
    assert stats.leases_active == 0, "the lease was released"


def test_fast_path_at_v32_block_size(client):
    namespace = Namespace(model="deepseek-v3.2", model_config_hash="cfg", num_layers=61,
                          components=("mla_fp8_ds", "indexer_fp8"), block_size=64)
    spec = BlockSpec.of(namespace)
    assert spec.block_bytes == 3_076_352
    hashes = [bytes([i]) * 16 for i in range(1, 4)]
    ns_id = client.register_namespace(namespace)
    payloads = payloads_for(spec, hashes)
    client.put(ns_id, hashes, payloads)
    dsts = zeros(spec, 3)
    assert client.load_shm(ns_id, hashes, dsts).tiers == ("host",) * 3
    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))


def test_slots_stay_put_until_the_lease_is_released(small, namespace, spec, chain):
    store, client = small
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:1], payloads_for(spec, chain[:1]))
    grant = client.get_slots(ns_id, chain[:1], lease_ttl_s=30)
    assert grant.hit_blocks == 1 and len(grant.slots) == 1 and grant.lease_id is not None
    assert grant.segment_path == store.tiers[0].segment_path
    put_one_by_one(client, store, ns_id, chain[1:8], payloads_for(spec, chain[1:8]))  # twice the host tier
    assert client.stats().tier("host").evictions >= 4, "the host tier was full and evicted"
    assert store.tiers[0].slot_of(ns_id + chain[0]) == (grant.slots[0].offset, grant.slots[0].nbytes)
    with open(grant.segment_path, "rb") as segment:
        segment.seek(grant.slots[0].offset)
        assert segment.read(spec.block_bytes) == payloads_for(spec, chain[:1])[0].tobytes(), "its bytes are intact"
    assert client.release_grant(grant, copied_blocks=0)  # no copy taken: no access for the policy
    put_one_by_one(client, store, ns_id, chain[8:9], payloads_for(spec, chain[8:9]))
    assert not store.tiers[0].contains(ns_id + chain[0]), "released, the least recently used block goes first"
    store.check_integrity()


def test_blocks_only_on_disk_come_through_get(small, namespace, spec, chain):
    store, client = small
    ns_id = client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:8])
    put_one_by_one(client, store, ns_id, chain[:8], payloads)  # host keeps the last four; disk has all eight
    client.load(ns_id, chain[:2], zeros(spec, 2))  # promotes blocks 0 and 1 back into the host tier
    assert client.lookup(ns_id, chain[:4]).tiers == ("host", "host", "disk", "disk")
    before = client.stats().tier("disk").loaded_blocks
    dsts = zeros(spec, 4)
    result = client.load_shm(ns_id, chain[:4], dsts)
    assert result.tiers == ("host", "host", "disk", "disk")
    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
    stats = client.stats()
    assert stats.tier("disk").loaded_blocks - before == 2 and stats.leases_active == 0
    store.flush()
    store.check_integrity()


def test_a_segment_that_cannot_be_mapped_falls_back_to_get(store, client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:3])
    client.put(ns_id, chain[:3], payloads)
    path = store.tiers[0].segment_path
    os.rename(path, path + ".elsewhere")  # as seen from another container: no such file
    try:
        dsts = zeros(spec, 3)
        assert client.load_shm(ns_id, chain[:3], dsts).tiers == ("host",) * 3
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
        stats = client.stats()
        assert stats.tier("host").bytes_read == sum(p.nbytes for p in payloads[:3]), "every block came through Get"
        assert stats.leases_active == 0
    finally:
        os.rename(path + ".elsewhere", path)


def test_a_hit_too_long_for_one_message_gets_the_slots_that_fit_and_the_rest_through_get(make_store, start_server):
    namespace = tiny_namespace(num_layers=61, block_size=1)  # 61 checksums a slot, as DeepSeek V3's
    spec = BlockSpec.of(namespace)
    fit = 5
    # room for five slots: the old server sent all sixteen and failed the call on its own send limit
    limits = ServiceLimits(max_chunk_bytes=4 << 10, max_message_bytes=wire.SLOTS_MARGIN_BYTES + fit * (30 + 610) + 100)
    store = make_store(host_bytes=32 << 20, page_bytes=4 << 20, disk_bytes=64 << 20)
    server = start_server(store, limits)
    hashes = namespace_hashes(namespace, np.arange(16))
    with KVStoreClient(server.target, timeout_s=30, limits=limits) as client:
        ns_id = client.register_namespace(namespace)
        payloads = payloads_for(spec, hashes)
        client.put(ns_id, hashes, payloads)
        grant = client.get_slots(ns_id, hashes, 30.0)
        assert (grant.hit_blocks, len(grant.slots)) == (16, fit)
        client.release_grant(grant, 0)
        dsts = zeros(spec, 16)
        result = client.load_shm(ns_id, hashes, dsts, verify=True)
        assert result.tiers == ("host",) * 16
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
        assert client.stats().tier("host").bytes_read == 11 * spec.block_bytes, "the eleven past the slots came by Get"


@pytest.mark.parametrize("num_layers", [1, 2, 61, 200])
def test_slots_that_fit_bounds_a_response_of_the_largest_values(num_layers):
    limit = 64 << 10
    count = wire.slots_that_fit(limit, num_layers)
    slot = Slot(offset=2**64 - 1, nbytes=2**64 - 1, layer_checksums=(2**64 - 1,) * num_layers)
    grant = SlotGrant(2**31, 2**31, "/dev/shm/" + "x" * 246, (slot,) * count, 2**63 - 1, True, 2**62,
                      b"\xff" * 64, 65535)
    size = wire.slots_to_proto(grant).ByteSize()
    assert 0.85 * (limit - wire.SLOTS_MARGIN_BYTES) < size <= limit, "within the limit, and not far below it"


def test_a_miss_takes_no_lease_and_a_bad_ttl_is_invalid(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    dsts = zeros(spec, 2)
    assert client.load_shm(ns_id, chain[:2], dsts).loaded_blocks == 0
    assert client.stats().leases_active == 0
    error = rpc_error(client.get_slots, ns_id, chain[:1], lease_ttl_s=0)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease_ttl_s must be in (0, 3600] seconds" in error.details()


def test_wrong_buffer_size_is_invalid_and_releases_the_lease(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:1], payloads_for(spec, chain[:1]))
    with pytest.raises(Exception, match="destination buffer has 9215 bytes, expected exactly 9216"):
        client.load_shm(ns_id, chain[:1], [np.zeros(spec.block_bytes - 1, np.uint8)])
    assert client.stats().leases_active == 0


def test_a_release_that_fails_after_the_copy_failed_leaves_the_copys_error_to_raise(client, namespace, spec, chain,
                                                                                   monkeypatch):
    """Until session 34 a Release failing in load_shm's clean-up (the sidecar gone) raised instead
    of the error that made the load fail."""
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))

    class Gone(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

    def copy_fails(*args):
        raise MemoryError("the copy failed")

    def release_fails(*args, **kwargs):
        raise Gone()

    monkeypatch.setattr(client, "_copy_slots", copy_fails)
    monkeypatch.setattr(client._stub, "Release", release_fails)
    with pytest.raises(MemoryError, match="the copy failed"):
        client.load_shm(ns_id, chain[:2], [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)])


def test_verify_never_reports_a_block_that_still_fails_its_checksums_after_get(client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:4])
    client.put(ns_id, chain[:4], payloads)
    grant = client.get_slots(ns_id, chain[:4])
    assert client.release_grant(grant, copied_blocks=0)
    with open(grant.segment_path, "r+b") as arena:  # a same-uid process scribbles over block 2 in the host tier
        arena.seek(grant.slots[2].offset)
        arena.write(b"\x5a" * 64)

    dsts = zeros(spec, 4)
    result = client.load_shm(ns_id, chain[:4], dsts, verify=True)
    assert result.tiers == ("host",) * 2, "Get served block 2's bad bytes again: a miss, not a hit"
    assert all(np.array_equal(d, p) for d, p in zip(dsts[:2], payloads[:2]))
    assert client.load_shm(ns_id, chain[:2], zeros(spec, 2), verify=True).tiers == ("host",) * 2


def test_a_new_segment_path_unmaps_the_old_one(tmp_path):
    """A restarted sidecar names a new arena: the client must not keep the dead one mapped."""
    old, new = str(tmp_path / "kvstore-1-0000aaaa"), str(tmp_path / "kvstore-2-0000bbbb")
    for path in (old, new):
        with open(path, "wb") as f:
            f.truncate(1 << 20)
    maps = SegmentMaps()
    try:
        view = maps.slot(old, 0, 4096)
        assert view is not None and old in _mapped_files()
        del view
        assert maps.slot(new, 4096, 4096) is not None
        assert maps.mapped_paths() == [new]
        assert old not in _mapped_files() and new in _mapped_files()
    finally:
        maps.close()
    assert new not in _mapped_files()


def test_drop_unlinked_unmaps_files_removed_or_replaced_and_keeps_the_rest(tmp_path):
    """A sidecar killed with SIGKILL hands out no new path; its successor's start unlinks the old
    arena, whose memory stays allocated while a client maps it (a small /dev/shm then has no
    room for the successor's)."""
    kept, removed = (str(tmp_path / f"kvstore-{i}-0000aaaa") for i in (1, 2))
    replaced = str(tmp_path / "kvstore-staging-3-0000aaaa")
    for path in (kept, removed, replaced):
        with open(path, "wb") as f:
            f.truncate(1 << 20)
    maps, staging, other = SegmentMaps(), SegmentMaps(writable=True), SegmentMaps()  # one path each
    try:
        assert maps.slot(kept, 0, 4096) is not None and other.slot(removed, 0, 4096) is not None
        assert staging.slot(replaced, 0, 4096) is not None
        os.unlink(removed)
        os.unlink(replaced)
        with open(replaced, "wb") as f:  # a new file at the old name: not the one mapped
            f.truncate(1 << 20)
        assert maps.drop_unlinked() == [] and maps.mapped_paths() == [kept]
        assert (other.drop_unlinked(), staging.drop_unlinked()) == ([removed], [replaced])
        assert other.mapped_paths() == staging.mapped_paths() == [] and removed not in _mapped_files()
        assert staging.slot(replaced, 0, 4096) is not None, "the new file maps afresh"
    finally:
        for segment_maps in (maps, staging, other):
            segment_maps.close()


def test_a_path_from_the_sidecar_is_mapped_only_as_a_segment_of_its_kind(tmp_path):
    """The path comes in the sidecar's answer. Before session 34 a client mapped whatever it named,
    the staging one read-write: a rogue or spoofed sidecar could write into any file the client's
    user may write, or read any it may read into an engine's KV buffers."""
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"keep me" * 1000)
    arena, staging_file = tmp_path / "kvstore-7-0000cccc", tmp_path / "kvstore-staging-7-0000cccc"
    for path in (arena, staging_file):
        path.write_bytes(bytes(8192))
    linked = tmp_path / "kvstore-staging-8-0000dddd"
    linked.symlink_to(victim)
    fifo = tmp_path / "kvstore-staging-9-0000eeee"
    os.mkfifo(fifo)
    reader, writer = SegmentMaps(), SegmentMaps(writable=True)
    try:
        assert writer.slot(str(victim), 0, 4096) is None and reader.slot(str(victim), 0, 4096) is None
        assert writer.slot(str(linked), 0, 4096) is None, "a symbolic link named as a segment"
        assert writer.slot(str(fifo), 0, 4096) is None, "a FIFO named as a segment (and no hang opening it)"
        assert writer.slot(str(arena), 0, 4096) is None, "the writable maps take staging segments only"
        assert reader.slot(str(staging_file), 0, 4096) is None, "the read-only maps take arenas only"
        assert reader.slot(str(arena), 0, 4096) is not None and writer.slot(str(staging_file), 0, 4096) is not None
    finally:
        reader.close()
        writer.close()
    assert victim.read_bytes() == b"keep me" * 1000


def _mapped_files() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


BATCHED = dict(max_transfer_blocks=4)  # the 10-block chain takes three Get calls


@pytest.mark.parametrize("shared_memory", [True, False])
def test_load_shm_batches_its_get_when_the_lease_expired_before_release(make_store, start_server, namespace, spec,
                                                                        chain, shared_memory):
    """The lease lapses before the copies are released, so every block comes through Get: in calls
    of at most max_transfer_blocks, as ``load_shm`` batches its tail (one Get of all ten once
    answered RESOURCE_EXHAUSTED)."""
    server = start_server(make_store(host_bytes=1 << 20), ServiceLimits(**BATCHED))
    with KVStoreClient(server.target, timeout_s=30, limits=ServiceLimits(**BATCHED),
                       shared_memory=shared_memory) as client:
        ns_id = client.register_namespace(namespace)
        payloads = payloads_for(spec, chain)
        for start in range(0, len(chain), 4):
            client.put(ns_id, chain[start : start + 4], payloads[start : start + 4], parent=chain[start - 1] if start else None)
        dsts = zeros(spec, len(chain))
        result = client.load_shm(ns_id, chain, dsts, lease_ttl_s=1e-4)
        assert result.tiers == ("host",) * 10 and result.nbytes == 10 * spec.block_bytes
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))


def test_load_shm_batches_its_get_when_the_store_refuses_the_lease(make_store, start_server, namespace, spec, chain):
    store = make_store(host_bytes=1 << 20, max_leases=1)
    server = start_server(store, ServiceLimits(**BATCHED))
    with KVStoreClient(server.target, timeout_s=30, limits=ServiceLimits(**BATCHED)) as client:
        ns_id = client.register_namespace(namespace)
        payloads = payloads_for(spec, chain)
        for start in range(0, len(chain), 4):
            client.put(ns_id, chain[start : start + 4], payloads[start : start + 4], parent=chain[start - 1] if start else None)
        held = client.lookup(ns_id, chain[:1], lease_ttl_s=60)  # the store's only lease
        assert client.get_slots(ns_id, chain).lease_refused
        dsts = zeros(spec, len(chain))
        result = client.load_shm(ns_id, chain, dsts)
        assert result.tiers == ("host",) * 10 and result.nbytes == 10 * spec.block_bytes
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
        client.release(held.lease_id)
