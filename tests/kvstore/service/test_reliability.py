"""The sidecar under failure and load: kill -9 during durable puts, clients that die holding
leases, several client processes at once. Real processes, real loopback, real disk."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import numpy as np

from kvstore.keys import namespace_hashes
from kvstore.service.client import KVStoreClient
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from tests.conftest import payloads_for
from tests.kvstore.service.test_serve_process import REPO, start_serving

WORKERS = 3
LOAD_SECONDS = 4.0


def put_one(stub, ns_id: bytes, block_hash: bytes, parent: bytes | None, payload: np.ndarray) -> pb.PutResponse:
    header = pb.PutHeader(namespace_id=ns_id, block_hashes=[block_hash], parent=parent, block_bytes=payload.nbytes)
    requests = [pb.PutRequest(header=header),
                pb.PutRequest(chunk=pb.Chunk(block_index=0, offset=0, data=payload.tobytes()))]
    return stub.Put(iter(requests), timeout=10)


def test_kill_9_during_durable_puts_loses_nothing_acknowledged_and_shows_nothing_partial(tmp_path, namespace, spec):
    chain = namespace_hashes(namespace, np.arange(4 * 400))
    payloads = payloads_for(spec, chain)
    args = ("--address", "127.0.0.1:0", "--http-address", "off", "--data-dir", str(tmp_path), "--host-capacity",
            "1MiB", "--disk-capacity", "64MiB", "--durable-puts")
    env = {"KVSTORE_SHM_DIR": str(tmp_path)}
    process, address, _ = start_serving(*args, env=env)
    acknowledged: list[int] = []
    with grpc.insecure_channel(address) as channel:
        stub = KVStoreStub(channel)
        ns_id = stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json())).namespace_id

        def put_until_killed() -> None:
            for i, (block_hash, payload) in enumerate(zip(chain, payloads)):
                try:
                    reply = put_one(stub, ns_id, block_hash, chain[i - 1] if i else None, payload)
                except grpc.RpcError:
                    return
                assert reply.durable and reply.stored == 1
                acknowledged.append(i)

        writer = threading.Thread(target=put_until_killed)
        writer.start()
        while len(acknowledged) < 40:
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)  # mid-stream: puts are in flight
        process.wait(10)
        writer.join(30)
    assert 40 <= len(acknowledged) < len(chain), "the kill landed during the puts"

    process, address, _ = start_serving(*args, env=env)
    try:
        with KVStoreClient(address, timeout_s=30) as client:
            assert client.register_namespace(namespace) == ns_id  # a new process knows no namespace yet
            hit = client.lookup(ns_id, chain)
            assert hit.hit_blocks >= len(acknowledged), "every acknowledged block survived"
            dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(hit.hit_blocks)]
            loaded = client._load_batched(ns_id, chain[: hit.hit_blocks], dsts)
            assert len(loaded) == hit.hit_blocks
            assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads)), "byte-equal, none partial"
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
    finally:
        process.kill() if process.poll() is None else None
    fsck = subprocess.run([sys.executable, "-m", "kvstore", "fsck", str(tmp_path / "disk"), "--json"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    report = json.loads(fsck.stdout)
    assert report["clean"] and report["corrupt_records"] == 0 and report["ok"] >= len(acknowledged)


LEASE_TTL_S = 4.0  # the first flood must end within it on a slow machine: it took over 1.5 s once


def test_a_client_that_dies_holding_a_lease_pins_its_blocks_only_until_the_ttl(make_store, start_server, namespace,
                                                                               spec, chain):
    store = make_store(host_bytes=1 << 20, disk_bytes=None)
    server = start_server(store)
    with KVStoreClient(server.target, timeout_s=10) as client:
        ns_id = client.register_namespace(namespace)
        client.put(ns_id, chain[:5], payloads_for(spec, chain[:5]))
    taken = time.monotonic()
    holder = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os
        from kvstore.service.client import KVStoreClient
        client = KVStoreClient({server.target!r})
        hit = client.lookup({ns_id!r}, {chain[:5]!r}, lease_ttl_s={LEASE_TTL_S})
        print(hit.lease_id, flush=True)
        os._exit(0)  # dies without releasing
    """)], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    granted_by = time.monotonic()  # the lease was granted between taken and this
    assert holder.returncode == 0 and holder.stdout.strip().isdigit(), holder.stderr
    assert store.stats().leases_active == 1

    def flood(first_token: int) -> None:  # independent one-block chains, far more than the tier holds
        with KVStoreClient(server.target, timeout_s=10) as client:
            for i in range(120):
                (block_hash,) = namespace_hashes(namespace, np.arange(first_token + 4 * i, first_token + 4 * i + 4))
                client.put(ns_id, [block_hash], payloads_for(spec, [block_hash]))

    flood(100_000)
    assert time.monotonic() - taken < LEASE_TTL_S, "the machine is too slow for this test's lease TTL"
    assert store.lookup(ns_id, chain[:5]).hit_blocks == 5, "pinned by the dead client's lease meanwhile"
    time.sleep(max(0.0, granted_by + LEASE_TTL_S + 0.1 - time.monotonic()))
    flood(200_000)
    stats = store.stats()
    assert stats.leases_active == 0 and stats.lease_expiries == 1
    assert store.lookup(ns_id, chain[:5]).hit_blocks == 0, "once the lease expired the blocks were evictable"


def test_several_client_processes_at_once_see_only_right_bytes_and_integrity_holds(tmp_path):
    """A real ``kvstore serve`` process with small tiers (evictions, demotions, staging all busy),
    several client processes of mixed traffic; the sidecar checks its books at shutdown."""
    process, address, _ = start_serving(
        "--address", "127.0.0.1:0", "--data-dir", str(tmp_path), "--host-capacity", "1MiB", "--disk-capacity", "4MiB",
        "--staging-capacity", "1MiB", "--check-integrity-on-exit", "--http-address", "off",
        env={"KVSTORE_SHM_DIR": str(tmp_path), "KVSTORE_HOST_PAGE_BYTES": "64KiB"})
    try:
        workers = [subprocess.Popen([sys.executable, "-m", "tests.kvstore.service.load_worker", address, str(seed),
                                     str(LOAD_SECONDS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    cwd=REPO, env={**os.environ, "PYTHONPATH": REPO}) for seed in range(WORKERS)]
        reports = []
        for worker in workers:
            out, err = worker.communicate(timeout=120)
            assert worker.returncode == 0, err
            reports.append(json.loads(out))
        with KVStoreClient(address, timeout_s=30) as client:
            stats = {t.name: t for t in client.stats().tiers}
    finally:
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    assert sum(r["mismatches"] for r in reports) == 0
    for report in reports:
        assert set(report["errors"]) <= {"RESOURCE_EXHAUSTED"}, report["errors"]  # backpressure only
        assert sum(report["ops"].values()) > 20, report
        assert report["ops"].get("load_shm", 0) and report["ops"].get("put_shm", 0)
    assert stats["host"].evictions > 0, "the load was large enough to evict"
    assert stats["host"].loaded_blocks > 0 and stats["disk"].bytes_written > 0
    assert process.returncode == 0 and "integrity check passed" in out, err
