"""The data plane's listener probe, restart and watchdog: real native servers, and a real sidecar
process whose descriptors run out."""

from __future__ import annotations

import re
import shutil
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest

from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.service import dataplane
from kvstore.service.client import KVStoreClient
from kvstore.errors import InvalidRequest
from kvstore.service.dataplane import NOT_CONNECTED, DataPlaneClient, DataPlaneError, DataPlaneServer
from kvstore.service.dataplane_watchdog import DataPlaneWatchdog, probe_hosts
from kvstore.service.listener_probe import answers_http2
from kvstore.service.local import LocalSidecar
from tests.kvstore.service.test_dataplane import NOT_FOUND, REGIONS, buffers, expect

pytestmark = pytest.mark.skipif(not dataplane.available(),
                                reason="the native data plane was not built (make installs g++ and libgrpc++-dev)")


def test_the_probe_tells_an_answering_listener_from_a_silent_or_closed_one(segment):
    server = DataPlaneServer("127.0.0.1:0", segment[0])
    try:
        assert answers_http2("127.0.0.1", server.port, tls=False, timeout_s=3) is True
    finally:
        server.stop()
    with socket.socket() as silent:  # listens, so connects complete, but never accepts
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        started = time.monotonic()
        assert answers_http2("127.0.0.1", silent.getsockname()[1], tls=False, timeout_s=0.5) is False
        assert time.monotonic() - started < 3
        closed_port = silent.getsockname()[1]
    assert answers_http2("127.0.0.1", closed_port, tls=False, timeout_s=0.5) is False


def test_the_probe_completes_a_tls_handshake_without_checking_the_certificate(segment, tls_files):
    cert, key = (open(f, "rb").read() for f in tls_files)
    server = DataPlaneServer("127.0.0.1:0", segment[0], tls=(cert, key))
    try:
        assert answers_http2("127.0.0.1", server.port, tls=True, timeout_s=3) is True
        assert answers_http2("127.0.0.1", server.port, tls=False, timeout_s=1) is False
    finally:
        server.stop()


def test_a_restart_keeps_the_port_and_the_counts_and_ends_every_grant(segment):
    server = DataPlaneServer("127.0.0.1:0", segment[0])
    client = DataPlaneClient(f"127.0.0.1:{server.port}")
    try:
        old_grant = server.grant(1, REGIONS[:2], ttl_s=30)
        client.read(old_grant, buffers(REGIONS[:2]), timeout_s=10)
        port, sent = server.port, server.counters().bytes_sent
        assert server.restart() is True
        assert server.port == port and server.restarts == 1
        with pytest.raises(DataPlaneError) as info:
            client.read(old_grant, buffers(REGIONS[:2]), timeout_s=10)
        assert info.value.code == NOT_FOUND, "a grant of the old server outlived it"
        new_grant = server.grant(2, REGIONS[:2], ttl_s=30)
        dsts = buffers(REGIONS[:2])
        client.read(new_grant, dsts, timeout_s=10)
        expect(segment, REGIONS[:2], dsts)
        counters = server.counters()
        assert counters.calls == 3 and counters.bytes_sent == 2 * sent and counters.restarts == 1
        assert counters.live_grants == 1
    finally:
        client.close()
        server.stop()
    assert server.restart() is False and server.grant(3, REGIONS[:1], ttl_s=30) is None
    assert server.counters().calls == 3, "counts survive the stop"


def test_a_restart_that_cannot_start_leaves_the_data_plane_off_until_one_can(segment, monkeypatch):
    server = DataPlaneServer("127.0.0.1:0", segment[0])
    start = server._start
    try:
        def refused(address):
            raise InvalidRequest("the data plane cannot start: Too many open files")
        monkeypatch.setattr(server, "_start", refused)
        assert server.restart() is False
        assert not server.serving and server.grant(1, REGIONS[:1], ttl_s=30) is None
        monkeypatch.setattr(server, "_start", start)
        assert server.restart() is True and server.serving and server.restarts == 1
        client = DataPlaneClient(f"127.0.0.1:{server.port}")
        dsts = buffers(REGIONS[:1])
        client.read(server.grant(2, REGIONS[:1], ttl_s=30), dsts, timeout_s=10)
        expect(segment, REGIONS[:1], dsts)
        client.close()
    finally:
        server.stop()


