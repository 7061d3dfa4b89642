"""Hypothesis-generated requests against a real server: every answer is a success or a status
code a person can act on (never UNKNOWN/INTERNAL, a bug), and the server serves everyone after."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.service.v1 import kvstore_pb2 as pb
from tests.kvstore.service.test_service import round_trip_works

ACTIONABLE = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.FAILED_PRECONDITION}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

digests = st.one_of(st.binary(min_size=16, max_size=16), st.binary(max_size=40))
hash_lists = st.lists(digests, max_size=12)
ttls = st.one_of(st.none(), st.floats(min_value=-5, max_value=120, allow_nan=False))


def check_still_sound(store, client) -> None:
    """The server serves a fresh round trip byte-exactly and the store's books agree."""
    assert round_trip_works(client)
    store.flush()
    store.check_integrity()


def answered(call, *args) -> None:
    """``call`` either succeeds or fails with an actionable code and a message."""
    try:
        result = call(*args, timeout=10)
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)  # drain a server stream
    except grpc.RpcError as exc:
        assert exc.code() in ACTIONABLE, f"{exc.code()}: {exc.details()}"
        assert exc.details(), "an error must say what was wrong"


@pytest.fixture
def known_ns(client, namespace):
    return client.register_namespace(namespace)


@FUZZ
@given(ns=st.one_of(digests, st.just(b"known")), hashes=hash_lists, ttl=ttls)
def test_fuzzed_lookups_and_gets(stub, client, store, known_ns, ns, hashes, ttl):
    ns = known_ns if ns == b"known" else ns
    lookup = pb.LookupRequest(namespace_id=ns, block_hashes=hashes)
    if ttl is not None:
        lookup.lease_ttl_s = ttl
    answered(stub.Lookup, lookup)
    answered(stub.Get, pb.GetRequest(namespace_id=ns, block_hashes=hashes, chunk_bytes=7, block_bytes=len(hashes)))
    answered(stub.GetSlots, pb.GetSlotsRequest(namespace_id=ns, block_hashes=hashes, lease_ttl_s=ttl or 0))
    answered(stub.Release, pb.ReleaseRequest(lease_id=len(hashes)))
    check_still_sound(store, client)


chunks = st.builds(pb.Chunk, block_index=st.integers(0, 4), offset=st.integers(0, 20000),
                   data=st.binary(max_size=300))
put_streams = st.lists(st.one_of(chunks.map(lambda c: pb.PutRequest(chunk=c)),
                                 st.builds(pb.PutHeader, block_hashes=hash_lists,
                                           block_bytes=st.integers(0, 20000)).map(lambda h: pb.PutRequest(header=h))),
                       max_size=6)


@FUZZ
@given(messages=put_streams, use_known=st.booleans())
def test_fuzzed_put_streams_store_nothing_wrong(stub, client, store, known_ns, messages, use_known):
    for message in messages:
        if message.WhichOneof("kind") == "header" and use_known:
            message.header.namespace_id = known_ns
    before = store.stats().stored_blocks
    answered(stub.Put, iter(messages))
    if store.stats().stored_blocks > before:  # only a stream with complete, well-sized blocks may store
        header = messages[0].header
        assert header.block_bytes == store.spec(known_ns).block_bytes
    check_still_sound(store, client)


@FUZZ
@given(ns=digests, hashes=hash_lists, block_bytes=st.integers(0, 1 << 40), reservation=st.integers(0, 50),
       checksums=st.lists(st.lists(st.integers(0, 2**64 - 1), max_size=3), max_size=3),
       saved=st.integers(0, 2**63), computed=st.integers(0, 2**63))
def test_fuzzed_admin_and_staging_calls(stub, client, store, ns, hashes, block_bytes, reservation, checksums, saved,
                                        computed):
    answered(stub.ReserveSlots, pb.ReserveSlotsRequest(namespace_id=ns, block_hashes=hashes, block_bytes=block_bytes))
    blocks = [pb.LayerChecksums(layer_checksums=c) for c in checksums]
    answered(stub.CommitSlots, pb.CommitSlotsRequest(reservation_id=reservation, blocks=blocks))
    answered(stub.ReportPrefill, pb.ReportPrefillRequest(namespace_id=ns, saved_tokens=saved,
                                                         computed_tokens=computed))
    answered(stub.DeleteNamespace, pb.DeleteNamespaceRequest(namespace_id=ns))
    answered(stub.RegisterNamespace, pb.RegisterNamespaceRequest(canonical_json=ns.decode("latin-1")))
    check_still_sound(store, client)
