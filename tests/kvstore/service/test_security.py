"""Who may talk to the sidecar: bearer token on every call but health checks, TLS, exposure rules."""

from __future__ import annotations

import subprocess

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.errors import InvalidRequest
from kvstore.keys import namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.service import security
from kvstore.service.client import KVStoreClient
from tests.conftest import payloads_for, tiny_namespace
from tests.kvstore.service.test_metrics import scrape

TOKEN = "s3cret-token"


@pytest.fixture
def token_server(store, start_server):
    return start_server(store, token=TOKEN)


def test_calls_without_the_token_are_unauthenticated_with_a_message_and_health_stays_open(token_server, namespace,
                                                                                         spec, chain, monkeypatch):
    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    with KVStoreClient(token_server.target, timeout_s=10) as anonymous:
        with pytest.raises(grpc.RpcError) as unary:
            anonymous.register_namespace(namespace)
        assert unary.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer TOKEN" in unary.value.details()
        with pytest.raises(grpc.RpcError) as streaming:  # a server-streaming call is refused the same way
            anonymous.load(namespace.id, chain[:1], [np.zeros(spec.block_bytes, np.uint8)])
        assert streaming.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with KVStoreClient(token_server.target, timeout_s=10, token="wrong") as wrong:
        with pytest.raises(grpc.RpcError) as bad:
            wrong.stats()
        assert bad.value.code() == grpc.StatusCode.UNAUTHENTICATED

    with grpc.insecure_channel(token_server.target) as channel:  # probes carry no token
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    got = scrape(token_server.metrics.registry)  # the refused calls count as calls and errors
    for method in ("RegisterNamespace", "Get", "Stats"):
        assert got[("kvstore_grpc_calls_total", (("method", method),))] == 1, method
        assert got[("kvstore_grpc_errors_total", (("code", "UNAUTHENTICATED"), ("method", method)))] == 1, method
    assert not any("Check" in str(labels) for _, labels in got), "health checks are not the KVStore service's calls"

    monkeypatch.setenv("KVSTORE_TOKEN", TOKEN)  # the client reads it from the environment
    with KVStoreClient(token_server.target, timeout_s=10) as trusted:
        ns_id = trusted.register_namespace(namespace)
        payloads = payloads_for(spec, chain[:2])
        assert trusted.put(ns_id, chain[:2], payloads).stored == 2
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]
        assert trusted.load(ns_id, chain[:2], dsts).complete and np.array_equal(dsts[1], payloads[1])


def test_tls_server_serves_a_client_that_trusts_its_certificate_and_refuses_plaintext(store, start_server, tls_files,
                                                                                     namespace, monkeypatch):
    tls = security.read_tls(*tls_files)
    server = start_server(store, tls=tls, token=TOKEN)
    roots = open(tls_files[0], "rb").read()
    with KVStoreClient(server.target, timeout_s=10, token=TOKEN, root_certificates=roots) as secure:
        assert secure.register_namespace(namespace) == namespace.id
    monkeypatch.setenv("KVSTORE_TLS_CA", tls_files[0])  # how an engine's connector finds the roots
    with KVStoreClient(server.target, timeout_s=10, token=TOKEN) as from_env:
        assert from_env.stats().namespaces == 1
    monkeypatch.delenv("KVSTORE_TLS_CA")
    with KVStoreClient(server.target, timeout_s=3, token=TOKEN) as plaintext:
        with pytest.raises(grpc.RpcError) as info:
            plaintext.register_namespace(namespace)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("address, local", [
    ("unix:/run/kvstore.sock", True), ("127.0.0.1:50551", True), ("127.5.0.1:1", True), ("[::1]:50551", True),
    ("localhost:50551", True), ("0.0.0.0:50551", False), ("10.1.2.3:50551", False), ("[::]:50551", False),
    ("node-7.example:50551", False),
])
def test_local_addresses_are_loopback_and_unix_sockets_only(address, local):
    assert security.is_local_address(address) is local


def test_exposure_beyond_loopback_needs_a_token_and_tls_unless_plaintext_is_allowed():
    security.check_exposure("--address", "127.0.0.1:1", None, tls=False, allow_plaintext=False)
    with pytest.raises(InvalidRequest, match="give a bearer token"):
        security.check_exposure("--address", "0.0.0.0:1", None, tls=True, allow_plaintext=False)
    with pytest.raises(InvalidRequest, match="give --tls-cert and --tls-key"):
        security.check_exposure("--address", "0.0.0.0:1", "t", tls=False, allow_plaintext=False)
    security.check_exposure("--address", "0.0.0.0:1", "t", tls=False, allow_plaintext=True)
    with pytest.raises(InvalidRequest, match="--http-address '0.0.0.0:1' .* give --tls-cert and --tls-key"):
        security.check_exposure("--http-address", "0.0.0.0:1", "t", tls=False, allow_plaintext=False)
    security.check_exposure("--http-address", "0.0.0.0:1", "t", tls=True, allow_plaintext=False)


