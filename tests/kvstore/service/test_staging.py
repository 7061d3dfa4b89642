"""Same-host puts through the staging segment: reserve, write, commit; verified before visible."""

from __future__ import annotations

import mmap
import os
import threading
import time

import grpc
import numpy as np
import pytest

from kvstore.checksum import layer_checksums
from kvstore.errors import InvalidRequest, UnknownLease
from kvstore.keys import namespace_hashes
from kvstore.results import PutResult
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.service.staging import (
    DEFAULT_STAGING_BYTES, STAGING_AUTO, StagedBytesChanged, StagingArea, StagingFull, open_staging,
)
from kvstore.tiers.shm_segment import NoSpaceForSegment
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from tests.conftest import payloads_for
from tests.kvstore.store_helpers import hold_store_lock, until
from tests.kvstore.tiers.tmpfs import mounted_tmpfs
from tests.kvstore.service.test_service import rpc_error

Code = grpc.StatusCode


def write_slots(response: pb.ReserveSlotsResponse, payloads) -> list[pb.LayerChecksums]:
    """What a client does between reserve and commit: write each payload into its slot."""
    fd = os.open(response.segment_path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    arena = np.frombuffer(mapping, np.uint8)
    for slot, payload in zip(response.slots, payloads):
        arena[slot.offset : slot.offset + slot.nbytes] = payload
    return [pb.LayerChecksums(layer_checksums=layer_checksums(p, response.num_layers)) for p in payloads]


def test_put_shm_stores_byte_exact_blocks_that_then_hit(staged_client, staged_server, namespace, spec, chain, staging):
    ns_id = staged_client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:4])
    assert staged_client.put_shm(ns_id, chain[:4], payloads) == PutResult(4, 0, 0)
    assert staged_client.put_shm(ns_id, chain[3:5], payloads_for(spec, chain[3:5]), parent=chain[2]) == PutResult(1, 1, 0)

    assert staged_client.lookup(ns_id, chain[:6]).hit_blocks == 5
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(4)]
    assert staged_client.load(ns_id, chain[:4], dsts).complete
    assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
    assert staging.active() == 0, "a commit ends its reservation"
    totals = staged_server.metrics.totals()
    assert totals["kvstore_put_blocks_total"][(("namespace", f"tiny-mla/{ns_id.hex()[:8]}"), ("outcome", "stored"))] == 5


def test_commit_of_bytes_that_fail_their_checksums_stores_nothing(staged_stub, namespace, spec, chain):
    stub = staged_stub
    ns_id = stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json())).namespace_id
    reserved = stub.ReserveSlots(pb.ReserveSlotsRequest(namespace_id=ns_id, block_hashes=chain[:2],
                                                        block_bytes=spec.block_bytes))
    payloads = payloads_for(spec, chain[:2])
    checksums = write_slots(reserved, payloads)
    write_slots(reserved, [payloads[0], payloads[1][::-1].copy()])  # the second block torn after its checksum

    with pytest.raises(grpc.RpcError) as info:
        stub.CommitSlots(pb.CommitSlotsRequest(reservation_id=reserved.reservation_id, blocks=checksums))
    assert info.value.code() == Code.ABORTED, "a conflict over the slots: the client sends the blocks again"
    assert "block 1: the staged bytes do not match their checksums" in info.value.details()
    lookup = stub.Lookup(pb.LookupRequest(namespace_id=ns_id, block_hashes=chain[:2]))
    assert list(lookup.tiers) == [], "no block of a refused commit is visible"

    with pytest.raises(grpc.RpcError) as again:  # the failed commit ended the reservation
        stub.CommitSlots(pb.CommitSlotsRequest(reservation_id=reserved.reservation_id, blocks=checksums))
    assert again.value.code() == Code.NOT_FOUND and "reserve again" in again.value.details()


def as_client(name: str) -> list[tuple[str, str]]:
    return [("kvstore-client", name)]


def reserve(stub, ns_id: bytes, hashes, spec, client: str, **request) -> pb.ReserveSlotsResponse:
    return stub.ReserveSlots(pb.ReserveSlotsRequest(namespace_id=ns_id, block_hashes=hashes,
                                                    block_bytes=spec.block_bytes, **request),
                             metadata=as_client(client))


