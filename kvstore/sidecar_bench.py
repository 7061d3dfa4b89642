"""``kvstore bench --sidecar``: sidecar throughput against its ceilings, all measured in one run.

N DeepSeek-V3.2 blocks of 64 tokens (3,076,352 bytes each) are put into a real sidecar
subprocess (host tier only, on loopback) and read back into the same preallocated buffers by:

    memcpy  numpy.copyto from in-process arrays: the ceiling
    shm     KVStoreClient.load_shm: GetSlots, copy from the mapped segment, Release
    grpc    the bytes path a client on another host takes: KVStoreClient(shared_memory=False)
            .load_shm, i.e. GetSlots, the native data plane's ReadSlots stream, Release
    grpc_python  KVStoreClient.load: Python's Get streams (at most max_transfer_blocks each), what
            the bytes path is where the data plane was not built
    tcp     one loopback TCP stream of the same bytes, 4 MiB sends, recv_into the buffers
    redis   a real redis-server (no persistence) through redis-py: one pipelined GET per block

Puts go both ways too (``put_shm``: staging slots, verified at commit; ``put``: the bytes path),
each into a fresh sidecar. The round trip of one Lookup of a 128K-token prompt (2048 block
hashes, all hits) is timed over ~50 calls. Throughputs are medians over the repeats; the ratios
are the point. Needs ``redis-server`` (Debian package) and redis-py (``pip install .[bench]``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from typing import Callable

import numpy as np

from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace
from kvstore.layout import BlockSpec
from kvstore.service import dataplane
from kvstore.service.client import KVStoreClient
from kvstore.service.local import LocalSidecar

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


def Sidecar(host_capacity: str) -> LocalSidecar:
    """A sidecar subprocess on a free loopback port, host tier only, no HTTP."""
    return LocalSidecar(tempfile.gettempdir(), host_capacity, "0", http_address="off")  # no disk tier: no files


def redis_server_binary() -> str:
    """The redis-server this benchmark compares with; ``InvalidRequest`` naming what to install
    where it or redis-py is missing."""
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not os.path.exists(binary):
        raise InvalidRequest("the sidecar benchmark compares with redis-server: apt-get install redis-server")
    try:
        import redis  # noqa: F401
    except ImportError:
        raise InvalidRequest("the sidecar benchmark needs redis-py: pip install '.[bench]'") from None
    return binary


class Redis:
    """A real redis-server on a free port, nothing persisted; stopped by ``stop``."""

    def __init__(self):
        import redis

        binary = redis_server_binary()
        self.port = free_port()
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--bind", "127.0.0.1", "--proto-max-bulk-len", "512mb"],
                                     stdout=subprocess.DEVNULL)
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


def run_sidecar_bench(blocks: int = 48, repeats: int = 3, lookup_calls: int = 50,
                      log: Callable[[str], None] = lambda s: None) -> dict:
    """Every figure of the module docstring; returns the ``sidecar`` object of ``kvstore bench``."""
    spec = BlockSpec.of(V32)
    n, block_bytes = blocks, spec.block_bytes
    total = n * block_bytes
    rng = np.random.default_rng(SEED)
    payloads = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(n)]  # [block_bytes] uint8 each
    hashes = [rng.bytes(16) for _ in range(n)]
    dsts = [np.empty(block_bytes, np.uint8) for _ in range(n)]
    host_capacity = f"{(n * 4 // 64 + 2) * 64}MiB"  # 64 MiB pages: the blocks + the lookup's

    def check():
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads)), "a path returned wrong bytes"
        for d in dsts:
            d.fill(0)

    gbps = {}
    log(f"sidecar: {n} blocks of {block_bytes} bytes x {repeats} runs (memcpy, shm, gRPC, TCP, redis)")
    if not dataplane.available():
        log("sidecar: the native data plane was not built: the gRPC bytes path is Python's Get alone")
    gbps["memcpy"] = median_gbps(lambda: [np.copyto(d, p) for d, p in zip(dsts, payloads)], total, repeats)
    check()
    for name in ("put_shm", "put"):
        gbps[name] = _put_gbps(name, payloads, n * (repeats + 1), repeats, rng)

    sidecar = Sidecar(host_capacity)
    try:
        with KVStoreClient(sidecar.address, timeout_s=120) as client, \
                KVStoreClient(sidecar.address, timeout_s=120, shared_memory=False) as remote:
            client.wait_ready()
            ns_id = client.register_namespace(V32)
            _put_all(client.put_shm, ns_id, hashes, payloads)

            def shm():
                assert client.load_shm(ns_id, hashes, dsts).tiers == ("host",) * n

            def grpc_get():
                assert remote.load_shm(ns_id, hashes, dsts).tiers == ("host",) * n

            def grpc_python_get():
                for start in range(0, n, 32):
                    assert client.load(ns_id, hashes[start : start + 32], dsts[start : start + 32]).complete

            gbps["shm"] = median_gbps(shm, total, repeats)
            check()
            gbps["grpc"] = median_gbps(grpc_get, total, repeats)
            check()
            gbps["grpc_python"] = median_gbps(grpc_python_get, total, repeats)
            check()
            p50, p99 = lookup_latencies(client, lookup_calls)
    finally:
        sidecar.stop()

    tcp, listener = tcp_receiver(payloads, dsts)
    with listener:
        tcp()  # median_gbps warms up with one run; every run needs a fresh accept
        listener.settimeout(30)
        gbps["tcp"] = median_gbps(tcp, total, repeats)
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

        gbps["redis"] = median_gbps(redis_get, total, repeats)
        check()
        redis_version = redis_server.version
    finally:
        redis_server.stop()

    return {
        "blocks": n, "block_bytes": block_bytes, "repeats": repeats, "redis_py": redis_version,
        "gbps": {k: round(v, 3) for k, v in gbps.items()},
        "shm_get_vs_memcpy": round(gbps["shm"] / gbps["memcpy"], 3),
        "shm_put_vs_memcpy": round(gbps["put_shm"] / gbps["memcpy"], 3),
        "grpc_get_vs_tcp": round(gbps["grpc"] / gbps["tcp"], 3),
        "grpc_get_vs_redis": round(gbps["grpc"] / gbps["redis"], 3),
        "grpc_python_get_vs_tcp": round(gbps["grpc_python"] / gbps["tcp"], 3),
        "bytes_path": "dataplane" if dataplane.available() else "python",
        "lookup_128k_p50_s": round(p50, 6),
        "lookup_128k_p99_s": round(p99, 6),
    }


def _put_all(put, ns_id: bytes, hashes: list[bytes], payloads: list[np.ndarray]) -> None:
    for start in range(0, len(hashes), 16):
        result = put(ns_id, hashes[start : start + 16], payloads[start : start + 16],
                     parent=hashes[start - 1] if start else None)
        assert result.stored == len(hashes[start : start + 16]), result


def _put_gbps(method: str, payloads, blocks_capacity: int, repeats: int, rng) -> float:
    """Put every payload under fresh hashes each run (a second put of a block is a duplicate) into
    one sidecar per method; the first run is a warm-up (it maps the staging segment)."""
    times = []
    sidecar = Sidecar(f"{(blocks_capacity * 4 // 64 + 2) * 64}MiB")
    try:
        with KVStoreClient(sidecar.address, timeout_s=120) as client:
            client.wait_ready()
            ns_id = client.register_namespace(V32)
            for _ in range(repeats + 1):
                hashes = [rng.bytes(16) for _ in payloads]
                start = time.perf_counter()
                _put_all(getattr(client, method), ns_id, hashes, payloads)
                times.append(time.perf_counter() - start)
    finally:
        sidecar.stop()
    return sum(p.nbytes for p in payloads) / float(np.median(times[1:])) / 1e9


SIDECAR_TARGETS = {
    "shm_get_vs_memcpy": (">=", 0.6),
    "grpc_get_vs_tcp": (">=", 0.5),
    "grpc_get_vs_redis": (">=", 1.5),
}


def format_sidecar(result: dict) -> str:
    g = result["gbps"]
    rows = [
        ("get, shared memory", g["shm"], f"memcpy {g['memcpy']:.2f}", "shm_get_vs_memcpy"),
        ("put, shared memory", g["put_shm"], f"memcpy {g['memcpy']:.2f}", "shm_put_vs_memcpy"),
        (f"get, gRPC {result['bytes_path']}", g["grpc"], f"TCP {g['tcp']:.2f}", "grpc_get_vs_tcp"),
        (f"get, gRPC {result['bytes_path']}", g["grpc"], f"redis {g['redis']:.2f}", "grpc_get_vs_redis"),
        ("get, gRPC python Get", g["grpc_python"], f"TCP {g['tcp']:.2f}", "grpc_python_get_vs_tcp"),
        ("put, gRPC bytes", g["put"], "", None),
    ]
    lines = [f"sidecar: {result['blocks']} blocks x {result['block_bytes']:,} bytes, median of {result['repeats']}",
             f"{'path':<22} {'GB/s':>7}  {'ceiling / peer GB/s':<22} {'ratio':>7}  target"]
    for name, value, ceiling, key in rows:
        ratio = f"{result[key]:.2f}" if key else ""
        target = " ".join(map(str, SIDECAR_TARGETS[key])) if key in SIDECAR_TARGETS else ""
        met = ("met" if _met(result[key], *SIDECAR_TARGETS[key]) else "MISSED") if target else ""
        lines.append(f"{name:<22} {value:>7.2f}  {ceiling:<22} {ratio:>7}  {target} {met}")
    lines.append(f"lookup 128K tokens round trip: p50 {result['lookup_128k_p50_s'] * 1e3:.2f} ms, "
                 f"p99 {result['lookup_128k_p99_s'] * 1e3:.2f} ms")
    return "\n".join(lines)


def _met(value: float, op: str, bound: float) -> bool:
    return value >= bound if op == ">=" else value <= bound
