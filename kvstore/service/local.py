"""A sidecar as a child process of this one: what ``kvstore run``, the benchmarks and tests start.

    with LocalSidecar(data_dir, host_capacity="512MiB", disk_capacity="4GiB") as sidecar:
        sidecar.address   # "127.0.0.1:PORT" (gRPC)
        sidecar.url       # "http://127.0.0.1:PORT/" (dashboard, /metrics), None with http_address="off"

It runs ``python -m kvstore.service`` with this interpreter, waits for its ``listening on`` (and
``dashboard on``) lines, and on exit sends SIGTERM and waits for the graceful shutdown. The
sidecar's log (its stderr) goes to an unnamed temporary file (``log()``) and the rest of its
stdout is read as it comes: a pipe nobody reads fills at 64 KiB, and the sidecar then blocks on
its next log line, for good.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

from kvstore.errors import KVStoreError


class LocalSidecar:
    def __init__(self, data_dir: str, host_capacity: str = "512MiB", disk_capacity: str = "0",
                 address: str = "127.0.0.1:0", http_address: str = "127.0.0.1:0", extra_args: tuple[str, ...] = (),
                 env: dict | None = None, launcher: tuple[str, ...] = ()):
        """``launcher``: a command the sidecar runs under, e.g. ``("prlimit", "--nofile=512:512")``."""
        args = [*launcher, sys.executable, "-m", "kvstore.service", "--address", address, "--http-address", http_address,
                "--data-dir", data_dir, "--host-capacity", host_capacity, "--disk-capacity", disk_capacity,
                *extra_args]
        self._log = tempfile.TemporaryFile("a+")  # O_APPEND: the child writes at the end whatever we read
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self._log, text=True,
                                        env={**os.environ, **(env or {})})
        self.address = self._announced("listening on")
        self.url = None if http_address == "off" else self._announced("dashboard on")
        self._stdout_reader = threading.Thread(target=self.process.stdout.read, name="sidecar-stdout", daemon=True)
        self._stdout_reader.start()

    def log(self) -> str:
        """What the sidecar has written to its stderr so far."""
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def _announced(self, what: str) -> str:
        line = self.process.stdout.readline()
        if what not in line:
            self.process.kill()
            self.process.wait(timeout=30)
            self.process.stdout.close()
            last = self.log().strip().splitlines()[-1:]
            self._log.close()
            raise KVStoreError(f"the sidecar did not start: {last[0] if last else repr(line)}")
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
        self._stdout_reader.join(timeout=5)
        self.process.stdout.close()
        self._log.close()
        return self.process.returncode

    def __enter__(self) -> "LocalSidecar":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
