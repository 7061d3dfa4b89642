"""The KVStore gRPC service: each RPC translates its messages and makes one store call.

Store calls run in worker threads (``asyncio.to_thread``): they copy megabytes and take the
store's lock, and the event loop must keep serving other calls meanwhile. Errors leave through
``context.abort`` with the status code of their class (``STATUS_CODES``) and the store's own
message; anything else is a bug and surfaces as UNKNOWN.
"""

from __future__ import annotations

import asyncio
import functools
import inspect

import grpc
import numpy as np

from kvstore.errors import InvalidRequest, KVStoreError, StoreClosed, UnknownLease, UnknownNamespace
from kvstore.service import shm, wire
from kvstore.service.chunks import BlockAssembler, check_block_bytes, iter_chunks
from kvstore.service.limits import LimitExceeded, ServiceLimits, TransferSlots
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1 import kvstore_pb2_grpc
from kvstore.store import TieredStore

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name  # "kvstore.v1.KVStore"

STATUS_CODES: dict[type, grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    UnknownNamespace: grpc.StatusCode.NOT_FOUND,
    UnknownLease: grpc.StatusCode.NOT_FOUND,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StoreClosed: grpc.StatusCode.UNAVAILABLE,  # the sidecar is shutting down: retry elsewhere or later
    KVStoreError: grpc.StatusCode.FAILED_PRECONDITION,
}


def status_code(exc: KVStoreError) -> grpc.StatusCode:
    return next(STATUS_CODES[cls] for cls in type(exc).__mro__ if cls in STATUS_CODES)


def translate_errors(method):
    """Abort the call with the status code of a ``KVStoreError``; for unary and streaming handlers."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def streaming(self, request, context):
            try:
                async for response in method(self, request, context):
                    yield response
            except KVStoreError as exc:
                await context.abort(status_code(exc), str(exc))
        return streaming

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except KVStoreError as exc:
            await context.abort(status_code(exc), str(exc))
    return unary


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """The ``kvstore.v1.KVStore`` service over one store; every method is one store call."""

    def __init__(self, store: TieredStore, limits: ServiceLimits):
        self._store = store
        self._limits = limits
        self._transfers = TransferSlots(limits.max_concurrent_transfers)

    @translate_errors
    async def RegisterNamespace(self, request, context):
        ns_id = await asyncio.to_thread(self._store.register_namespace, wire.namespace_from_request(request))
        return wire.registered(ns_id, self._store.spec(ns_id))

    @translate_errors
    async def Lookup(self, request, context):
        self._limits.check_blocks("max_lookup_blocks", len(request.block_hashes))
        result = await asyncio.to_thread(self._store.lookup, request.namespace_id, list(request.block_hashes),
                                         wire.optional(request, "lease_ttl_s"))
        return wire.lookup_to_proto(result)

    @translate_errors
    async def Get(self, request, context):
        hashes = list(request.block_hashes)
        self._limits.check_blocks("max_transfer_blocks", len(hashes))
        with self._transfers.hold():
            spec = self._store.spec(request.namespace_id)
            check_block_bytes(request.block_bytes or spec.block_bytes, spec.block_bytes, "destination buffer",
                              len(hashes))
            dsts = [np.empty(spec.block_bytes, np.uint8) for _ in hashes]  # [block_bytes] uint8 each
            result = await asyncio.to_thread(self._store.load, request.namespace_id, hashes, dsts,
                                             wire.optional(request, "lease_id"))
            yield pb.GetResponse(header=pb.GetHeader(requested_blocks=len(hashes), tiers=result.tiers,
                                                     block_bytes=spec.block_bytes))
            chunk_bytes = self._limits.chunk_bytes(request.chunk_bytes)
            for index, offset, data in iter_chunks(dsts[: result.loaded_blocks], chunk_bytes):
                yield pb.GetResponse(chunk=pb.Chunk(block_index=index, offset=offset, data=data))

    @translate_errors
    async def GetSlots(self, request, context):
        self._limits.check_blocks("max_lookup_blocks", len(request.block_hashes))  # no payload bytes move
        grant = await asyncio.to_thread(shm.leased_slots, self._store, request.namespace_id,
                                        list(request.block_hashes), request.lease_ttl_s)
        return wire.slots_to_proto(grant)

    @translate_errors
    async def Put(self, request_iterator, context):
        with self._transfers.hold():
            header = wire.put_header(await anext(request_iterator, None))
            hashes = list(header.block_hashes)
            self._limits.check_blocks("max_transfer_blocks", len(hashes))
            spec = self._store.spec(header.namespace_id)
            check_block_bytes(header.block_bytes, spec.block_bytes, "block payload", len(hashes))
            assembler = BlockAssembler(len(hashes), spec.block_bytes, self._limits.max_chunk_bytes)
            async for message in request_iterator:
                chunk = wire.put_chunk(message)
                assembler.add(chunk.block_index, chunk.offset, chunk.data)
            result = await asyncio.to_thread(self._store.put, header.namespace_id, hashes, assembler.finish(),
                                             wire.optional(header, "parent"))
            return wire.put_result_to_proto(result)

    @translate_errors
    async def Release(self, request, context):
        await asyncio.to_thread(self._store.release, request.lease_id)
        return pb.ReleaseResponse()

    @translate_errors
    async def DeleteNamespace(self, request, context):
        removed = await asyncio.to_thread(self._store.delete_namespace, request.namespace_id)
        return pb.DeleteNamespaceResponse(removed_blocks=removed)

    @translate_errors
    async def Stats(self, request, context):
        return wire.stats_to_proto(await asyncio.to_thread(self._store.stats))
