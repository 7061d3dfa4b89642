"""A sidecar as a child process of this one: what ``kvstore run``, the benchmarks and tests start.

    with LocalSidecar(data_dir, host_capacity="512MiB", disk_capacity="4GiB") as sidecar:
        sidecar.address   # "127.0.0.1:PORT" (gRPC)
        sidecar.url       # "http://127.0.0.1:PORT/" (dashboard, /metrics), None with http_address="off"

It runs ``python -m kvstore.service`` with this interpreter, waits for its ``listening on`` (and
``dashboard on``) lines, and on exit sends SIGTERM and waits for the graceful shutdown.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from kvstore.errors import KVStoreError


class LocalSidecar:
    def __init__(self, data_dir: str, host_capacity: str = "512MiB", disk_capacity: str = "0",
                 address: str = "127.0.0.1:0", http_address: str = "127.0.0.1:0", extra_args: tuple[str, ...] = (),
                 env: dict | None = None):
        args = [sys.executable, "-m", "kvstore.service", "--address", address, "--http-address", http_address,
                "--data-dir", data_dir, "--host-capacity", host_capacity, "--disk-capacity", disk_capacity,
                *extra_args]
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                        env={**os.environ, **(env or {})})
        self.address = self._announced("listening on")
        self.url = None if http_address == "off" else self._announced("dashboard on")

    def _announced(self, what: str) -> str:
        line = self.process.stdout.readline()
        if what not in line:
            self.process.kill()
            _, err = self.process.communicate(timeout=30)
            raise KVStoreError(f"the sidecar did not start: {err.strip().splitlines()[-1:] or line!r}")
        return line.split(f"{what} ", 1)[1].strip()

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait for the graceful shutdown; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()
        self.process.stderr.close()
        return self.process.returncode

    def __enter__(self) -> "LocalSidecar":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
