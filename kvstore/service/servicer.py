"""The KVStore gRPC service: each RPC translates its messages and makes one store call.

Store calls run in worker threads (``asyncio.to_thread``; those of more than one store method are
in ``store_calls``): they copy megabytes and take the store's lock, and the event loop must keep
serving other calls meanwhile. Get, Put and CommitSlots make theirs on threads of their own
(``transfer_threads``), so loads from a hung disk cannot take the threads every other call needs.
Errors leave through ``context.abort`` with the status code of their class (``STATUS_CODES``) and
the store's own message, and are counted in the metrics; anything else is a bug and surfaces as
UNKNOWN.

Each call is recorded in ``ServiceMetrics`` (kvstore.service.metrics); the slots a GetSlots call
grants count as loaded at their Release, as many as the client says it copied
(kvstore.service.granted_slots). Per-client limits key on the ``kvstore-client`` metadata a client
sends (else the connection's peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time

import grpc
import numpy as np

from kvstore.errors import InvalidRequest, KVStoreError, NotPermitted, StoreClosed, UnknownLease, UnknownNamespace
from kvstore.results import PutResult
from kvstore.service import shm, store_calls, wire
from kvstore.service.chunk_codec import encode_chunk
from kvstore.service.chunks import BlockAssembler, SentBlocks, check_block_bytes
from kvstore.service.dataplane import DataPlaneServer
from kvstore.service.granted_slots import GrantedLoad, GrantedSlots
from kvstore.service.limits import ClientLeases, LimitExceeded, ServiceLimits, StreamIdle, StreamPace
from kvstore.service.metrics import ServiceMetrics
from kvstore.service.staging import DEFAULT_RESERVATION_TTL_S, StagedBytesChanged, StagingArea
from kvstore.service.transfer_threads import TransferThreads
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1 import kvstore_pb2_grpc
from kvstore.store import TieredStore
from kvstore.tiers.host import HostTier

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name  # "kvstore.v1.KVStore"

STATUS_CODES: dict[type, grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    StagedBytesChanged: grpc.StatusCode.ABORTED,  # a conflict over a slot: send the blocks again
    UnknownNamespace: grpc.StatusCode.NOT_FOUND,
    UnknownLease: grpc.StatusCode.NOT_FOUND,
    LimitExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    StreamIdle: grpc.StatusCode.DEADLINE_EXCEEDED,
    NotPermitted: grpc.StatusCode.PERMISSION_DENIED,
    StoreClosed: grpc.StatusCode.UNAVAILABLE,  # the sidecar is shutting down: retry elsewhere or later
    KVStoreError: grpc.StatusCode.FAILED_PRECONDITION,
}


CLIENT_METADATA = "kvstore-client"
STREAM_GROUP_BYTES = 4 << 20  # a streamed Get loads about this much ahead of what it sends
GRANT_MARGIN_S = 0.05  # a data-plane grant ends this long before its lease (same monotonic clock)


def status_code(exc: KVStoreError) -> grpc.StatusCode:
    return next(STATUS_CODES[cls] for cls in type(exc).__mro__ if cls in STATUS_CODES)


def translate_errors(method):
    """Abort the call with the status code of a ``KVStoreError``; for coroutine handlers (streams
    write through ``context.write``).

    Every call counts in ``kvstore_grpc_calls_total`` as it starts and every failed one in
    ``kvstore_grpc_errors_total``: an unexpected exception as ``UNKNOWN``, the status gRPC gives it.
    A call the client cancelled is not an error."""
    @functools.wraps(method)
    async def translated(self, request, context):
        self.metrics.call(method.__name__)  # before any answer: a client that saw one finds it counted
        try:
            return await method(self, request, context)
        except KVStoreError as exc:
            await self._abort(context, method.__name__, exc)
        except (asyncio.CancelledError, grpc.aio.AbortError):  # aborted: counted by ``_abort``
            raise
        except Exception:
            self.metrics.error(method.__name__, grpc.StatusCode.UNKNOWN.name)
            raise
    return translated


def client_of(context) -> str:
    """Who a call comes from, for per-client limits: its ``kvstore-client`` metadata, else its peer."""
    for key, value in context.invocation_metadata() or ():
        if key == CLIENT_METADATA:
            return value
    return context.peer() or ""


def add_to_server(servicer: "KVStoreServicer", server) -> None:
    """Register the service like the generated ``add_KVStoreServicer_to_server``, except that Get's
    responses pass through when already serialized (its chunks are encoded by hand:
    kvstore.service.chunk_codec); the bytes on the wire are the same."""
    capture = _CapturedHandlers()
    kvstore_pb2_grpc.add_KVStoreServicer_to_server(servicer, capture)
    handlers = dict(capture.handlers)
    handlers["Get"] = grpc.unary_stream_rpc_method_handler(
        servicer.Get, request_deserializer=pb.GetRequest.FromString, response_serializer=_serialized)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def _serialized(message) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


class _CapturedHandlers:
    """Stands in for a server to read the handlers the generated code would register."""

    handlers: dict = {}

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.handlers = handlers


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    """The ``kvstore.v1.KVStore`` service over one store; every method is one store call.

    ``staging`` enables ReserveSlots/CommitSlots (None: they answer FAILED_PRECONDITION).
    ``durable_puts``: Put and CommitSlots answer only after the store flushed (disk tier fsynced),
    and say so in ``PutResponse.durable``. ``data_plane``: the native BlockData server over the host
    tier's segment (kvstore.service.dataplane); GetSlots then grants its slots to it. ``transfers``:
    the threads of Get, Put and CommitSlots (None: its own, of ``limits``); whoever closes the store
    shuts them down first.
    """

    def __init__(self, store: TieredStore, limits: ServiceLimits, metrics: ServiceMetrics | None = None,
                 staging: StagingArea | None = None, durable_puts: bool = False,
                 data_plane: DataPlaneServer | None = None, transfers: TransferThreads | None = None):
        self._store = store
        self._data_plane = data_plane
        self._limits = limits
        self.metrics = metrics or ServiceMetrics(store)
        self._staging = staging
        self._unstaged: set[bytes] = set()  # namespaces whose blocks fit no staging page (logged once)
        self._durable_puts = durable_puts
        self._transfers = transfers or TransferThreads.of(limits)
        self._leases = ClientLeases(limits.max_leases_per_client)
        self._granted_slots = GrantedSlots()
        self._registering = threading.Lock()

    async def _abort(self, context, method: str, exc: KVStoreError) -> None:
        code = status_code(exc)
        self.metrics.error(method, code.name)
        await context.abort(code, str(exc))

    @translate_errors
    async def RegisterNamespace(self, request, context):
        namespace = wire.namespace_from_request(request)
        ns_id = await asyncio.to_thread(self._register_within_cap, namespace)
        spec = self._store.spec(ns_id)
        if self._staging is not None and not self._staging.fits(spec.block_bytes) and ns_id not in self._unstaged:
            self._unstaged.add(ns_id)
            log.warning("namespace %s (%s): its %d-byte blocks do not fit a staging page, so same-host puts of "
                        "them go through Put; raise --staging-capacity or KVSTORE_STAGING_BYTES",
                        ns_id.hex(), namespace.model, spec.block_bytes)
        return wire.registered(ns_id, spec)

    def _register_within_cap(self, namespace) -> bytes:
        """Check the cap and register as one step, on a worker thread: calls racing past the check
        would overshoot it, also when one's client gives up (its thread registers all the same)."""
        with self._registering:
            if namespace.id not in {ns.id for ns in self._store.namespaces()}:  # registering again is free
                self._limits.check_new_namespace(len(self._store.namespaces()))
            return self._store.register_namespace(namespace)

    @translate_errors
    async def Lookup(self, request, context):
        self._limits.check_blocks("max_lookup_blocks", len(request.block_hashes))
        ttl_s, client = wire.optional(request, "lease_ttl_s"), client_of(context)
        hashes = list(request.block_hashes)
        if request.probe:  # whether it is held, asked before a demotion: no lease, no lookup in any count
            if ttl_s is not None:
                raise InvalidRequest("a probe takes no lease: leave lease_ttl_s unset, or ask without probe")
            probed = await asyncio.to_thread(self._store.lookup, request.namespace_id, hashes, counted=False)
            return wire.lookup_to_proto(probed)
        started = time.perf_counter()
        with self._leases.taking(client) if ttl_s is not None else contextlib.nullcontext():
            result = await self._leasing(context, self._store.lookup, request.namespace_id, hashes, ttl_s)
            if result.lease_id is not None:
                self._leases.add(client, result.lease_id, ttl_s)
        self.metrics.lookup(request.namespace_id, hashes, result.tiers, time.perf_counter() - started)
        return wire.lookup_to_proto(result)

    @translate_errors
    async def Get(self, request, context):
        hashes, client = list(request.block_hashes), client_of(context)
        lease_id = self._leases.held_by(client, request.lease_id) if request.HasField("lease_id") else None
        with contextlib.ExitStack() as transfer:
            try:
                stream = transfer.enter_context(self._transfers.stream(client))
                spec = self._store.spec(request.namespace_id)
                self._limits.check_transfer(len(hashes), spec.block_bytes)
                check_block_bytes(request.block_bytes or spec.block_bytes, spec.block_bytes, "destination buffer",
                                  len(hashes))
            except KVStoreError:  # refused: the lease ends all the same, as the call promises
                await self._end_lease(lease_id)
                raise
            messages = (self._get_as_loaded if request.stream_as_loaded else self._get_whole)(
                request, hashes, spec.block_bytes, lease_id, stream.run)
            pace = StreamPace(self._limits)
            async with contextlib.aclosing(messages):  # its lease ends now, also when the client went away
                async for message in messages:
                    await pace.wait(context.write(message), "took no Get message")
                    pace.moved(len(message) if isinstance(message, bytes) else 0)  # chunks come encoded

    async def _get_whole(self, request, hashes: list[bytes], block_bytes: int, lease_id: int | None, run):
        """Get's messages when every block is loaded before the first is sent (one store call, by
        ``run``: its stream's ``TransferStream.run``)."""
        dsts = [np.empty(block_bytes, np.uint8) for _ in hashes]  # [block_bytes] uint8 each
        if lease_id is not None:
            self._lease_ended(lease_id)  # the load ends it in the store
        started = time.perf_counter()
        result = await run(self._store.load, request.namespace_id, hashes, dsts, lease_id)
        load_s, sent = time.perf_counter() - started, SentBlocks()
        try:
            yield pb.GetResponse(header=pb.GetHeader(requested_blocks=len(hashes), tiers=result.tiers,
                                                     block_bytes=block_bytes))
            for index, offset, data in sent.chunks(dsts[: result.loaded_blocks], 0,
                                                   self._limits.chunk_bytes(request.chunk_bytes)):
                yield encode_chunk(index, offset, data)  # a serialized GetResponse (see add_to_server)
        finally:  # a client gone mid-stream was handed only some; the load's time after them, as in _get_as_loaded
            self.metrics.loaded(request.namespace_id, result.tiers[: sent.count], "bytes")
            self.metrics.load_took("bytes", load_s)

    async def _get_as_loaded(self, request, hashes: list[bytes], block_bytes: int, lease_id: int | None, run):
        """Get's messages as the groups load (``_loaded_groups``): a header per group, then its chunks."""
        chunk_bytes = self._limits.chunk_bytes(request.chunk_bytes)
        started, tiers, sent = time.perf_counter(), [], SentBlocks()
        groups = self._loaded_groups(request.namespace_id, hashes, block_bytes, lease_id, run)
        try:
            async with contextlib.aclosing(groups):
                async for result, dsts in groups:
                    first_index = len(tiers)
                    tiers += result.tiers
                    yield pb.GetResponse(header=pb.GetHeader(requested_blocks=len(hashes), tiers=result.tiers,
                                                             block_bytes=block_bytes))
                    for index, offset, data in sent.chunks(dsts[: result.loaded_blocks], first_index, chunk_bytes):
                        yield encode_chunk(index, offset, data)
        finally:
            self.metrics.loaded(request.namespace_id, tiers[: sent.count], "bytes")
            self.metrics.load_took("bytes", time.perf_counter() - started)

    async def _loaded_groups(self, ns_id: bytes, hashes: list[bytes], block_bytes: int, lease_id: int | None, run):
        """``(LoadResult, dsts)`` per group of about STREAM_GROUP_BYTES, in order: group i+1 loads (by
        ``run``, on a transfer thread) while group i is sent; stops after the first group that loads short (one empty
        group for no hashes).

        The lease pins every block meanwhile, but the groups load without it: ``store.load`` ends
        the lease it is given. A block deleted while leased is readable only with the lease, so
        after a short group the rest (from its first missing block) loads once more, in one call
        that presents the lease and ends it. Otherwise the lease is released after the last group
        (or when the stream is closed early): it ends exactly once either way.
        """
        per_group = max(1, STREAM_GROUP_BYTES // block_bytes)
        groups = [hashes[i : i + per_group] for i in range(0, len(hashes), per_group)] or [[]]
        load = functools.partial(store_calls.load_group, self._store, ns_id, block_bytes)
        pending, first_index = run(load, groups[0]), 0
        try:
            for g in range(len(groups)):
                result, dsts = await pending
                pending = None
                if not result.complete and lease_id is not None:
                    yield result, dsts
                    self._lease_ended(lease_id)  # the load below ends it in the store
                    lease, lease_id = lease_id, None
                    yield await run(load, hashes[first_index + result.loaded_blocks :], lease)
                    return
                if result.complete and g + 1 < len(groups):
                    pending = run(load, groups[g + 1])
                yield result, dsts
                if pending is None:
                    return
                first_index += len(groups[g])
        finally:
            if pending is not None:  # the client went away mid-stream: let the load finish, unread
                pending.add_done_callback(lambda f: f.cancelled() or f.exception())
            await self._end_lease(lease_id)

    @translate_errors
    async def GetSlots(self, request, context):
        self._limits.check_blocks("max_lookup_blocks", len(request.block_hashes))  # no payload bytes move
        client = client_of(context)
        fit = wire.slots_that_fit(self._limits.max_message_bytes, self._store.spec(request.namespace_id).num_layers)
        started, leased_after = time.perf_counter(), time.monotonic()
        with self._leases.taking(client):
            grant = await self._leasing(context, shm.leased_slots, self._store, request.namespace_id,
                                        list(request.block_hashes), request.lease_ttl_s, fit)
            if grant.lease_id is not None:
                self._leases.add(client, grant.lease_id, request.lease_ttl_s)
        if grant.slots:  # counted at Release, as many as the client copied
            self._granted_slots.add(grant.lease_id, request.namespace_id, request.block_hashes[: len(grant.slots)],
                                    request.lease_ttl_s)
        if self._data_plane is not None and grant.slots:
            grant = await self._granted(grant, leased_after + request.lease_ttl_s)
        self.metrics.load_took("shm", time.perf_counter() - started)
        return wire.slots_to_proto(grant)

    @translate_errors
    async def Put(self, request_iterator, context):
        with self._transfers.stream(client_of(context)) as stream:
            pace = StreamPace(self._limits)
            header = wire.put_header(await pace.wait(anext(request_iterator, None), "sent no PutHeader"))
            hashes, parent = list(header.block_hashes), wire.optional(header, "parent")
            spec = self._store.spec(header.namespace_id)
            self._limits.check_transfer(len(hashes), spec.block_bytes)
            store_calls.check_put_chain(hashes, parent)
            check_block_bytes(header.block_bytes, spec.block_bytes, "block payload", len(hashes))
            assembler = BlockAssembler(len(hashes), spec.block_bytes, self._limits.max_chunk_bytes)
            started = time.perf_counter()
            while (message := await pace.wait(anext(request_iterator, None), "sent no chunk")) is not None:
                chunk = wire.put_chunk(message)
                assembler.add(chunk.block_index, chunk.offset, chunk.data)
                pace.moved(len(chunk.data))
            return await self._put(header.namespace_id, hashes, assembler.finish(), parent, started, run=stream.run)

    @translate_errors
    async def ReserveSlots(self, request, context):
        staging = self._staging_area()
        hashes, parent = tuple(request.block_hashes), wire.optional(request, "parent")
        spec = self._store.spec(request.namespace_id)
        self._limits.check_transfer(len(hashes), spec.block_bytes)
        store_calls.check_put_chain(hashes, parent)
        check_block_bytes(request.block_bytes, spec.block_bytes, "block payload", len(hashes))
        ttl_s = request.ttl_s or DEFAULT_RESERVATION_TTL_S
        reserve = functools.partial(staging.reserve, request.namespace_id, hashes, parent,
                                    spec.block_bytes, spec.num_layers, ttl_s, owner=client_of(context),
                                    owner_limit=self._limits.max_reservations_per_client)
        reservation = await store_calls.undone_if_abandoned(staging.cancel, context, reserve)
        return wire.reservation_to_proto(reservation, staging.segment_path, ttl_s)

    @translate_errors
    async def CommitSlots(self, request, context):
        staging, client = self._staging_area(), client_of(context)
        checksums = wire.commit_checksums(request)
        with contextlib.ExitStack() as transfer:
            try:  # a transfer like Put: it copies the blocks out of staging and stores them
                stream = transfer.enter_context(self._transfers.stream(client))
            except LimitExceeded:  # refused: the reservation ends too, as after any failed commit
                staging.drop(request.reservation_id, client)
                raise
            started = time.perf_counter()
            reservation, result = await stream.run(store_calls.commit, self._store, staging,
                                                   request.reservation_id, checksums, client)
            nbytes = len(reservation.block_hashes) * reservation.block_bytes
            return await self._put_answer(reservation.ns_id, list(reservation.block_hashes), result, nbytes, started,
                                          stream.run)

    async def _granted(self, grant: shm.SlotGrant, lease_ends_by: float) -> shm.SlotGrant:
        """``grant`` with a data-plane grant of its slots that ends before its lease does
        (``lease_ends_by``: a ``time.monotonic()`` instant no later than the lease's expiry)."""
        try:
            token = self._data_plane.grant(grant.lease_id, [(s.offset, s.nbytes) for s in grant.slots],
                                           deadline=lease_ends_by - GRANT_MARGIN_S)
        except BaseException:
            await self._end_lease(grant.lease_id)
            raise
        return dataclasses.replace(grant, data_grant=token, data_port=self._data_plane.port) if token else grant

    def _lease_ended(self, lease_id: int) -> GrantedLoad | None:
        """Forget ``lease_id``; call it before the store ends the lease (the data plane's revoke
        guarantees no slot of it is read afterwards). Returns the slots GetSlots granted under it,
        if any: only a Release counts them."""
        self._leases.drop(lease_id)
        if self._data_plane is not None:
            self._data_plane.revoke(lease_id)
        return self._granted_slots.pop(lease_id)

    async def _end_lease(self, lease_id: int | None) -> None:
        """End ``lease_id`` (if any) now: forgotten here, then released in the store."""
        if lease_id is not None:
            self._lease_ended(lease_id)
            await asyncio.to_thread(store_calls.release_quietly, self._store, lease_id)

    async def _leasing(self, context, take, *args):
        """``take(*args)``, a store call whose result may carry a ``lease_id``, on a worker thread
        (``store_calls.undone_if_abandoned``: a lease taken for a call given up on is released)."""
        return await store_calls.undone_if_abandoned(self._release_orphaned_lease, context, take, *args)

    def _release_orphaned_lease(self, result) -> None:
        if result.lease_id is not None:
            store_calls.release_quietly(self._store, result.lease_id)

    async def _put(self, ns_id: bytes, hashes: list[bytes], payloads: list, parent: bytes | None,
                   started: float, run) -> pb.PutResponse:
        """Store ``payloads`` by ``run`` (a Put stream's ``TransferStream.run``) and answer."""
        result = await run(self._store.put, ns_id, hashes, payloads, parent)
        return await self._put_answer(ns_id, hashes, result, sum(p.nbytes for p in payloads), started, run)

    async def _put_answer(self, ns_id: bytes, hashes: list[bytes], result: PutResult, nbytes: int, started: float,
                          run) -> pb.PutResponse:
        """A put's answer and metrics; under ``--durable-puts`` once the blocks reached the disk (``run``
        makes the store calls)."""
        durable = False
        if self._durable_puts:  # durable only if every block reached the disk (a copy refused for room did not)
            durable = await run(store_calls.flush_durable, self._store, ns_id, hashes)
        self.metrics.put(ns_id, hashes, result.stored, result.duplicates, result.rejected, nbytes,
                         time.perf_counter() - started)
        return wire.put_result_to_proto(result, durable=durable)

    def _staging_area(self) -> StagingArea:
        if self._staging is None:
            raise KVStoreError("this sidecar has no staging area for shared-memory puts (started with "
                               "--staging-capacity 0); use Put")
        return self._staging

    @translate_errors
    async def Release(self, request, context):
        self._leases.check_owner(client_of(context), request.lease_id)
        granted = self._lease_ended(request.lease_id)
        await asyncio.to_thread(self._store.release, request.lease_id)  # expired: NOT_FOUND, nothing counted
        if granted is not None:
            await self._count_copied(granted, wire.optional(request, "copied_blocks"))
        return pb.ReleaseResponse()

    async def _count_copied(self, granted: GrantedLoad, reported: int | None) -> None:
        """Count the granted slots the client copied (``GrantedLoad.copied``) as loaded, in the
        metrics and in the store (its counters and its policy's recency); a block the client took
        through Get instead was counted by that Get. The lease is released already, so a store
        closing meanwhile must not fail the Release: those counts are dropped."""
        copied = granted.copied(reported)
        try:
            self.metrics.loaded(granted.ns_id, [HostTier.name] * copied, "shm")
            await asyncio.to_thread(self._store.record_access, granted.ns_id, granted.block_hashes[:copied],
                                    HostTier.name)
        except StoreClosed:
            pass

    @translate_errors
    async def ReportPrefill(self, request, context):
        self._store.spec(request.namespace_id)  # an unknown namespace is NOT_FOUND
        self.metrics.prefill(request.namespace_id, request.saved_tokens, request.computed_tokens)
        return pb.ReportPrefillResponse()

    @translate_errors
    async def DeleteNamespace(self, request, context):
        removed = await asyncio.to_thread(self._store.delete_namespace, request.namespace_id)
        return pb.DeleteNamespaceResponse(removed_blocks=removed)

    @translate_errors
    async def Stats(self, request, context):
        return wire.stats_to_proto(await asyncio.to_thread(self._store.stats))
