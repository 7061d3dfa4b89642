"""The committed stubs are exactly what the pinned protoc makes of the .proto today, and they load
on both protobuf majors the project supports.

The generator (the ``codegen`` extra, grpcio-tools 1.78.0) needs protobuf 6, so the staleness check
runs in the LMCache environment, which ``make test`` builds with ``.[lmcache,codegen]``; this
environment runs the newest protobuf and grpcio, and every other test here loads the stubs on them.
"""

from __future__ import annotations

import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import google.protobuf
import grpc
import pytest

from kvstore.service import codegen
from tests.lmcache.conftest import lmcache_python


def _generator_python() -> str:
    try:
        codegen.check_generator()
        return sys.executable
    except RuntimeError:
        python = lmcache_python()
        if python is None:
            pytest.skip("no environment with the codegen extra: `make test` builds .venv-lmcache with it")
        return python


def test_committed_stubs_match_the_proto(tmp_path):
    done = subprocess.run([_generator_python(), "-m", "kvstore.service.codegen", "--out", str(tmp_path)],
                          cwd=codegen.REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for name in codegen.GENERATED:
        fresh = tmp_path / codegen.STUB_DIR / name
        committed = codegen.REPO_ROOT / codegen.STUB_DIR / name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is out of date with {codegen.PROTO_FILES[0]}: run `python -m kvstore.service.codegen` "
            f"with `pip install -e .[codegen]` (grpcio-tools=={codegen.GRPC_TOOLS_VERSION})")


def test_the_codegen_extra_pins_the_generator_codegen_checks():
    extras = tomllib.loads((codegen.REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["codegen"] == [f"grpcio-tools=={codegen.GRPC_TOOLS_VERSION}"]


def test_the_stubs_load_here_on_runtimes_at_least_as_new_as_the_generator():
    from kvstore.service.v1 import kvstore_pb2, kvstore_pb2_grpc

    assert int(google.protobuf.__version__.split(".")[0]) >= 6
    assert tuple(map(int, grpc.__version__.split(".")[:2])) >= (1, 78)
    assert kvstore_pb2_grpc.GRPC_GENERATED_VERSION == codegen.GRPC_TOOLS_VERSION
    assert kvstore_pb2.LookupRequest(block_hashes=[b"x" * 16]).SerializeToString()


def test_generate_names_the_extra_when_the_generator_is_missing_or_another_version(monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "9.9.9")
    with pytest.raises(RuntimeError, match=r"grpcio-tools==1\.78\.0.*\.\[codegen\]"):
        codegen.generate()
