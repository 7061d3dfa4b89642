"""Sidecar throughput against its ceilings, all measured in one run (DESIGN.md section 7).

    python benchmarks/sidecar_bench.py [--blocks 48] [--repeats 3] [--json]

N DeepSeek-V3.2 blocks of 64 tokens (3,076,352 bytes each) are put into a real sidecar
subprocess (host tier only, on loopback) and read back into the same preallocated buffers by:

    memcpy  numpy.copyto from in-process arrays: the ceiling
    shm     KVStoreClient.load_shm: GetSlots, copy from the mapped segment, Release
    grpc    KVStoreClient.load: the bytes path (Get streams of at most max_transfer_blocks)
    tcp     one loopback TCP stream of the same bytes, 4 MiB sends, recv_into the buffers
    redis   a real redis-server (no persistence) through redis-py: one pipelined GET per block

and the round trip of one Lookup of a 128K-token prompt (2048 block hashes, all hits) is timed
over ~50 calls. Throughputs are medians over the repeats; the ratios are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvstore.keys import Namespace  # noqa: E402
from kvstore.layout import BlockSpec  # noqa: E402
from kvstore.service.client import KVStoreClient  # noqa: E402

SEED = 0
SEND_BYTES = 4 << 20
LOOKUP_BLOCKS = 2048  # 128K tokens of 64-token blocks
V32 = Namespace(model="deepseek-v3.2", model_config_hash="bench", num_layers=61,
                components=("mla_fp8_ds", "indexer_fp8"), block_size=64)
# The lookup's cost is in its hashes, not its payloads: 2048 small blocks stand for a 128K prompt.
TINY = Namespace(model="tiny-mla", model_config_hash="bench", num_layers=2, components=("mla_bf16",), block_size=4)


def median_gbps(run, nbytes: int, repeats: int) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times)) / 1e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sidecar:
    """``python -m kvstore.service`` on a free loopback port, host tier only."""

    def __init__(self, host_capacity: str):
        env = dict(os.environ, KVSTORE_DATA_DIR=tempfile.mkdtemp(prefix="sidecar-bench-"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.service", "--address", "127.0.0.1:0", "--host-capacity", host_capacity,
             "--disk-capacity", "0"], stdout=subprocess.PIPE, text=True, env=env,
            cwd=Path(__file__).resolve().parents[1])
        line = self.proc.stdout.readline()
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"the sidecar did not start: {line!r}")
        self.target = line.rsplit(" ", 1)[1].strip()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Redis:
    """A real redis-server on a free port, nothing persisted; stopped by ``stop``."""

    def __init__(self):
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--bind", "127.0.0.1", "--proto-max-bulk-len", "512mb"],
                                     stdout=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        self.version = redis.__version__

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(30)


def tcp_receiver(payloads, dsts):
    """Send every payload over one loopback TCP stream in 4 MiB sends; receive into ``dsts``."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def send():
        conn, _ = listener.accept()
        with conn:
            for payload in payloads:
                view = memoryview(payload)
                for offset in range(0, len(view), SEND_BYTES):
                    conn.sendall(view[offset : offset + SEND_BYTES])

    def run():
        sender = threading.Thread(target=send)
        sender.start()
        with socket.create_connection(("127.0.0.1", port)) as sock:
            for dst in dsts:
                view, got = memoryview(dst), 0
                while got < len(view):
                    got += sock.recv_into(view[got:], min(SEND_BYTES, len(view) - got))
        sender.join()

    return run, listener


