"""The committed stubs are exactly what protoc makes of the .proto today."""

from kvstore.service import codegen


def test_committed_stubs_match_the_proto(tmp_path):
    for fresh in codegen.generate(tmp_path):
        committed = codegen.REPO_ROOT / codegen.STUB_DIR / fresh.name
        assert committed.read_text() == fresh.read_text(), (
            f"{committed} is out of date with {codegen.PROTO_FILES[0]}: run `python -m kvstore.service.codegen` "
            f"(with the grpcio-tools version pinned in pyproject.toml)")
