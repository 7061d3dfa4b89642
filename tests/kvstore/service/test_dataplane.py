"""The native data plane (kvstore.service.dataplane, dataplane_native/) on its own: a real C++ gRPC
server on port 0 over a segment file in tmp, read by the C++ client and by Python's generated
stub (the wire contract), with grants, ranges, expiry, revocation and sizes (its token and TLS:
test_dataplane_security.py)."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from kvstore.errors import InvalidRequest
from kvstore.service import dataplane
from kvstore.service.data_plane_link import data_plane_host
from kvstore.service.dataplane import DataPlaneClient, DataPlaneError, DataPlaneServer
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import BlockDataStub
from tests.kvstore.service.conftest import SEGMENT_BYTES

pytestmark = pytest.mark.skipif(not dataplane.available(),
                                reason="the native data plane was not built (make installs g++ and libgrpc++-dev)")

REGIONS = [(17, 100_000), (300_001, 1 << 20), (2 << 20, 5), (4 << 20, 3 << 20)]  # odd offsets and sizes
UNAUTHENTICATED, NOT_FOUND, OUT_OF_RANGE = 16, 5, 11


@pytest.fixture
def served(segment):
    server = DataPlaneServer("127.0.0.1:0", segment[0], max_chunk_bytes=256 << 10)
    client = DataPlaneClient(f"127.0.0.1:{server.port}")
    yield server, client
    client.close()
    server.stop()


def buffers(regions) -> list[np.ndarray]:
    return [np.zeros(nbytes, np.uint8) for _, nbytes in regions]


def expect(segment, regions, dsts) -> None:
    data = segment[1]
    for (offset, nbytes), dst in zip(regions, dsts):
        assert np.array_equal(dst, data[offset : offset + nbytes])


def test_a_grant_streams_its_regions_byte_exact_in_order_and_any_range_of_them(segment, served):
    server, client = served
    grant = server.grant(1, REGIONS, ttl_s=30)
    dsts = buffers(REGIONS)
    client.read(grant, dsts)
    expect(segment, REGIONS, dsts)
    middle = buffers(REGIONS[1:3])
    client.read(grant, middle, first_slot=1, chunk_bytes=4096)  # many messages per region
    expect(segment, REGIONS[1:3], middle)
    assert server.counters().bytes_sent == sum(n for _, n in REGIONS) + REGIONS[1][1] + REGIONS[2][1]
    assert server.counters().live_grants == 1


def test_a_revoked_or_expired_grant_is_not_found_and_a_range_past_it_out_of_range(served):
    server, client = served
    grant = server.grant(1, REGIONS, ttl_s=30)
    with pytest.raises(DataPlaneError) as info:
        client.read(grant, buffers(REGIONS[:2]), first_slot=3)
    assert info.value.code == OUT_OF_RANGE and "slots [3, 5) asked of a grant of 4" in str(info.value)
    server.revoke(1)
    with pytest.raises(DataPlaneError) as info:
        client.read(grant, buffers(REGIONS))
    assert info.value.expired and "GetSlots again" in str(info.value)
    short = server.grant(2, REGIONS, ttl_s=0.05)
    time.sleep(0.1)
    with pytest.raises(DataPlaneError) as info:
        client.read(short, buffers(REGIONS))
    assert info.value.code == NOT_FOUND and "expired" in str(info.value)
    with pytest.raises(DataPlaneError) as info:
        client.read(b"\x00" * 16, buffers(REGIONS))
    assert info.value.expired
    assert server.counters().live_grants == 0 and server.counters().refused == 4


def test_buffers_that_do_not_match_the_regions_fail_the_read(served):
    server, client = served
    grant = server.grant(1, REGIONS, ttl_s=30)
    too_small = buffers(REGIONS)
    too_small[-1] = np.zeros(REGIONS[-1][1] - 1, np.uint8)
    with pytest.raises(DataPlaneError) as info:
        client.read(grant, too_small)
    assert info.value.code == dataplane.PROTOCOL_ERROR and "more bytes than" in str(info.value)
    too_large = buffers(REGIONS)
    too_large[0] = np.zeros(REGIONS[0][1] + 1, np.uint8)
    with pytest.raises(DataPlaneError) as info:
        client.read(grant, too_large)
    assert info.value.code == dataplane.PROTOCOL_ERROR and "ended after" in str(info.value)


def test_a_region_off_the_segment_is_refused_at_grant_time(served):
    server, _ = served
    with pytest.raises(InvalidRequest, match="outside the 8388608-byte segment"):
        server.grant(1, [(SEGMENT_BYTES - 10, 11)], ttl_s=30)
    assert server.counters().live_grants == 0


def test_pythons_generated_stub_reads_the_same_bytes(segment, served):
    """The C++ side encodes the messages by hand: protobuf's own parser must agree."""
    server, _ = served
    grant = server.grant(1, REGIONS[:2], ttl_s=30)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = BlockDataStub(channel)
        data = b"".join(m.data for m in stub.ReadSlots(pb.ReadSlotsRequest(grant=grant, chunk_bytes=65536)))
        raw = channel.unary_stream("/kvstore.v1.BlockData/ReadSlots")
        with pytest.raises(grpc.RpcError) as info:
            list(raw(b"\x0a\xff"))  # a length past the message's end
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        other = channel.unary_unary("/kvstore.v1.KVStore/Stats")
        with pytest.raises(grpc.RpcError) as info:
            other(b"")
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    expect(segment, REGIONS[:2], [np.frombuffer(data[: REGIONS[0][1]], np.uint8),
                                  np.frombuffer(data[REGIONS[0][1] :], np.uint8)])