def test_token_comes_from_a_file_and_an_empty_one_is_an_error(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("abc123\nignored\n")
    assert security.load_token(None, str(token_file)) == "abc123"
    token_file.write_text("\n")
    with pytest.raises(InvalidRequest, match="is empty"):
        security.load_token(None, str(token_file))
    with pytest.raises(InvalidRequest, match="cannot read the token file"):
        security.load_token(None, str(tmp_path / "missing"))
    with pytest.raises(InvalidRequest, match="TLS needs both"):
        security.read_tls(str(token_file), None)
    assert security.load_token(None, None) is None


def test_tls_files_that_are_no_certificate_and_its_key_are_named_at_start(tls_files, tmp_path):
    """gRPC, given them, failed to listen and said only "is it in use?" (both ports)."""
    cert, key = tls_files
    assert security.read_tls(cert, key)[0].startswith(b"-----BEGIN CERTIFICATE-----")
    with pytest.raises(InvalidRequest, match=r"the TLS certificate .*key.pem' and key .*cert.pem' are not a PEM "
                                             r"certificate chain and its private key \(.*\): are they swapped"):
        security.read_tls(key, cert)
    other_key = tmp_path / "other.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-out", str(other_key)], check=True, capture_output=True)
    with pytest.raises(InvalidRequest, match="KEY_VALUES_MISMATCH"):
        security.read_tls(cert, str(other_key))
    encrypted = tmp_path / "encrypted.pem"
    subprocess.run(["openssl", "pkey", "-in", key, "-aes256", "-passout", "pass:x", "-out", str(encrypted)], check=True,
                   capture_output=True)
    with pytest.raises(InvalidRequest, match="is encrypted: give an unencrypted one"):
        security.read_tls(cert, str(encrypted))


def test_a_tenant_without_the_cache_salt_cannot_look_up_or_read_anothers_blocks(client):
    alice, mallory = tiny_namespace(cache_salt="alice-secret"), tiny_namespace(cache_salt="guess")
    spec = BlockSpec.of(alice)
    tokens = np.arange(40)  # the same prompt
    alice_id, alice_hashes = client.register_namespace(alice), namespace_hashes(alice, tokens)
    client.put(alice_id, alice_hashes, payloads_for(spec, alice_hashes))
    mallory_id, mallory_hashes = client.register_namespace(mallory), namespace_hashes(mallory, tokens)
    assert mallory_id != alice_id and set(mallory_hashes).isdisjoint(alice_hashes)
    assert client.lookup(mallory_id, mallory_hashes).hit_blocks == 0
    assert client.lookup(mallory_id, alice_hashes).hit_blocks == 0, "another namespace's hashes do not cross over"
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in alice_hashes]
    assert client.load(mallory_id, alice_hashes, dsts).loaded_blocks == 0 and not any(d.any() for d in dsts)
    assert client.lookup(alice_id, alice_hashes).hit_blocks == len(alice_hashes)


def test_only_the_client_that_took_a_lease_may_end_it(server, namespace, spec, chain):
    with KVStoreClient(server.target, timeout_s=10) as holder, KVStoreClient(server.target, timeout_s=10) as other:
        ns_id = holder.register_namespace(namespace)
        holder.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
        lease = holder.lookup(ns_id, chain[:2], lease_ttl_s=30).lease_id
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]
        for attempt in (lambda: other.release(lease), lambda: other.load(ns_id, chain[:2], dsts, lease_id=lease)):
            with pytest.raises(grpc.RpcError) as info:
                attempt()
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"lease {lease} belongs to another client" in info.value.details()
        assert holder.stats().leases_active == 1, "the lease survived both"
        holder.release(lease)
        assert holder.stats().leases_active == 0


def test_a_lease_no_client_holds_yet_is_not_ended_by_a_release_or_a_get_naming_it(store, server, namespace, spec,
                                                                                   chain):
    """Lease ids are sequential, and a lease the store has just granted is recorded for its client
    only once the store call returns: a guessed id in that moment must not end it."""
    with KVStoreClient(server.target, timeout_s=10) as guesser:
        ns_id = guesser.register_namespace(namespace)
        payloads = payloads_for(spec, chain[:2])
        guesser.put(ns_id, chain[:2], payloads)
        lease = store.lookup(ns_id, chain[:2], lease_ttl_s=30).lease_id  # granted, not yet recorded by the service
        with pytest.raises(grpc.RpcError) as info:
            guesser.release(lease)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "unknown, ended or expired" in info.value.details()
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]
        assert guesser.load(ns_id, chain[:2], dsts, lease_id=lease).complete, "read unpinned, as if it named none"
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
        assert store.lease_alive(lease), "the lease survived both"