def register(stub, namespace) -> bytes:
    return stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json())).namespace_id


def test_only_the_reserving_client_can_commit_and_to_others_the_reservation_does_not_exist(staged_stub, staging,
                                                                                         namespace, spec, chain):
    stub = staged_stub
    ns_id = register(stub, namespace)
    mine = reserve(stub, ns_id, chain[:1], spec, "tenant-a")
    theirs = reserve(stub, ns_id, chain[1:2], spec, "tenant-b")
    assert abs(theirs.reservation_id - mine.reservation_id) > 1 << 16, "ids are random, not a sequence"
    payloads = payloads_for(spec, chain[:1])
    checksums = write_slots(mine, payloads)

    poison = [pb.LayerChecksums(layer_checksums=[0] * spec.num_layers)]
    for blocks in (checksums, poison):  # neither commits nor cancels (by a failed commit) tenant-a's reservation
        foreign = rpc_error(stub.CommitSlots, pb.CommitSlotsRequest(reservation_id=mine.reservation_id, blocks=blocks),
                            metadata=as_client("tenant-b"))
        unknown = rpc_error(stub.CommitSlots, pb.CommitSlotsRequest(reservation_id=12345, blocks=blocks),
                            metadata=as_client("tenant-b"))
        assert foreign.code() == unknown.code() == Code.NOT_FOUND
        assert foreign.details() == unknown.details().replace("12345", str(mine.reservation_id)), "nothing leaks"
    assert staging.active() == 2

    committed = stub.CommitSlots(pb.CommitSlotsRequest(reservation_id=mine.reservation_id, blocks=checksums),
                                 metadata=as_client("tenant-a"))
    assert committed.stored == 1
    got = stub.Get(pb.GetRequest(namespace_id=ns_id, block_hashes=chain[:1], stream_as_loaded=True))
    assert b"".join(m.chunk.data for m in got if m.WhichOneof("kind") == "chunk") == payloads[0].tobytes()


@pytest.mark.parametrize("ttl_s", [float("nan"), float("inf"), 1e12, 601.0, -1.0])
def test_a_reservation_ttl_outside_its_bounds_is_invalid(staged_stub, staging, namespace, spec, chain, ttl_s):
    ns_id = register(staged_stub, namespace)
    error = rpc_error(reserve, staged_stub, ns_id, chain[:1], spec, "greedy", ttl_s=ttl_s)
    assert error.code() == Code.INVALID_ARGUMENT
    assert f"ttl_s must be in (0, 600] seconds, got {ttl_s}" in error.details()
    assert staging.active() == 0
    assert reserve(staged_stub, ns_id, chain[:1], spec, "greedy").ttl_s == 30, "unset: the default"


@pytest.mark.parametrize("hashes, parent, message", [
    (lambda c: [b"abc"], None, "block hashes must be 16-byte digests"),
    (lambda c: [b"x" * 32], None, "block hashes must be 16-byte digests"),
    (lambda c: [c[0], c[1], c[0]], None, "a put's blocks must be distinct"),
    (lambda c: c[1:2], b"p", "parent must be a 16-byte block hash"),
    (lambda c: c[:2], b"x" * 32, "parent must be a 16-byte block hash"),
    (lambda c: c[:2], "chain[1]", "must not include its parent"),
])
def test_a_reservation_of_a_chain_put_would_refuse_is_invalid_before_it_takes_slots(staged_stub, staging, namespace,
                                                                                     spec, chain, hashes, parent,
                                                                                     message):
    """Once, these reserved slots (and a place of max_reservations_per_client) and were refused
    only at CommitSlots, after the client had written every slot."""
    ns_id = register(staged_stub, namespace)
    parent = chain[1] if parent == "chain[1]" else parent
    error = rpc_error(reserve, staged_stub, ns_id, hashes(chain), spec, "tenant", parent=parent)
    assert error.code() == Code.INVALID_ARGUMENT and message in error.details()
    assert staging.active() == 0


