"""The native pieces; everything else about the package lives in pyproject.toml.

- ``kvstore._chain``: the prefix hash chain's loop in C (kvstore/_chain.c). Needs a C compiler and
  xxHash's header (Debian: libxxhash-dev); without them kvstore.keys falls back to its Python loop,
  which gives the same digests.
- ``kvstore.policies._sampling``: HitDensity's sampling loop in C (kvstore/policies/_sampling.c).
  Needs a C compiler; without one kvstore.policies.hit_density runs its Python loop, which evicts
  the same blocks.
- ``kvstore.service._dataplane``: the sidecar's native data plane, a C++ gRPC server and client for
  the bytes path (kvstore/service/dataplane_native/, loaded with ctypes by kvstore.service.dataplane).
  Needs g++ and gRPC's C++ library (Debian: g++, libgrpc++-dev, pkg-config); without them the
  sidecar serves bytes through its Python Get alone.

`make` installs every package they need. Every extension is optional: a missing piece skips one.
"""

import shlex
import subprocess

from setuptools import Extension, setup


def pkg_config(*args: str) -> list[str] | None:
    try:
        out = subprocess.run(["pkg-config", *args], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return shlex.split(out)


NATIVE_HEADERS = ["kvstore/service/dataplane_native/common.h", "kvstore/service/dataplane_native/streams.h",
                  "kvstore/service/dataplane_native/transport.h", "kvstore/service/dataplane_native/wire.h"]


def dataplane_extension() -> list[Extension]:
    cflags, libs = pkg_config("--cflags", "grpc++"), pkg_config("--libs", "grpc++")
    if cflags is None or libs is None:
        print("warning: gRPC's C++ library not found (Debian: libgrpc++-dev pkg-config): "
              "building without the sidecar's native data plane")
        return []
    sources = ["kvstore/service/dataplane_native/server.cc", "kvstore/service/dataplane_native/client.cc"]
    return [Extension("kvstore.service._dataplane", sources=sources, depends=NATIVE_HEADERS, language="c++",
                      extra_compile_args=["-O2", "-std=c++17", *cflags], extra_link_args=libs, optional=True)]


setup(
    ext_modules=[
        Extension("kvstore._chain", sources=["kvstore/_chain.c"], extra_compile_args=["-O3"], optional=True),
        Extension("kvstore.policies._sampling", sources=["kvstore/policies/_sampling.c"], extra_compile_args=["-O3"],
                  optional=True),
        *dataplane_extension(),
    ]
)
