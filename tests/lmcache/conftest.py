"""The LMCache environment and real sidecar processes for the plugin's tests.

LMCache lives in an environment of its own, the project installed with its ``lmcache`` extra
(``make lmcache-venv`` builds ``.venv-lmcache``; ``KVSTORE_LMCACHE_PYTHON`` names another
interpreter): protobuf 6 and grpcio 1.78 there, the newest of both here. Tests that need LMCache run
it there as subprocesses (``engine_worker.py``); the sidecar runs from this environment.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

import pytest

from tests.kvstore.service.test_serve_process import REPO, start_serving

LMCACHE_PYTHON_ENV = "KVSTORE_LMCACHE_PYTHON"
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_worker.py")
FAULT_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_worker.py")
ENGINE_TIMEOUT_S = 240


def lmcache_python() -> str | None:
    """The LMCache environment's interpreter: ``$KVSTORE_LMCACHE_PYTHON``, else ``.venv-lmcache``."""
    path = os.environ.get(LMCACHE_PYTHON_ENV) or os.path.join(REPO, ".venv-lmcache", "bin", "python")
    return path if os.access(path, os.X_OK) else None


@pytest.fixture(scope="session")
def lmcache_py() -> str:
    python = lmcache_python()
    if python is None:
        pytest.skip(f"no LMCache environment: `make test` builds it (`make lmcache-venv`: .venv-lmcache with "
                    f"lmcache==0.5.6), or set {LMCACHE_PYTHON_ENV} to a python that has it")
    return python


def run_engine(python: str, worker: str = WORKER, **args) -> dict:
    """Run one ``worker`` action (``engine_worker.py``; ``fault_worker.py``: a scenario) in a fresh
    LMCache process; its RESULT, or fail with its output."""
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONHASHSEED": "0"}  # LMCache hashes tokens with hash()
    done = subprocess.run([python, worker, json.dumps(args)], capture_output=True, text=True, env=env,
                          timeout=ENGINE_TIMEOUT_S, cwd=REPO)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        pytest.fail(f"the LMCache engine process failed (exit {done.returncode}):\n{done.stdout[-4000:]}\n"
                    f"{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


class SidecarProcess:
    """``python -m kvstore.service`` over a data dir and shm dir in ``tmp_path``; restartable on its port."""

    def __init__(self, tmp_path, *flags: str):
        self.flags = ("--data-dir", str(tmp_path), "--host-capacity", "256MiB", "--disk-capacity", "1GiB", *flags)
        self.env = {"KVSTORE_SHM_DIR": str(tmp_path)}
        self.process, self.address, self.url = start_serving("--address", "127.0.0.1:0", *self.flags, env=self.env)

    def kill(self) -> None:
        """SIGKILL: no flush, no goodbye."""
        self.process.kill()
        self.process.wait(30)

    def restart(self) -> None:
        self.process, address, self.url = start_serving("--address", self.address, *self.flags, env=self.env)
        assert address == self.address

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as reply:
            return reply.read().decode()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a scenario that paused it may have failed midway
            self.process.terminate()
            self.process.wait(60)


@pytest.fixture
def sidecar(tmp_path):
    """A sidecar that acknowledges a put only once it is fsynced (``--durable-puts``)."""
    process = SidecarProcess(tmp_path, "--durable-puts")
    yield process
    process.stop()