def test_a_reservation_past_max_transfer_bytes_is_refused(store, start_server, staging, namespace, spec, chain):
    server = start_server(store, ServiceLimits(max_transfer_bytes=2 * spec.block_bytes), staging=staging)
    with grpc.insecure_channel(server.target) as channel:
        stub = KVStoreStub(channel)
        ns_id = register(stub, namespace)
        error = rpc_error(reserve, stub, ns_id, chain[:3], spec, "tenant")
        assert error.code() == Code.RESOURCE_EXHAUSTED and "max_transfer_bytes" in error.details()
        assert staging.active() == 0
        assert reserve(stub, ns_id, chain[:2], spec, "tenant").slots


def test_reservations_per_client_are_capped_and_others_still_reserve(store, start_server, staging, namespace, spec,
                                                                     chain):
    server = start_server(store, ServiceLimits(max_reservations_per_client=2), staging=staging)
    with grpc.insecure_channel(server.target) as channel:
        stub = KVStoreStub(channel)
        ns_id = register(stub, namespace)
        held = [reserve(stub, ns_id, chain[i : i + 1], spec, "greedy") for i in range(2)]
        error = rpc_error(reserve, stub, ns_id, chain[2:3], spec, "greedy")
        assert error.code() == Code.RESOURCE_EXHAUSTED and "max_reservations_per_client=2" in error.details()
        assert reserve(stub, ns_id, chain[3:4], spec, "modest").slots, "another client is unaffected"

        checksums = write_slots(held[0], payloads_for(spec, chain[:1]))
        stub.CommitSlots(pb.CommitSlotsRequest(reservation_id=held[0].reservation_id, blocks=checksums),
                         metadata=as_client("greedy"))
        assert reserve(stub, ns_id, chain[2:3], spec, "greedy").slots, "a commit frees its place"


def test_reservation_lapses_after_its_ttl_and_its_slots_are_reused(staging, namespace, spec, chain):
    first = staging.reserve(namespace.id, tuple(chain[:2]), None, spec.block_bytes, spec.num_layers, ttl_s=0.05)
    time.sleep(0.1)
    second = staging.reserve(namespace.id, tuple(chain[:2]), None, spec.block_bytes, spec.num_layers, ttl_s=5)
    assert staging.lapsed == 1 and staging.active() == 1
    assert set(second.offsets) == set(first.offsets), "the lapsed slots were free again"
    with pytest.raises(UnknownLease, match="unknown or lapsed"):
        staging.take(first.reservation_id, [(0, 0)] * 2)


def test_a_full_staging_area_refuses_with_the_limit_name_and_put_shm_falls_back(staged_client, staging, namespace,
                                                                                 spec, chain):
    page, slot = staging._slab.page_bytes, staging._slab.slot_bytes(spec.block_bytes)
    fits = staging.capacity_bytes // page * (page // slot)
    held = staging.reserve(namespace.id, tuple(chain[:1]) * fits, None, spec.block_bytes, spec.num_layers, 30)
    with pytest.raises(StagingFull, match="staging_bytes=1048576"):
        staging.reserve(namespace.id, tuple(chain[:1]), None, spec.block_bytes, spec.num_layers, 30)

    ns_id = staged_client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:2])
    assert staged_client.put_shm(ns_id, chain[:2], payloads) == PutResult(2, 0, 0), "fell back to Put"
    assert staging.active() == 1 and held.reservation_id


def test_take_verifies_a_private_copy_not_the_slot_a_client_can_still_write(staging, namespace, spec, chain):
    reservation = staging.reserve(namespace.id, tuple(chain[:1]), None, spec.block_bytes, spec.num_layers, 30)
    (payload,) = payloads_for(spec, chain[:1])
    arena = np.frombuffer(staging._segment.mmap, np.uint8)
    arena[reservation.offsets[0] : reservation.offsets[0] + spec.block_bytes] = payload
    _, (copy,) = staging.take(reservation.reservation_id, [layer_checksums(payload, spec.num_layers)])
    arena[reservation.offsets[0] : reservation.offsets[0] + spec.block_bytes] = 0  # the client writes on
    assert np.array_equal(copy, payload)


def test_a_take_whose_bytes_changed_recycles_its_copies(staging, namespace, spec, chain):
    """Only a wrong checksum count recycled them before: a commit of changed bytes left two fresh
    copies for the allocator, page faults for the next take."""
    reservation = staging.reserve(namespace.id, tuple(chain[:2]), None, spec.block_bytes, spec.num_layers, 30)
    assert staging._spare_bytes == 0
    with pytest.raises(StagedBytesChanged, match="do not match their checksums"):
        staging.take(reservation.reservation_id, [(1,) * spec.num_layers] * 2)
    assert staging._spare_bytes == 2 * spec.block_bytes


