"""Native data plane streams whose client stalls: a real C++ data plane, started as the sidecar
starts it (``start_data_plane`` with its ``ServiceLimits``), over a real store's host segment,
read by raw grpcio calls that stop reading or never send their request. Like the Python Get and
Put, such a stream holds its stream places for ``stream_idle_timeout_s`` at most."""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from kvstore.service import dataplane
from kvstore.service.dataplane import DataPlaneClient, DataPlaneError
from kvstore.service.limits import ServiceLimits
from kvstore.service.server import start_data_plane
from kvstore.service.v1 import kvstore_pb2 as pb
from tests.kvstore.service.conftest import STORE_SIZES

pytestmark = pytest.mark.skipif(not dataplane.available(),
                                reason="the native data plane was not built (make installs g++ and libgrpc++-dev)")

METHOD = "/kvstore.v1.BlockData/ReadSlots"
SEGMENT_BYTES = STORE_SIZES["host_bytes"]  # the host tier's segment: 16 MiB
# The client's window stays small (no BDP probing), so the server's writes block once the
# window and the socket buffers are full: far sooner than 256 MiB.
STALLING_CLIENT = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 64 << 10)]


def wait_until(condition, within_s: float) -> float:
    """Seconds until ``condition()`` held; fails after ``within_s``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < within_s, f"not within {within_s} s"
        time.sleep(0.05)
    return time.monotonic() - start


def reads(client: DataPlaneClient, grant: bytes) -> bool:
    """Whether a read of the grant's one 4 KiB slot runs now (False: its client has no place yet)."""
    try:
        client.read(grant, [np.zeros(4096, np.uint8)], timeout_s=10)
        return True
    except DataPlaneError as exc:
        assert exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], exc
        return False


@pytest.mark.parametrize("limits, ttl_s, code, message", [
    pytest.param(ServiceLimits(stream_idle_timeout_s=1.0, max_streams_per_client=2), 60,
                 grpc.StatusCode.DEADLINE_EXCEEDED, "stream_idle_timeout_s=1: the client took no ReadSlots message",
                 id="idle"),
    pytest.param(ServiceLimits(max_streams_per_client=2), 1.0,  # idle for 30 s
                 grpc.StatusCode.NOT_FOUND, "the grant's lease ended during the stream", id="grant-deadline"),
])
def test_streams_whose_client_stops_reading_end_and_give_their_places_back(store, limits, ttl_s, code, message):
    """A client opens ReadSlots streams, takes one message of each and stops reading: HTTP/2 flow
    control stalls the server's writes, and the streams hold max_streams_per_client. After
    stream_idle_timeout_s (or once the grant's deadline passes) the server ends them: they count as
    cut short, the client gets the status (never a stream that just ends early), and its next
    stream runs."""
    data_plane = start_data_plane("127.0.0.1:0", store, limits, None, None)
    regions = [(0, SEGMENT_BYTES)] * 16  # 256 MiB: never read to the end here
    grant = data_plane.grant(1, regions, ttl_s=ttl_s)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{data_plane.port}", options=STALLING_CLIENT) as channel:
            raw = channel.unary_stream(METHOD, response_deserializer=pb.SlotBytes.FromString)

            def open_stream(grant: bytes = grant):
                request = pb.ReadSlotsRequest(grant=grant).SerializeToString()
                stream = raw(request, metadata=[("kvstore-client", "a")], timeout=30)
                next(stream)  # the stream is running
                return stream

            stalled = [open_stream(), open_stream()]
            with pytest.raises(grpc.RpcError) as info:
                open_stream()
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_streams_per_client=2" in info.value.details()
            assert data_plane.counters().cut_short == 0

            wait_until(lambda: data_plane.counters().cut_short == 2, within_s=10)
            open_stream(data_plane.grant(2, regions, ttl_s=60)).cancel()  # the places came back
            for stream in stalled:
                received = 0
                with pytest.raises(grpc.RpcError) as info:
                    for m in stream:
                        received += len(m.data)
                assert info.value.code() == code, info.value.details()
                assert message in info.value.details()
                assert received < 16 * SEGMENT_BYTES
    finally:
        data_plane.stop(0)