def lookup_latencies(client: KVStoreClient, calls: int) -> tuple[float, float]:
    ns_id = client.register_namespace(TINY)
    spec = BlockSpec.of(TINY)
    hashes = [i.to_bytes(16, "little") for i in range(1, LOOKUP_BLOCKS + 1)]
    payload = np.zeros(spec.block_bytes, np.uint8)
    for start in range(0, LOOKUP_BLOCKS, 32):
        client.put(ns_id, hashes[start : start + 32], [payload] * 32, parent=hashes[start - 1] if start else None)
    assert client.lookup(ns_id, hashes).hit_blocks == LOOKUP_BLOCKS
    times = []
    for _ in range(calls + 5):
        start = time.perf_counter()
        client.lookup(ns_id, hashes)
        times.append(time.perf_counter() - start)
    times = times[5:]  # warm-up
    return float(np.percentile(times, 50)), float(np.percentile(times, 99))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--lookup-calls", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    spec = BlockSpec.of(V32)
    n, block_bytes = args.blocks, spec.block_bytes
    total = n * block_bytes
    rng = np.random.default_rng(SEED)
    payloads = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]  # [block_bytes] uint8 each
    hashes = [rng.bytes(16) for _ in range(n)]
    dsts = [np.empty(block_bytes, np.uint8) for _ in range(n)]

    def check():
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads)), "a path returned wrong bytes"
        for d in dsts:
            d.fill(0)

    gbps = {}
    gbps["memcpy"] = median_gbps(lambda: [np.copyto(d, p) for d, p in zip(dsts, payloads)], total, args.repeats)
    check()

    sidecar = Sidecar(host_capacity=f"{(n * 4 // 64 + 2) * 64}MiB")  # 64 MiB pages: the blocks + the lookup's
    try:
        with KVStoreClient(sidecar.target, timeout_s=120) as client:
            client.wait_ready()
            ns_id = client.register_namespace(V32)
            for start in range(0, n, 16):
                client.put(ns_id, hashes[start : start + 16], payloads[start : start + 16],
                           parent=hashes[start - 1] if start else None)

            def shm():
                assert client.load_shm(ns_id, hashes, dsts).tiers == ("host",) * n

            def grpc_get():
                for start in range(0, n, 32):
                    assert client.load(ns_id, hashes[start : start + 32], dsts[start : start + 32]).complete

            gbps["shm"] = median_gbps(shm, total, args.repeats)
            check()
            gbps["grpc"] = median_gbps(grpc_get, total, args.repeats)
            check()
            p50, p99 = lookup_latencies(client, args.lookup_calls)
    finally:
        sidecar.stop()

    tcp, listener = tcp_receiver(payloads, dsts)
    with listener:
        tcp()  # median_gbps warms up with one run; every run needs a fresh accept
        listener.settimeout(30)
        gbps["tcp"] = median_gbps(tcp, total, args.repeats)
    check()

    redis_server = Redis()
    try:
        for h, p in zip(hashes, payloads):
            redis_server.client.set(h, p.tobytes())

        def redis_get():
            pipe = redis_server.client.pipeline(transaction=False)
            for h in hashes:
                pipe.get(h)
            for dst, value in zip(dsts, pipe.execute()):
                np.copyto(dst, np.frombuffer(value, np.uint8))

        gbps["redis"] = median_gbps(redis_get, total, args.repeats)
        check()
        redis_version = redis_server.version
    finally:
        redis_server.stop()

    result = {
        "blocks": n, "block_bytes": block_bytes, "repeats": args.repeats, "redis_py": redis_version,
        "gbps": {k: round(v, 3) for k, v in gbps.items()},
        "sidecar": {
            "shm_get_vs_memcpy": round(gbps["shm"] / gbps["memcpy"], 3),
            "grpc_get_vs_tcp": round(gbps["grpc"] / gbps["tcp"], 3),
            "grpc_get_vs_redis": round(gbps["grpc"] / gbps["redis"], 3),
            "lookup_128k_p50_s": round(p50, 6),
            "lookup_128k_p99_s": round(p99, 6),
        },
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{n} blocks x {block_bytes:,} bytes, median of {args.repeats}")
    print(f"{'path':<8} {'GB/s':>8}")
    for name, value in gbps.items():
        print(f"{name:<8} {value:>8.2f}")
    for name, value in result["sidecar"].items():
        print(f"{name:<20} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
