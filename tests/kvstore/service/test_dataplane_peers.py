"""What a peer of the data port can make the sidecar hold: a real C++ data plane on port 0 (in a
child process where its open-files limit matters), raw HTTP/2 connections that open no stream
(so no token is ever checked), and compressed requests that would be inflated.

gRPC 1.51 (Debian's, which the data plane links) stops accepting for good once an accept fails
for want of descriptors (grpc/grpc#20418), so connections nobody closes would kill the data
port: the server closes one that has had no stream for stream_idle_timeout_s, and the sidecar
raises its soft open-files limit to the hard one at start."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from kvstore.service import dataplane
from kvstore.service.dataplane import DataPlaneClient, DataPlaneError, DataPlaneServer
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import BlockDataServicer, add_BlockDataServicer_to_server

pytestmark = pytest.mark.skipif(not dataplane.available(),
                                reason="the native data plane was not built (make installs g++ and libgrpc++-dev)")

METHOD = "/kvstore.v1.BlockData/ReadSlots"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, PING, GOAWAY = 4, 6, 7  # HTTP/2 frame types
ACK = 1

# The data plane in a process of its own whose soft RLIMIT_NOFILE is argv[3]; it prints its port
# and a grant of the segment's first 4 KiB, and stops when its stdin closes.
CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from kvstore.service.dataplane import DataPlaneServer
server = DataPlaneServer("127.0.0.1:0", sys.argv[1], stream_idle_timeout_s=float(sys.argv[2]))
print(server.port, server.grant(1, [(0, 4096)], ttl_s=600).hex(), flush=True)
sys.stdin.read()
server.stop(0)
"""


@pytest.fixture(scope="module")
def segment(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp") / "segment"
    data = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)  # [1 MiB]
    data.tofile(path)
    return str(path), data


def frame(kind: int, flags: int = 0, payload: bytes = b"") -> bytes:
    """An HTTP/2 frame on stream 0: 24-bit length, type, flags, stream id."""
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + bytes(4) + payload


def open_idle(port: int, count: int) -> list[socket.socket]:
    """``count`` connections that greet the server (preface, SETTINGS) and open no stream."""
    connections = []
    for _ in range(count):
        connections.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        connections[-1].sendall(PREFACE + frame(SETTINGS))
    return connections


def frames_until_closed(connection: socket.socket, within_s: float) -> list[int]:
    """The types of the frames the server sends until it closes ``connection``, answering its
    SETTINGS and PINGs as a live peer does; fails if it is still open after ``within_s``."""
    deadline, data, kinds = time.monotonic() + within_s, b"", []
    while True:
        connection.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            received = connection.recv(1 << 16)
        except TimeoutError:
            pytest.fail(f"the server kept a connection that opened no stream for {within_s} s")
        except ConnectionResetError:
            return kinds
        if not received:
            return kinds
        data += received
        while len(data) >= 9 and len(data) >= 9 + int.from_bytes(data[:3], "big"):
            size, kind, flags = int.from_bytes(data[:3], "big"), data[3], data[4]
            if kind in (SETTINGS, PING) and not flags & ACK:
                try:
                    connection.sendall(frame(kind, ACK, data[9 : 9 + size] if kind == PING else b""))
                except OSError:
                    pass  # closed meanwhile: the next recv says so
            kinds.append(kind)
            data = data[9 + size :]