def test_concurrent_readers_each_get_their_own_bytes(segment, served):
    server, client = served
    errors, results = [], {}

    def read(i: int) -> None:
        regions = [REGIONS[i % len(REGIONS)], REGIONS[(i + 1) % len(REGIONS)]]
        try:
            dsts = buffers(regions)
            client.read(server.grant(100 + i, regions, ttl_s=30), dsts, chunk_bytes=8192)
            results[i] = (regions, dsts)
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 6
    for regions, dsts in results.values():
        expect(segment, regions, dsts)


def test_streams_past_the_limits_are_resource_exhausted_naming_the_limit(segment):
    """Streams held open by clients that stop reading (flow control stalls the server) count
    against max_concurrent_transfers and max_streams_per_client until they end."""
    server = DataPlaneServer("127.0.0.1:0", segment[0], max_streams=2, max_streams_per_client=1)
    grant = server.grant(1, [(0, SEGMENT_BYTES)] * 32, ttl_s=60)  # 256 MiB: never read to the end here
    request = pb.ReadSlotsRequest(grant=grant)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = BlockDataStub(channel)

            def open_stream(client: str):
                stream = stub.ReadSlots(request, metadata=[("kvstore-client", client)])
                next(stream)  # the stream is running
                return stream

            def refused(client: str) -> str:
                with pytest.raises(grpc.RpcError) as info:
                    open_stream(client)
                assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return info.value.details()

            first = open_stream("a")
            assert "max_streams_per_client=1" in refused("a")
            second = open_stream("b")
            assert "max_concurrent_transfers=2" in refused("c")
            first.cancel()  # its place comes free once the server sees the cancellation
            deadline = time.monotonic() + 10
            while True:
                try:
                    open_stream("c").cancel()
                    break
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
                    time.sleep(0.05)
            second.cancel()
    finally:
        server.stop(0)


@pytest.mark.parametrize("ending", ["revoke", "deadline"])
def test_a_stream_stops_reading_the_slots_once_its_grant_ends(segment, ending):
    """Revoked (the lease is being released) or past its deadline, a grant's slots are never read
    again: a stream in progress ends NOT_FOUND instead of sending bytes a reused slot now holds."""
    server = DataPlaneServer("127.0.0.1:0", segment[0], max_chunk_bytes=64 << 10)
    total = 64 * SEGMENT_BYTES  # 512 MiB of chunks: far more than the transport buffers
    grant = server.grant(1, [(0, SEGMENT_BYTES)] * 64, ttl_s=1.0 if ending == "deadline" else 60)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stream = BlockDataStub(channel).ReadSlots(pb.ReadSlotsRequest(grant=grant))
            received = len(next(stream).data)
            if ending == "revoke":
                server.revoke(1)
            else:
                time.sleep(1.2)
            with pytest.raises(grpc.RpcError) as info:
                for message in stream:
                    received += len(message.data)
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert "lease ended during the stream" in info.value.details()
            assert received < total
    finally:
        server.stop(0)


