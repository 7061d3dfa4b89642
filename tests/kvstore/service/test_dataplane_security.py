"""The native data plane's own token check and TLS: a real C++ gRPC server on port 0 over a
segment file in tmp, read by the C++ client and by Python's generated stub."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvstore.service import dataplane
from kvstore.service.dataplane import DataPlaneClient, DataPlaneError, DataPlaneServer
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import BlockDataStub
from tests.kvstore.service.test_dataplane import REGIONS, UNAUTHENTICATED, buffers, expect

pytestmark = pytest.mark.skipif(not dataplane.available(),
                                reason="the native data plane was not built (make installs g++ and libgrpc++-dev)")

TOKEN = "s3cret-token"


def test_the_bearer_token_is_required_when_configured(segment):
    server = DataPlaneServer("127.0.0.1:0", segment[0], token=TOKEN)
    try:
        grant = server.grant(1, REGIONS[:1], ttl_s=30)
        anonymous, wrong, right = (DataPlaneClient(f"127.0.0.1:{server.port}", token=t) for t in (None, "nope", TOKEN))
        for client in (anonymous, wrong):
            with pytest.raises(DataPlaneError) as info:
                client.read(grant, buffers(REGIONS[:1]))
            assert info.value.code == UNAUTHENTICATED and "bearer token" in str(info.value)
        dsts = buffers(REGIONS[:1])
        right.read(grant, dsts)
        expect(segment, REGIONS[:1], dsts)
        for client in (anonymous, wrong, right):
            client.close()
    finally:
        server.stop()


def test_the_bearer_scheme_is_matched_in_any_case_and_the_token_exactly(segment):
    """As the gRPC port's check: RFC 9110 makes the scheme case-insensitive, never the token."""
    server = DataPlaneServer("127.0.0.1:0", segment[0], token=TOKEN)
    try:
        grant = server.grant(1, REGIONS[:1], ttl_s=30)
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = BlockDataStub(channel)

            def read(authorization: str) -> bytes:
                request = pb.ReadSlotsRequest(grant=grant)
                return b"".join(m.data for m in stub.ReadSlots(request, metadata=[("authorization", authorization)]))

            for scheme in ("Bearer", "bearer", "BEARER"):
                expect(segment, REGIONS[:1], [np.frombuffer(read(f"{scheme} {TOKEN}"), np.uint8)])
            for refused in (f"Bearer {TOKEN.upper()}", f"Bearer  {TOKEN}", f"Bearer{TOKEN}", f"Basic {TOKEN}",
                            f"Bearer {TOKEN} ", f"bearers {TOKEN}", TOKEN):
                with pytest.raises(grpc.RpcError) as info:
                    read(refused)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, refused
    finally:
        server.stop()


def test_tls_serves_a_client_that_trusts_the_certificate_only(segment, tls_files):
    cert, key = (open(f, "rb").read() for f in tls_files)
    server = DataPlaneServer("127.0.0.1:0", segment[0], tls=(cert, key))
    try:
        grant = server.grant(1, REGIONS[:1], ttl_s=30)
        secure = DataPlaneClient(f"127.0.0.1:{server.port}", root_certificates=cert)
        dsts = buffers(REGIONS[:1])
        secure.read(grant, dsts, timeout_s=10)
        expect(segment, REGIONS[:1], dsts)
        plaintext = DataPlaneClient(f"127.0.0.1:{server.port}")
        with pytest.raises(DataPlaneError) as info:
            plaintext.read(grant, buffers(REGIONS[:1]), timeout_s=3)
        assert info.value.code == dataplane.NOT_CONNECTED  # its handshake never completes
        secure.close()
        plaintext.close()
    finally:
        server.stop()