def test_a_stream_whose_client_sends_no_request_ends_after_the_idle_timeout(store):
    data_plane = start_data_plane("127.0.0.1:0", store, ServiceLimits(stream_idle_timeout_s=1.0,
                                                                      max_streams_per_client=1), None, None)
    hold = threading.Event()

    def no_request():
        hold.wait(30)
        yield from ()

    try:
        with grpc.insecure_channel(f"127.0.0.1:{data_plane.port}") as channel:
            raw = channel.stream_stream(METHOD)
            stream = raw(no_request(), metadata=[("kvstore-client", "a")], timeout=10)
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                next(stream)
            assert time.monotonic() - start < 5, "ended by the server, not by the client's deadline"
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "stream_idle_timeout_s=1: the client sent no ReadSlotsRequest" in info.value.details()
        grant = data_plane.grant(1, [(0, 4096)], ttl_s=30)
        client = DataPlaneClient(f"127.0.0.1:{data_plane.port}", client_id="a")
        try:
            wait_until(lambda: reads(client, grant), within_s=5)  # the one place came back
        finally:
            client.close()
    finally:
        hold.set()
        data_plane.stop(0)


@pytest.mark.parametrize("min_bytes_per_s, cut", [
    pytest.param(1 << 30, True, id="floor-above-the-trickle"),
    pytest.param(1 << 10, False, id="floor-below-the-trickle"),  # each 64 KiB message pays for 64 s of waits
])
def test_a_client_taking_a_message_just_inside_the_idle_timeout_is_held_to_the_floor_rate(store, min_bytes_per_s,
                                                                                           cut):
    """A client that takes one 64 KiB message every 0.4 s never waits out the 1 s idle timeout, but
    its waits add up: past the idle timeout plus a second per min_stream_bytes_per_s bytes moved the
    server ends the stream DEADLINE_EXCEEDED naming that limit (the Python Get's StreamPace rule),
    and gives its place back. Under a floor its bytes pay for, the same trickle runs on."""
    limits = ServiceLimits(stream_idle_timeout_s=1.0, min_stream_bytes_per_s=min_bytes_per_s,
                           max_streams_per_client=1)
    data_plane = start_data_plane("127.0.0.1:0", store, limits, None, None)
    grant = data_plane.grant(1, [(0, SEGMENT_BYTES)] * 16, ttl_s=60)  # 256 MiB: never read to the end here
    try:
        with grpc.insecure_channel(f"127.0.0.1:{data_plane.port}", options=STALLING_CLIENT) as channel:
            raw = channel.unary_stream(METHOD, response_deserializer=pb.SlotBytes.FromString)
            request = pb.ReadSlotsRequest(grant=grant, chunk_bytes=64 << 10).SerializeToString()
            stream = raw(request, metadata=[("kvstore-client", "a")], timeout=30)
            start, received = time.monotonic(), 0
            with pytest.raises(grpc.RpcError) as info:
                for message in stream:
                    received += len(message.data)
                    if time.monotonic() - start > 6:
                        stream.cancel()  # ran on: the floor allowed it
                    time.sleep(0.4)
            if cut:
                assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, info.value.details()
                assert f"min_stream_bytes_per_s={min_bytes_per_s}: the stream waited" in info.value.details()
                assert "waits past stream_idle_timeout_s=1 must be paid for" in info.value.details()
                assert time.monotonic() - start < 6
                client = DataPlaneClient(f"127.0.0.1:{data_plane.port}", client_id="a")
                try:
                    wait_until(lambda: reads(client, data_plane.grant(2, [(0, 4096)], ttl_s=30)), within_s=5)
                finally:
                    client.close()
            else:
                assert info.value.code() == grpc.StatusCode.CANCELLED, info.value.details()
            assert received < 16 * SEGMENT_BYTES
    finally:
        data_plane.stop(0)