def test_stopping_while_grants_revocations_and_scrapes_go_on_is_safe(segment):
    server = DataPlaneServer("127.0.0.1:0", segment[0])
    stop = threading.Event()
    errors = []

    def churn() -> None:
        lease = 0
        while not stop.is_set():
            lease += 1
            try:
                server.grant(lease, REGIONS, ttl_s=30)
                server.counters()
                server.revoke(lease)
            except Exception as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    stoppers = [threading.Thread(target=server.stop, args=(0.1,)) for _ in range(2)]
    for t in stoppers:
        t.start()
    for t in stoppers:
        t.join(30)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors
    assert server.grant(10**9, REGIONS, ttl_s=30) is None, "a stopped data plane grants nothing"
    assert server.counters().calls == 0 and server.counters().live_grants >= 0


@pytest.mark.parametrize("streams", [1, 3])
def test_closing_a_client_waits_for_its_reads_and_refuses_new_ones(segment, served, streams):
    server, _ = served
    client = DataPlaneClient(f"127.0.0.1:{server.port}", streams=streams)
    grant = server.grant(1, [(0, SEGMENT_BYTES)] * 16, ttl_s=30)  # 128 MiB: the read takes a while
    dsts = [np.zeros(SEGMENT_BYTES, np.uint8) for _ in range(16)]
    reader = threading.Thread(target=client.read, args=(grant, dsts))
    reader.start()
    time.sleep(0.01)
    client.close()  # waits for the read
    reader.join(30)
    expect(segment, [(0, SEGMENT_BYTES)], dsts[-1:])
    with pytest.raises(DataPlaneError) as info:
        client.read(grant, dsts[:1])
    assert info.value.code == grpc.StatusCode.UNAVAILABLE.value[0] and "closed" in str(info.value)


def test_start_errors_name_the_problem(segment, served, tmp_path):
    server, _ = served
    with pytest.raises(InvalidRequest, match="cannot listen on 127.0.0.1:"):
        DataPlaneServer(f"127.0.0.1:{server.port}", segment[0])
    with pytest.raises(InvalidRequest, match="cannot open the segment"):
        DataPlaneServer("127.0.0.1:0", str(tmp_path / "missing"))
    with pytest.raises(InvalidRequest, match="HOST:PORT"):
        DataPlaneServer("unix:/tmp/x.sock", segment[0])
    with pytest.raises(InvalidRequest, match=r"stream_idle_timeout_s must be in \(0, 30 days\]"):
        DataPlaneServer("127.0.0.1:0", segment[0], stream_idle_timeout_s=0)


@pytest.mark.parametrize("target, host", [
    ("127.0.0.1:50551", "127.0.0.1"), ("unix:/run/kvstore.sock", "127.0.0.1"), ("dns:///kv.example:50551", "kv.example"),
    ("[::1]:50551", "[::1]"), ("node-7:50551", "node-7"),
])
def test_the_data_plane_is_reached_at_the_control_targets_host(target, host):
    assert data_plane_host(target) == host


# ---- behind the sidecar: GetSlots grants, a client on "another host" streams, Release revokes ----

@pytest.fixture
def remote_sidecar(store, start_server):
    """A sidecar with its data plane, and a client that cannot map its segment (as on another host)."""
    from kvstore.service.client import KVStoreClient
    from kvstore.service.server import start_data_plane
    from kvstore.service.limits import ServiceLimits

    data_plane = start_data_plane("127.0.0.1:0", store, ServiceLimits(), None, None)
    server = start_server(store, data_plane=data_plane)
    with KVStoreClient(server.target, timeout_s=30, shared_memory=False) as remote:
        yield remote, data_plane
    data_plane.stop()


