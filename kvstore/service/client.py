"""A blocking client of the sidecar whose methods mirror ``TieredStore``'s.

    with KVStoreClient("127.0.0.1:50551") as client:
        ns_id = client.register_namespace(namespace)
        hit = client.lookup(ns_id, hashes, lease_ttl_s=30)          # LookupResult
        got = client.load(ns_id, hashes[: hit.hit_blocks], dsts, hit.lease_id)  # into dsts
        client.put(ns_id, new_hashes, payloads, parent=hashes[-1])  # PutResult

Payloads go over the wire in chunks (``kvstore.service.chunks``) and land straight in the
caller's buffers. Results are the store's own types (``LookupResult``, ``LoadResult``,
``PutResult``, ``StoreStats``; tier ``extra`` values arrive as strings). A mistake the server
refuses raises ``grpc.RpcError`` with its status code and the store's message; mistakes the
client can see alone (buffer count or sizes) raise ``InvalidRequest`` before any call.

It knows the wire only: no caching, no shared-memory fast path (later work). Thread-safe: one
client may serve many threads.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import grpc

from kvstore.buffers import byte_view
from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace
from kvstore.results import LoadResult, LookupResult, PutResult, StoreStats
from kvstore.service import wire
from kvstore.service.chunks import BlockAssembler, iter_chunks
from kvstore.service.limits import ServiceLimits
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub


class KVStoreClient:
    def __init__(self, target: str, timeout_s: float | None = 60.0, limits: ServiceLimits = ServiceLimits()):
        """``target``: ``HOST:PORT`` or ``unix:PATH``. ``timeout_s`` bounds every call (None: no bound);
        ``limits`` must match the server's (chunk and message sizes)."""
        self._channel = grpc.insecure_channel(target, options=limits.channel_options())
        self._stub = KVStoreStub(self._channel)
        self._timeout = timeout_s
        self._limits = limits

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel connects; raises ``grpc.FutureTimeoutError`` after ``timeout_s``."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def register_namespace(self, namespace: Namespace) -> bytes:
        """Make ``namespace`` usable on the server; idempotent. Returns its 16-byte id."""
        request = pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json())
        return self._stub.RegisterNamespace(request, timeout=self._timeout).namespace_id

    def lookup(self, ns_id: bytes, block_hashes: Sequence[bytes], lease_ttl_s: float | None = None) -> LookupResult:
        """Longest contiguous hit; with ``lease_ttl_s``, a lease pins the hit blocks for that long."""
        request = pb.LookupRequest(namespace_id=ns_id, block_hashes=block_hashes, lease_ttl_s=lease_ttl_s)
        return wire.lookup_from_proto(self._stub.Lookup(request, timeout=self._timeout))

    def load(self, ns_id: bytes, block_hashes: Sequence[bytes], dsts: Sequence,
             lease_id: int | None = None) -> LoadResult:
        """Copy whole blocks, in order, into ``dsts`` (one writable buffer of the block size each).

        Stops at the first block the server cannot serve: buffers ``[0, loaded_blocks)`` hold the
        blocks, the rest are untouched. Ends ``lease_id`` once the server has the call.
        """
        if len(dsts) != len(block_hashes):
            raise InvalidRequest(f"{len(block_hashes)} block hashes but {len(dsts)} destination buffers")
        views = [byte_view(d, writable=True) for d in dsts]
        request = pb.GetRequest(namespace_id=ns_id, block_hashes=block_hashes, lease_id=lease_id,
                                block_bytes=_one_size(views, "destination buffers"))
        stream = self._stub.Get(request, timeout=self._timeout)
        header = next(stream).header
        assembler = BlockAssembler(len(header.tiers), header.block_bytes, self._limits.max_chunk_bytes,
                                   buffers=views, what="Get stream")
        for message in stream:
            assembler.add(message.chunk.block_index, message.chunk.offset, message.chunk.data)
        assembler.finish()
        return LoadResult(header.requested_blocks, tuple(header.tiers), len(header.tiers) * header.block_bytes)

    def put(self, ns_id: bytes, block_hashes: Sequence[bytes], payloads: Sequence,
            parent: bytes | None = None) -> PutResult:
        """Store consecutive blocks of one chain (``parent``: the hash before ``block_hashes[0]``)."""
        views = [byte_view(p) for p in payloads]
        header = pb.PutHeader(namespace_id=ns_id, block_hashes=block_hashes, parent=parent,
                              block_bytes=_one_size(views, "payloads"))
        return wire.put_result_from_proto(self._stub.Put(self._put_requests(header, views), timeout=self._timeout))

    def _put_requests(self, header: pb.PutHeader, views) -> Iterator[pb.PutRequest]:
        yield pb.PutRequest(header=header)
        for index, offset, data in iter_chunks(views, self._limits.max_chunk_bytes):
            yield pb.PutRequest(chunk=pb.Chunk(block_index=index, offset=offset, data=data))

    def release(self, lease_id: int) -> None:
        """End a lease; NOT_FOUND if it was never issued, already released, or expired."""
        self._stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=self._timeout)

    def delete_namespace(self, ns_id: bytes) -> int:
        """Remove every block of a namespace from every tier; returns how many."""
        request = pb.DeleteNamespaceRequest(namespace_id=ns_id)
        return self._stub.DeleteNamespace(request, timeout=self._timeout).removed_blocks

    def stats(self) -> StoreStats:
        return wire.stats_from_proto(self._stub.Stats(pb.StatsRequest(), timeout=self._timeout))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_size(views, what: str) -> int:
    """The common size of ``views`` (0 for none): one call moves blocks of one size."""
    sizes = sorted({v.nbytes for v in views})
    if len(sizes) > 1:
        raise InvalidRequest(f"the {what} of one call must all have the block size, got sizes {sizes}")
    return sizes[0] if sizes else 0
