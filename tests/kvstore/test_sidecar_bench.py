"""``kvstore bench --sidecar`` at toy size: every path returns the right bytes (the benchmark
asserts it) and the ``sidecar`` object has the figures the issue names. No timing is asserted."""

from __future__ import annotations

import os
import shutil

import pytest

from kvstore.service import dataplane
from kvstore.sidecar_bench import format_sidecar, run_sidecar_bench

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None and not os.path.exists("/usr/bin/redis-server"),
                                reason="redis-server (Debian package) is not installed; make test installs it")


def test_sidecar_bench_reports_every_figure_at_toy_size():
    result = run_sidecar_bench(blocks=3, repeats=1, lookup_calls=3)
    for key in ("shm_get_vs_memcpy", "grpc_get_vs_tcp", "grpc_get_vs_redis", "lookup_128k_p50_s",
                "lookup_128k_p99_s", "shm_put_vs_memcpy", "grpc_python_get_vs_tcp"):
        assert result[key] > 0, key
    assert set(result["gbps"]) == {"memcpy", "shm", "grpc", "grpc_python", "tcp", "redis", "put_shm", "put"}
    assert result["bytes_path"] == ("dataplane" if dataplane.available() else "python")
    assert result["lookup_128k_p99_s"] >= result["lookup_128k_p50_s"]
    table = format_sidecar(result)
    assert "get, shared memory" in table and "lookup 128K tokens" in table
    assert f"get, gRPC {result['bytes_path']}" in table and "get, gRPC python Get" in table
