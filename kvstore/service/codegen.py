"""Regenerate the gRPC stubs in ``kvstore/service/v1/`` from ``proto/``: the one way to make them.

    python -m kvstore.service.codegen            # rewrite the committed stubs
    python -m kvstore.service.codegen --out DIR  # write them under DIR instead (the staleness test)

Needs the generator pinned in the ``codegen`` extra (``pip install .[codegen]``: grpcio-tools
1.78.0, which brings protobuf 6). That version is chosen on purpose: its stubs load on protobuf
6.31.1 and newer and on grpcio 1.78 and newer, so the project installs beside LMCache.
The ``.proto`` lives at ``proto/kvstore/service/v1/`` so protoc's generated imports name the
package the stubs live in. Works from a source checkout (``proto/`` is not installed).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("kvstore/service/v1/kvstore.proto",)
STUB_DIR = "kvstore/service/v1"  # relative to the output root
GENERATED = ("kvstore_pb2.py", "kvstore_pb2.pyi", "kvstore_pb2_grpc.py")
GRPC_TOOLS_VERSION = "1.78.0"  # the codegen extra in pyproject.toml pins the same


def check_generator() -> None:
    """Raise RuntimeError unless grpcio-tools is installed at exactly GRPC_TOOLS_VERSION."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("grpcio-tools")
    except PackageNotFoundError:
        found = None
    if found != GRPC_TOOLS_VERSION:
        raise RuntimeError(f"the stubs are generated with grpcio-tools=={GRPC_TOOLS_VERSION}, this environment has "
                           f"{found or 'none'}: `pip install -e .[codegen]` (in an environment of its own if "
                           f"protobuf 7 must stay: that version needs protobuf<7)")


def generate(out_root: Path = REPO_ROOT) -> list[Path]:
    """Run grpc_tools.protoc; returns the generated files (under ``out_root / STUB_DIR``)."""
    check_generator()
    from grpc_tools import protoc

    out = str(out_root)
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--pyi_out={out}",
            f"--grpc_python_out={out}", *(str(PROTO_ROOT / f) for f in PROTO_FILES)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO_FILES}: see its message above")
    return [out_root / STUB_DIR / name for name in GENERATED]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT, help="output root (default: the repository)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