def test_wrong_checksum_count_is_refused(staging, namespace, spec, chain):
    reservation = staging.reserve(namespace.id, tuple(chain[:2]), None, spec.block_bytes, spec.num_layers, 30)
    with pytest.raises(InvalidRequest, match="checksums for 1 blocks, the reservation has 2 slots"):
        staging.take(reservation.reservation_id, [(1, 2)])


def test_a_sidecar_without_staging_answers_failed_precondition_and_put_shm_falls_back(client, stub, namespace,
                                                                                     spec, chain):
    ns_id = client.register_namespace(namespace)
    with pytest.raises(grpc.RpcError) as info:
        stub.ReserveSlots(pb.ReserveSlotsRequest(namespace_id=ns_id, block_hashes=chain[:1],
                                                 block_bytes=spec.block_bytes))
    assert info.value.code() == Code.FAILED_PRECONDITION and "use Put" in info.value.details()
    payloads = payloads_for(spec, chain[:3])
    assert client.put_shm(ns_id, chain[:3], payloads) == PutResult(3, 0, 0)
    assert client.lookup(ns_id, chain[:3]).hit_blocks == 3


def test_a_commit_given_up_on_while_its_put_waits_stores_its_own_bytes_not_the_next_commits(
        store, staged_stub, namespace, spec, chain):
    """The client's deadline passes while the store's lock holds up the put: the put goes on, from
    copies the next commit must not be handed (it would store its bytes under these hashes)."""
    stub, ns_id = staged_stub, register(staged_stub, namespace)
    other = namespace_hashes(namespace, np.arange(1000, 1004))
    (first,), (second,) = payloads_for(spec, chain[:1]), payloads_for(spec, other)
    commits = []
    for hashes, payload in ((chain[:1], first), (other, second)):
        reserved = reserve(stub, ns_id, hashes, spec, "tenant-a")
        commits.append(pb.CommitSlotsRequest(reservation_id=reserved.reservation_id,
                                             blocks=write_slots(reserved, [payload])))
    unstick = hold_store_lock(store)
    try:
        error = rpc_error(stub.CommitSlots, commits[0], metadata=as_client("tenant-a"), timeout=0.3)
        assert error.code() == Code.DEADLINE_EXCEEDED
        time.sleep(0.2)  # the server has seen the cancellation; its put still waits for the lock
        answer = stub.CommitSlots.future(commits[1], metadata=as_client("tenant-a"), timeout=30)
        time.sleep(0.2)  # the second commit has taken its copies and waits for the lock too
    finally:
        unstick.set()
    assert answer.result().stored == 1
    assert until(lambda: store.lookup(ns_id, chain[:1]).hit_blocks == 1), "the first put went on and stored"
    loaded = [np.zeros(spec.block_bytes, np.uint8)]
    assert store.load(ns_id, chain[:1], loaded).complete
    assert np.array_equal(loaded[0], first), "the first block holds its own bytes"


def test_a_commit_whose_client_leaves_while_it_copies_out_still_stores(store, staged_stub, staging, namespace, spec,
                                                                       chain):
    """The copy out of staging and the put run as one call: before, the copies of a commit given up
    on during the copy were dropped, the reservation already ended, and nothing was stored."""
    stub, ns_id = staged_stub, register(staged_stub, namespace)
    (payload,) = payloads_for(spec, chain[:1])
    reserved = reserve(stub, ns_id, chain[:1], spec, "tenant-a")
    commit = pb.CommitSlotsRequest(reservation_id=reserved.reservation_id, blocks=write_slots(reserved, [payload]))
    unstick = hold_store_lock(staging)  # take waits for the staging area's lock
    try:
        error = rpc_error(stub.CommitSlots, commit, metadata=as_client("tenant-a"), timeout=0.3)
        assert error.code() == Code.DEADLINE_EXCEEDED
        time.sleep(0.2)  # the server has seen the cancellation
    finally:
        unstick.set()
    assert until(lambda: store.lookup(ns_id, chain[:1]).hit_blocks == 1), "the commit went on and stored"
    loaded = [np.zeros(spec.block_bytes, np.uint8)]
    assert store.load(ns_id, chain[:1], loaded).complete and np.array_equal(loaded[0], payload)
    assert staging.active() == 0