def test_connections_that_open_no_stream_are_closed_and_the_port_accepts_past_the_descriptor_limit(segment):
    """Four waves of 24 idle connections, 96 in all, to a data plane whose process may open 64
    descriptors: each wave is sent GOAWAY and closed after stream_idle_timeout_s, so its
    descriptors come back, no accept ever fails, and an honest read runs at the end."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, segment[0], "0.5", "64"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": REPO})
    try:
        port, grant = child.stdout.readline().split()
        for _ in range(4):
            connections = open_idle(int(port), 24)
            for connection in connections:
                assert GOAWAY in frames_until_closed(connection, within_s=10)
                connection.close()
        client = DataPlaneClient(f"127.0.0.1:{port}")
        try:
            dst = np.zeros(4096, np.uint8)
            client.read(bytes.fromhex(grant), [dst], timeout_s=5)
            assert np.array_equal(dst, segment[1][:4096])
        finally:
            client.close()
    finally:
        _, err = child.communicate(timeout=30)  # closes its stdin: it stops
    assert child.returncode == 0, err
    assert "accept4" not in err


def test_a_client_whose_connection_was_closed_for_idling_reads_again(segment):
    server = DataPlaneServer("127.0.0.1:0", segment[0], stream_idle_timeout_s=0.5)
    client = DataPlaneClient(f"127.0.0.1:{server.port}")
    try:
        grant = server.grant(1, [(4096, 8192)], ttl_s=30)
        for _ in range(2):
            dst = np.zeros(8192, np.uint8)
            client.read(grant, [dst], timeout_s=5)
            assert np.array_equal(dst, segment[1][4096 : 4096 + 8192])
            time.sleep(1.5)  # the connection idles past the timeout: the server closes it
    finally:
        client.close()
        server.stop(0)


def connections_to(port: int) -> int:
    """Established TCP connections of this host to ``port`` on 127.0.0.1 (the client's side; a
    dual-stack client's socket is in tcp6, as ::ffff:127.0.0.1)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                remote, state = row.split()[2:4]
                count += state == "01" and remote.endswith(f":{port:04X}")
    return count


def test_a_client_closes_its_idle_connection_before_the_server_would(segment):
    """A call that crosses the server's GOAWAY fails UNAVAILABLE or, rarely, hangs until its
    deadline: the client closes a connection idle for 1 to 2 s itself, so against a sidecar's
    timeout above 2 s no call ever meets that GOAWAY."""
    server = DataPlaneServer("127.0.0.1:0", segment[0], stream_idle_timeout_s=60)
    client = DataPlaneClient(f"127.0.0.1:{server.port}")
    try:
        grant = server.grant(1, [(0, 100)], ttl_s=30)
        client.read(grant, [np.zeros(100, np.uint8)], timeout_s=5)
        assert connections_to(server.port) == 1
        deadline = time.monotonic() + 5
        while connections_to(server.port):
            assert time.monotonic() < deadline, "the client kept its idle connection for 5 s"
            time.sleep(0.1)
        client.read(grant, [np.zeros(100, np.uint8)], timeout_s=5)
    finally:
        client.close()
        server.stop(0)


class ClosingDataPlane(BlockDataServicer):
    """Ends its first ``failures`` calls UNAVAILABLE, as a call that crosses the GOAWAY of a
    connection closed for idling ends; serves 100 bytes of 0x41 to the rest."""

    def __init__(self, failures: int):
        self.failures, self.calls = failures, 0

    def ReadSlots(self, request, context):
        self.calls += 1
        if self.calls <= self.failures:
            context.abort(grpc.StatusCode.UNAVAILABLE, "GOAWAY received")
        yield pb.SlotBytes(data=b"A" * 100)


@pytest.mark.parametrize("failures, outcome", [(1, "read"), (2, "UNAVAILABLE")])
def test_a_read_that_meets_a_closed_connection_is_made_again_once(failures, outcome):
    servicer, server = ClosingDataPlane(failures), grpc.server(ThreadPoolExecutor(2))
    add_BlockDataServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    client = DataPlaneClient(f"127.0.0.1:{port}")
    try:
        dst = np.zeros(100, np.uint8)
        if outcome == "read":
            client.read(b"grant", [dst], timeout_s=5)
            assert bytes(dst) == b"A" * 100
        else:
            with pytest.raises(DataPlaneError) as info:
                client.read(b"grant", [dst], timeout_s=5)
            assert (info.value.code, str(info.value)) == (14, f"ReadSlots from 127.0.0.1:{port}: GOAWAY received")
        assert servicer.calls == 2
    finally:
        client.close()
        server.stop(0)


def test_the_longest_idle_timeout_starts_a_data_plane(segment):
    """30 days (the most stream_idle_timeout_s may be) overflows gRPC's int of milliseconds."""
    server = DataPlaneServer("127.0.0.1:0", segment[0], stream_idle_timeout_s=30 * 24 * 3600.0)
    client = DataPlaneClient(f"127.0.0.1:{server.port}")
    try:
        dst = np.zeros(100, np.uint8)
        client.read(server.grant(1, [(0, 100)], ttl_s=30), [dst], timeout_s=5)
        assert np.array_equal(dst, segment[1][:100])
    finally:
        client.close()
        server.stop(0)


@pytest.mark.parametrize("compression, name", [(grpc.Compression.Gzip, "gzip"), (grpc.Compression.Deflate, "deflate")])
def test_a_compressed_request_is_refused_before_it_is_inflated(segment, compression, name):
    """gRPC inflates a compressed message before it checks the 64 KiB receive limit: a 64 KB
    gzip request would become a 63 MiB buffer. Requests are a token and three numbers."""
    server = DataPlaneServer("127.0.0.1:0", segment[0])
    try:
        request = pb.ReadSlotsRequest(grant=server.grant(1, [(0, 100)], ttl_s=30)).SerializeToString()
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            read = channel.unary_stream(METHOD, response_deserializer=pb.SlotBytes.FromString)
            with pytest.raises(grpc.RpcError) as info:
                list(read(request, compression=compression, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert info.value.details() == f"Compression algorithm '{name}' is disabled."
        assert server.counters().bytes_sent == 0
    finally:
        server.stop(0)


def test_the_sidecar_raises_its_open_files_limit_to_the_hard_one_without_a_disk_tier(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard <= 256:
        pytest.skip(f"the hard open-files limit is {hard}: nothing to raise 256 to")
    process = subprocess.Popen(
        [sys.executable, "-m", "kvstore.service", "-v", "--address", "127.0.0.1:0", "--http-address", "off",
         "--host-capacity", "4MiB", "--disk-capacity", "0", "--staging-capacity", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_SHM_DIR": str(tmp_path)},
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)))
    try:
        assert "listening on" in process.stdout.readline()
        with open(f"/proc/{process.pid}/limits") as limits:
            now = re.search(r"^Max open files\s+(\d+)\s+(\d+)", limits.read(), re.M)
        assert (int(now[1]), int(now[2])) == (hard, hard)
    finally:
        process.terminate()
        _, err = process.communicate(timeout=60)
    assert f"raised the open-files limit (RLIMIT_NOFILE) from 256 to {hard}" in err