def put_v32_blocks(client, count: int, seed: int):
    from kvstore.layout import BlockSpec
    from kvstore.sidecar_bench import V32

    spec = BlockSpec.of(V32)
    rng = np.random.default_rng(seed)
    ns_id = client.register_namespace(V32)
    hashes = [rng.bytes(16) for _ in range(count)]
    payloads = [rng.integers(0, 256, spec.block_bytes, dtype=np.uint8) for _ in range(count)]
    assert client.put(ns_id, hashes, payloads).stored == count
    return ns_id, hashes, payloads, spec


def test_a_client_that_cannot_map_the_segment_gets_host_blocks_from_the_data_plane(remote_sidecar):
    remote, data_plane = remote_sidecar
    ns_id, hashes, payloads, spec = put_v32_blocks(remote, 4, seed=1)
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(5)]
    got = remote.load_shm(ns_id, hashes + [b"\x01" * 16], dsts, verify=True)  # the last one misses
    assert got.tiers == ("host",) * 4 and got.loaded_blocks == 4
    for dst, payload in zip(dsts, payloads):
        assert np.array_equal(dst, payload)
    counters = data_plane.counters()
    assert counters.bytes_sent == 4 * spec.block_bytes and counters.calls == 1
    assert counters.live_grants == 0, "Release revoked the grant"
    assert remote.stats().leases_active == 0


def test_a_grant_dies_with_its_lease_and_the_copies_are_void(remote_sidecar):
    remote, data_plane = remote_sidecar
    ns_id, hashes, payloads, spec = put_v32_blocks(remote, 2, seed=2)
    grant = remote.get_slots(ns_id, hashes, lease_ttl_s=0.2)
    assert grant.data_grant and grant.data_port == data_plane.port and len(grant.slots) == 2
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]
    assert remote.stream_slots(grant, dsts) == 2
    time.sleep(0.4)
    assert remote.stream_slots(grant, dsts) == 0, "the expired grant streams nothing"
    assert not remote.release_grant(grant, copied_blocks=2), "the lease expired: the copies must be discarded"
    with pytest.raises(InvalidRequest, match="do not match slots"):
        remote.stream_slots(grant, dsts[:1] + [np.zeros(5, np.uint8)])


def test_blocks_the_data_plane_streams_count_once_as_shm_at_release(store, start_server):
    from kvstore.service.client import KVStoreClient
    from kvstore.service.limits import ServiceLimits
    from kvstore.service.server import start_data_plane
    from tests.kvstore.service.test_metrics import loaded_tokens

    data_plane = start_data_plane("127.0.0.1:0", store, ServiceLimits(), None, None)
    server = start_server(store, data_plane=data_plane)
    try:
        with KVStoreClient(server.target, timeout_s=30, shared_memory=False) as remote:
            ns_id, hashes, payloads, spec = put_v32_blocks(remote, 3, seed=3)
            dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
            assert remote.load_shm(ns_id, hashes, dsts).tiers == ("host",) * 3
            assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
    finally:
        data_plane.stop()
    assert data_plane.counters().bytes_sent == 3 * spec.block_bytes, "the data plane carried every block"
    assert loaded_tokens(server) == {"bytes": 0, "shm": 3 * spec.block_size}