def test_a_commit_refused_a_transfer_slot_ends_its_reservation(store, start_server, staging, namespace, spec, chain):
    """A commit moves blocks like a Put and takes a transfer slot; refused one, its staging is freed."""
    server = start_server(store, ServiceLimits(max_concurrent_transfers=1), staging=staging)
    with grpc.insecure_channel(server.target) as channel:
        stub = KVStoreStub(channel)
        ns_id = register(stub, namespace)
        payloads = payloads_for(spec, chain[:2])
        commits = []
        for i in range(2):
            reserved = reserve(stub, ns_id, chain[i : i + 1], spec, f"tenant-{i}")
            commits.append(pb.CommitSlotsRequest(reservation_id=reserved.reservation_id,
                                                 blocks=write_slots(reserved, payloads[i : i + 1])))
        unstick = hold_store_lock(store)  # the first commit's put holds the only transfer slot
        try:
            first = stub.CommitSlots.future(commits[0], metadata=as_client("tenant-0"), timeout=30)
            assert until(lambda: staging.active() == 1), "the first commit has taken its copies"
            error = rpc_error(stub.CommitSlots, commits[1], metadata=as_client("tenant-1"), timeout=10)
            assert error.code() == Code.RESOURCE_EXHAUSTED and "max_concurrent_transfers=1" in error.details()
            assert staging.active() == 0, "the refused commit's reservation ended with it"
        finally:
            unstick.set()
        assert first.result().stored == 1
        again = rpc_error(stub.CommitSlots, commits[1], metadata=as_client("tenant-1"), timeout=10)
        assert again.code() == Code.NOT_FOUND and "reserve again" in again.details()


def test_auto_staging_takes_half_the_room_left_at_most_its_default_and_none_without_a_page(tmp_path, caplog):
    with mounted_tmpfs(str(tmp_path / "shm"), 8 << 20) as shm:
        area = open_staging(STAGING_AUTO, shm)
        assert area.capacity_bytes == 4 << 20, "half of the 8 MiB free"
        filler = os.path.join(shm, "filler")
        with open(filler, "wb") as f:
            f.write(b"\0" * ((4 << 20) - 4096))  # one page left
        with caplog.at_level("WARNING", logger="kvstore.service.staging"):
            assert open_staging(STAGING_AUTO, shm) is None
        assert "no staging area for same-host puts" in caplog.text and "Put" in caplog.text
        with pytest.raises(NoSpaceForSegment, match="--staging-capacity"):  # a size given is a size kept
            open_staging(1 << 20, shm)
        area.close()
    assert open_staging(0, str(tmp_path)) is None
    big = open_staging(STAGING_AUTO, str(tmp_path))  # an ordinary file system: the default
    assert big.capacity_bytes == DEFAULT_STAGING_BYTES
    big.close()


def test_spare_copies_stay_within_the_area_and_keep_the_sizes_recycled_last(tmp_path):
    area = StagingArea(256 << 10, shm_dir=str(tmp_path), page_bytes=64 << 10)  # keeps 256 KiB of spares
    try:
        for nbytes in (16 << 10, 32 << 10, 48 << 10):  # as namespaces of three block sizes commit
            area.recycle([np.zeros(nbytes, np.uint8) for _ in range(4)])
        assert area._spare_bytes == sum(c.nbytes for spare in area._spare.values() for c in spare) <= 256 << 10
        assert sorted(area._spare) == [16 << 10, 32 << 10, 48 << 10][-len(area._spare):], "least recent size first"
        assert len(area._spare[48 << 10]) == 4 and len(area._spare[32 << 10]) == 2 and 16 << 10 not in area._spare
        area.recycle([np.zeros(1 << 20, np.uint8)])  # larger than the area: never kept
        assert 1 << 20 not in area._spare and area._spare_bytes == 256 << 10
    finally:
        area.close()


