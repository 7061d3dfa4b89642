"""A sidecar killed with SIGKILL, in a /dev/shm with room for one host arena: its successor's
start unlinks the dead one's arena, whose memory stays allocated while an engine maps it. The
connector's session, finding the sidecar not answering, unmaps what was unlinked, so the next
start finds the room. Before, nothing unmapped it while no sidecar ran: the successor could
not start until every engine restarted.

Real processes: the sidecar (``python -m kvstore.service``) in a real 64 MiB tmpfs."""

from __future__ import annotations

import os
import signal

import grpc
import numpy as np
import pytest

from connectors.sidecar_session import SidecarSession
from kvstore.keys import Namespace
from kvstore.service.client import KVStoreClient
from tests.kvstore.service.test_serve_process import start_serving
from tests.kvstore.tiers.tmpfs import mounted_tmpfs

NS = Namespace("restart-model", "fp", 4, ("mla_bf16",), block_size=64)
HOST = {"KVSTORE_HOST_CAPACITY": "40MiB", "KVSTORE_HOST_PAGE_BYTES": "8MiB", "KVSTORE_STAGING_BYTES": "0",
        "KVSTORE_DISK_CAPACITY": "0"}
FLAGS = ("--http-address", "off", "--data-address", "off")


def serve(shm: str, address: str = "127.0.0.1:0"):
    return start_serving("--address", address, *FLAGS, env={**HOST, "KVSTORE_SHM_DIR": shm})


def test_a_killed_sidecar_s_successor_starts_once_the_session_finds_it_gone(tmp_path):
    with mounted_tmpfs(str(tmp_path / "shm"), 64 << 20) as shm:
        first, address, _ = serve(shm)
        client = KVStoreClient(address, timeout_s=5)
        try:
            session = SidecarSession(client, NS, address)
            block = 4 * 1152 * 64
            hashes = [bytes([i]) * 16 for i in range(3)]
            session.call(lambda: client.put(NS.id, hashes, [np.full(block, i, np.uint8) for i in range(3)]))
            dsts = [np.empty(block, np.uint8) for _ in hashes]
            assert session.call(lambda: client.load_shm(NS.id, hashes, dsts)).tiers == ("host",) * 3
            first.send_signal(signal.SIGKILL)
            first.wait(30)
            with pytest.raises(pytest.fail.Exception, match="(?s)no listening lines.*cannot reserve"):
                serve(shm, address)  # sweeps the dead arena, but the client's mapping holds its memory
            assert os.listdir(shm) == [], "the successor unlinked the dead sidecar's arena"
            with pytest.raises(grpc.RpcError) as failure:
                session.call(lambda: client.lookup(NS.id, hashes))
            session.failed("look up", failure.value)  # as the connectors do with a failed call
            second, _, _ = serve(shm, address)
            try:
                client.wait_ready(30)  # then directly: the session's back-off window is still open
                client.register_namespace(NS)
                assert client.lookup(NS.id, hashes).hit_blocks == 0  # a new, empty store
            finally:
                second.terminate()
                second.wait(30)
        finally:
            client.close()