def test_fuzzed_requests_get_a_status_or_exactly_the_granted_bytes_and_the_server_serves_on(segment):
    """Arbitrary request bytes and arbitrary fields around a real grant: every answer is one of
    the documented statuses with a message, or the exact bytes of the slots asked for."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    small = [(17, 3000), (5000, 1), (SEGMENT_BYTES - 700, 700)]
    server = DataPlaneServer("127.0.0.1:0", segment[0], max_chunk_bytes=1024)
    grant = server.grant(1, small, ttl_s=600)
    allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.OUT_OF_RANGE}
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    raw = channel.unary_stream("/kvstore.v1.BlockData/ReadSlots", response_deserializer=pb.SlotBytes.FromString)
    u32 = st.integers(0, 2**32 - 1)
    structured = st.builds(lambda g, c, f, n: pb.ReadSlotsRequest(grant=g, chunk_bytes=c, first_slot=f,
                                                                   num_slots=n).SerializeToString(),
                           st.sampled_from([grant, grant[:8], b""]) | st.binary(max_size=20),
                           u32 | st.integers(0, 4096), st.integers(0, 4) | u32, st.integers(0, 4) | u32)

    outcomes = set()

    @settings(max_examples=150, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.binary(max_size=64) | structured)
    def answer(request: bytes) -> None:
        try:
            data = b"".join(message.data for message in raw(request, timeout=10))
        except grpc.RpcError as exc:
            assert exc.code() in allowed and exc.details(), (exc.code(), exc.details())
            outcomes.add(exc.code())
            return
        outcomes.add("served")
        parsed = pb.ReadSlotsRequest.FromString(request)  # it was served, so it parses
        first = parsed.first_slot
        end = len(small) if parsed.num_slots == 0 else first + parsed.num_slots
        assert data == b"".join(segment[1][o : o + n].tobytes() for o, n in small[first:end])

    try:
        answer()
        assert {"served", grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND} <= outcomes, outcomes
        dsts = buffers(small)
        DataPlaneClient(f"127.0.0.1:{server.port}").read(grant, dsts)
        expect(segment, small, dsts)
    finally:
        channel.close()
        server.stop(0)


@pytest.mark.parametrize("streams", [2, 3])
def test_a_read_split_over_concurrent_streams_lands_every_slot_in_place(segment, served, streams):
    server, _ = served
    regions = [(i * 97_001, 50_000 + i) for i in range(7)]
    client = DataPlaneClient(f"127.0.0.1:{server.port}", streams=streams)
    try:
        grant = server.grant(1, regions, ttl_s=30)
        calls = server.counters().calls
        dsts = buffers(regions)
        client.read(grant, dsts[1:], first_slot=1, chunk_bytes=8192)
        expect(segment, regions[1:], dsts[1:])
        assert server.counters().calls - calls == streams, "one ReadSlots call per part"
        short = buffers(regions)
        short[-1] = short[-1][:-1]
        with pytest.raises(DataPlaneError) as info:  # the last part fails: the read fails, once all ended
            client.read(grant, short)
        assert info.value.code == dataplane.PROTOCOL_ERROR
        client.read(grant, dsts[:1])  # one slot: one call
        expect(segment, regions[:1], dsts[:1])
    finally:
        client.close()
    with pytest.raises(InvalidRequest, match="streams must be at least 1"):
        DataPlaneClient(f"127.0.0.1:{server.port}", streams=0)


@pytest.mark.parametrize("cores, streams", [(1, 1), (2, 1), (3, 1), (4, 2), (16, 2), (None, 1)])
def test_reads_use_two_streams_on_hosts_of_four_cores_or_more(monkeypatch, cores, streams):
    monkeypatch.setattr(dataplane.os, "cpu_count", lambda: cores)
    assert dataplane.default_streams() == streams


def test_a_deadline_is_an_instant_of_pythons_monotonic_clock(served):
    """The servicer ends a grant at an exact instant before its lease's: the C++ side must read the
    same clock as time.monotonic()."""
    server, client = served
    past = server.grant(1, REGIONS[:1], deadline=time.monotonic() - 0.001)
    soon = server.grant(2, REGIONS[:1], deadline=time.monotonic() + 0.5)
    with pytest.raises(DataPlaneError) as info:
        client.read(past, buffers(REGIONS[:1]))
    assert info.value.expired
    client.read(soon, buffers(REGIONS[:1]))
    time.sleep(0.6)
    with pytest.raises(DataPlaneError) as info:
        client.read(soon, buffers(REGIONS[:1]))
    assert info.value.expired
    for wrong in ({}, {"ttl_s": 1, "deadline": time.monotonic() + 1}):
        with pytest.raises(InvalidRequest, match="either ttl_s or deadline"):
            server.grant(3, REGIONS[:1], **wrong)