class ScriptedWatchdog(DataPlaneWatchdog):
    """Probe answers from a script (then True), so the threshold logic runs against a real server."""

    def __init__(self, data_plane, answers):
        self.answers, self.done = list(answers), threading.Event()
        super().__init__(data_plane, tls=False, interval_s=0.02)

    def probe(self):
        if not self.answers:
            self.done.set()
            return True
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.mark.parametrize("answers, restarts", [
    ([True, False, True, False, None, True], 0),  # never two unanswered probes in a row
    ([False, None, False, True], 1),  # a probe that could not tell does not break the run
    ([False, False, False, False], 2),
    ([False, RuntimeError("a probe that raised"), False, True], 1),  # the round is skipped, the thread goes on
])
def test_the_watchdog_restarts_after_two_unanswered_probes_in_a_row(segment, answers, restarts):
    server = DataPlaneServer("127.0.0.1:0", segment[0])
    watchdog = ScriptedWatchdog(server, answers)
    try:
        assert watchdog.done.wait(10)
        watchdog.stop()
        assert server.restarts == restarts and server.serving
    finally:
        watchdog.stop()
        server.stop()


@pytest.mark.parametrize("host, expected", [
    ("0.0.0.0", ("127.0.0.1", "::1")), ("[::]", ("127.0.0.1", "::1")), ("127.0.0.1", ("127.0.0.1",)),
    ("[::1]", ("::1",)), ("10.0.0.7", ("10.0.0.7",)), ("localhost", ("localhost",)),
])
def test_the_watchdog_probes_a_wildcard_bind_on_both_loopbacks(host, expected):
    assert probe_hosts(host) == expected


def test_a_read_from_a_port_nobody_listens_on_fails_at_once_without_a_second_try():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = DataPlaneClient(f"127.0.0.1:{port}")
    try:
        for _ in range(2):
            started = time.monotonic()
            with pytest.raises(DataPlaneError) as info:
                client.read(b"x" * 16, buffers(REGIONS[:1]), timeout_s=20)
            assert info.value.code == NOT_CONNECTED and time.monotonic() - started < 2.5
    finally:
        client.close()


def test_a_read_from_a_listener_that_never_answers_gives_up_after_its_connect_bound():
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        client = DataPlaneClient(f"127.0.0.1:{silent.getsockname()[1]}")
        started = time.monotonic()
        with pytest.raises(DataPlaneError) as info:
            client.read(b"x" * 16, buffers(REGIONS[:1]), timeout_s=20)
        assert info.value.code == NOT_CONNECTED and 2.5 < time.monotonic() - started < 5, "not once 3 s"
        client.close()


def _metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_a_data_plane_whose_descriptors_ran_out_is_restarted_and_serves_again(tmp_path):
    """gRPC 1.51's listener never accepts again after an accept failed for want of a descriptor
    (grpc/grpc#20418). The sidecar runs with a 256-descriptor limit and the test opens more
    connections to its data port than that, then closes them all."""
    limit = 256
    sidecar = LocalSidecar(str(tmp_path), "16MiB", "0", env={"KVSTORE_DATA_PLANE_PROBE_S": "0.5"},
                           launcher=("prlimit", f"--nofile={limit}:{limit}"))
    try:
        ns = Namespace(model="m", model_config_hash="c", num_layers=2, components=("mla_bf16",), block_size=4)
        spec, hashes = BlockSpec.of(ns), namespace_hashes(ns, np.arange(16))
        payloads = [np.full(spec.block_bytes, i + 1, np.uint8) for i in range(len(hashes))]
        writer = KVStoreClient(sidecar.address)
        ns_id = writer.register_namespace(ns)
        writer.put(ns_id, hashes, payloads)
        grant = writer.get_slots(ns_id, hashes)
        writer.release(grant.lease_id)
        time.sleep(1.5)  # probes of a healthy data plane
        assert _metric(sidecar.url, "kvstore_dataplane_restarts_total") == 0
        assert _metric(sidecar.url, "kvstore_dataplane_up") == 1

        flood = []
        try:
            for _ in range(limit + 20):
                flood.append(socket.create_connection(("127.0.0.1", grant.data_port), timeout=5))
            time.sleep(1)  # the sidecar's accepts fail meanwhile
        finally:
            for conn in flood:
                conn.close()
        deadline = time.monotonic() + 30
        while _metric(sidecar.url, "kvstore_dataplane_restarts_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _metric(sidecar.url, "kvstore_dataplane_restarts_total") >= 1
        assert "restarting it" in sidecar.log() and "Too many open files" in sidecar.log()

        calls = _metric(sidecar.url, "kvstore_dataplane_calls_total")
        reader = KVStoreClient(sidecar.address, shared_memory=False)  # another host's view: the data plane
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in hashes]
        assert reader.load_shm(ns_id, hashes, dsts).loaded_blocks == len(hashes)
        assert all(np.array_equal(dst, payload) for dst, payload in zip(dsts, payloads))
        assert _metric(sidecar.url, "kvstore_dataplane_calls_total") > calls, "the bytes did not come by the data plane"
        reader.close()
        writer.close()
    finally:
        sidecar.stop()
