"""``python -m kvstore.service`` as a real process: serve, take traffic, SIGTERM, exit cleanly,
and the disk tier holds what was put when a new store opens it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.service.client import KVStoreClient
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from tests.conftest import payloads_for

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def start_serving(*args, env=None) -> tuple[subprocess.Popen, str]:
    """Start the sidecar; returns the process and the address from its ``listening on`` line."""
    environment = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    process = subprocess.Popen([sys.executable, "-m", "kvstore.service", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment)
    line = process.stdout.readline()
    if "listening on" not in line:
        process.kill()
        pytest.fail(f"no listening line: {line!r}; stderr: {process.communicate(timeout=10)[1]}")
    return process, line.split("listening on ", 1)[1].strip()


def test_serve_takes_traffic_then_sigterm_exits_cleanly_and_disk_persists(tmp_path, namespace, spec, chain):
    process, address = start_serving("--address", "127.0.0.1:0", "--data-dir", str(tmp_path),
                                     "--host-capacity", "4MiB", env={"KVSTORE_DISK_CAPACITY": "256MiB"})
    try:
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        payloads = payloads_for(spec, chain[:3])
        with KVStoreClient(address, timeout_s=30) as client:
            ns_id = client.register_namespace(namespace)
            assert client.put(ns_id, chain[:3], payloads).stored == 3
            assert client.lookup(ns_id, chain[:3]).tiers == ("host",) * 3
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill() if process.poll() is None else None
    assert process.returncode == 0, err
    assert "Traceback" not in err

    with TieredStore([DiskTier(str(tmp_path / "disk"), 256 << 20)]) as store:
        ns_id = store.register_namespace(namespace)
        assert store.lookup(ns_id, chain[:4]).tiers == ("disk",) * 3
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
        assert store.load(ns_id, chain[:3], dsts).complete
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))


def test_serve_refuses_a_bad_address_with_a_message(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvstore.service", "--address", "nonsense", "--data-dir",
                           str(tmp_path), "--host-capacity", "1MiB", "--disk-capacity", "16MiB"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 2
    assert "address must be HOST:PORT or unix:PATH, got 'nonsense'" in done.stderr