def test_a_reservation_made_for_a_call_its_client_gave_up_on_is_ended(staged_stub, staging, namespace, spec, chain,
                                                                      monkeypatch):
    """Its id never reached the client, so only its TTL would end it: meanwhile it held staging
    slots and one of the client's max_reservations_per_client."""
    ns_id, finish, made = register(staged_stub, namespace), threading.Event(), []
    real_reserve = staging.reserve

    def slow_reserve(*args, **kw):  # a reservation that waits, as one behind a busy staging lock would
        assert finish.wait(10), "the test never let the reservation finish"
        made.append(real_reserve(*args, **kw))
        return made[-1]

    monkeypatch.setattr(staging, "reserve", slow_reserve)
    request = pb.ReserveSlotsRequest(namespace_id=ns_id, block_hashes=chain[:2], block_bytes=spec.block_bytes,
                                     ttl_s=600)
    error = rpc_error(staged_stub.ReserveSlots, request, metadata=as_client("tenant-a"), timeout=0.3)
    finish.set()
    assert error.code() == Code.DEADLINE_EXCEEDED
    assert until(lambda: len(made) == 1), "the reservation was made after the client left"
    assert until(lambda: staging.active() == 0), "and then ended, not left to its 600 s TTL"


def test_a_staging_capacity_not_a_whole_number_of_pages_warns_with_the_capacity_used(tmp_path, caplog):
    """``--staging-capacity 100MiB`` was 64 MiB of staging (one 64 MiB page) without a word."""
    area = StagingArea(100 << 10, shm_dir=str(tmp_path), page_bytes=64 << 10)
    area.close()
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kvstore.service.staging"] == [(
        "WARNING", "staging capacity 102400 bytes is not a whole number of its 65536-byte pages: using 65536 bytes, "
                   "36864 unused; 65536 or 131072 would be used whole")]


def test_blocks_larger_than_a_staging_page_are_put_through_put_and_the_sidecar_says_why(
        store, start_server, tmp_path, namespace, spec, chain, caplog):
    """Before, ReserveSlots refused them INVALID_ARGUMENT, which put_shm does not fall back on: every
    same-host save of such a namespace failed, and the sidecar had started without a word."""
    small = StagingArea(4096, shm_dir=str(tmp_path), page_bytes=4096)
    assert spec.block_bytes > 4096
    server = start_server(store, staging=small)
    try:
        with KVStoreClient(server.target, timeout_s=30) as client:
            with caplog.at_level("WARNING", logger="kvstore.service.servicer"):
                ns_id = client.register_namespace(namespace)
                client.register_namespace(namespace)
            assert sum("do not fit a staging page" in r.getMessage() for r in caplog.records) == 1
            payloads = payloads_for(spec, chain[:2])
            assert client.put_shm(ns_id, chain[:2], payloads).stored == 2
            dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]
            assert client.load(ns_id, chain[:2], dsts).tiers == ("host",) * 2
            assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
    finally:
        small.close()


def test_durable_says_false_when_a_block_did_not_reach_the_disk(make_store, start_server, namespace, spec, chain):
    """Under --durable-puts a put whose blocks the disk tier could not all hold answered
    durable=True all the same, and a crash lost them. Now durable is True only when every block
    is on the disk."""
    store = make_store(host_bytes=1 << 20, disk_bytes=64 << 10, segment_bytes=64 << 10, write_policy="write_through")
    server = start_server(store, durable_puts=True)
    with grpc.insecure_channel(server.target) as channel:
        stub = KVStoreStub(channel)
        ns_id = stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json())).namespace_id

        def put(hashes, parent=None):
            header = pb.PutHeader(namespace_id=ns_id, block_hashes=hashes, parent=parent, block_bytes=spec.block_bytes)
            chunks = [pb.PutRequest(chunk=pb.Chunk(block_index=i, offset=0, data=p.tobytes()))
                      for i, p in enumerate(payloads_for(spec, hashes))]
            return stub.Put(iter([pb.PutRequest(header=header), *chunks]), timeout=30)

        first = put(chain[:1])
        assert first.stored == 1 and first.durable
        many = put(chain[1:9], parent=chain[0])
        assert many.stored == 8 and sum(store.tiers[1].contains(ns_id + h) for h in chain[1:9]) < 8
        assert not many.durable
