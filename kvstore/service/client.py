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

Same host, puts: ``put_shm`` reserves staging slots (ReserveSlots), writes the payloads straight
into the mapped staging segment and commits them with their checksums (CommitSlots); it falls
back to ``put`` where the segment cannot be mapped or the sidecar has no staging area.

Auth: ``token`` (default: ``KVSTORE_TOKEN``, or the first line of ``KVSTORE_TOKEN_FILE``) goes
as ``authorization: Bearer TOKEN`` on every call; ``root_certificates`` (PEM; default: the file
``KVSTORE_TLS_CA`` names) makes the channel TLS. Every call also names the client (``kvstore-client`` metadata, random per instance), which
the server's per-client limits count by.

Same host, gets: ``load_shm`` takes the fast path (``kvstore.service.shm``): one GetSlots call leases
the hit and says where its host-tier blocks sit in the sidecar's shared-memory segment; they are
copied straight from a read-only mapping (cached per segment path) into ``dsts``, the rest of the
hit comes through Get, then the lease is released. A client that cannot map the segment (another
host or container) has the same host-tier blocks streamed by the sidecar's native data plane
(``kvstore.service.dataplane``: BlockData.ReadSlots on the port GetSlots names, at the host of
``target``), and every block through Get where there is none; the result is the same.

It knows the wire and the segment layout only: no caching of blocks. Thread-safe: one client may
serve many threads.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from typing import Iterator, Sequence

import grpc
import numpy as np

from kvstore.buffers import byte_view
from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace
from kvstore.checksum import layer_checksums, layers_match
from kvstore.results import LoadResult, LookupResult, PutResult, StoreStats
from kvstore.service import dataplane, wire
from kvstore.service.chunk_codec import decode_chunk
from kvstore.service.chunks import BlockAssembler, check_block_bytes, iter_chunks
from kvstore.service.data_plane_link import DataPlaneLink
from kvstore.service import security
from kvstore.service.heap import keep_heap_for_transfers
from kvstore.service.limits import ServiceLimits
from kvstore.service.metadata import MetadataInterceptor
from kvstore.service.shm import SegmentMaps, SlotGrant
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from kvstore.tiers.host import HostTier

STAGING_WRITE_MARGIN = 0.1  # put_shm writes no slot in the last tenth of its reservation's TTL


class KVStoreClient:
    def __init__(self, target: str, timeout_s: float | None = 60.0, limits: ServiceLimits = ServiceLimits(),
                 token: str | None = None, root_certificates: bytes | None = None, *,
                 shared_memory: bool = True, data_plane: bool = True, data_plane_streams: int | None = None):
        """``target``: ``HOST:PORT`` or ``unix:PATH``. ``timeout_s`` bounds every call (None: no bound);
        ``limits`` must match the server's (chunk and message sizes). ``token``: the sidecar's bearer
        token (None: from the environment, if set there); ``root_certificates``: PEM roots for TLS.
        ``shared_memory=False`` never maps the sidecar's segments (behaves as from another host);
        ``data_plane=False`` never uses the native data plane (Get carries every byte);
        ``data_plane_streams``: concurrent ReadSlots calls per read (None: ``dataplane.default_streams``)."""
        keep_heap_for_transfers()  # Get's messages and gRPC's read buffers: no page faults per transfer
        options = limits.channel_options()
        root_certificates = root_certificates if root_certificates is not None else _ca_from_env()
        if root_certificates is not None:
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates), options=options)
        else:
            channel = grpc.insecure_channel(target, options=options)
        token = token if token is not None else security.load_token(*security.token_from_env())
        self.client_id = uuid.uuid4().hex
        metadata = [("kvstore-client", self.client_id)] + ([("authorization", f"Bearer {token}")] if token else [])
        self._channel = channel
        intercepted = grpc.intercept_channel(channel, MetadataInterceptor(metadata))
        self._stub = KVStoreStub(intercepted)
        # Get's messages are parsed by hand (kvstore.service.chunk_codec): the raw bytes come through
        self._get_raw = intercepted.unary_stream("/kvstore.v1.KVStore/Get",
                                                 request_serializer=pb.GetRequest.SerializeToString)
        self._timeout = timeout_s
        self._limits = limits
        self._shared_memory = shared_memory
        streams = data_plane_streams or dataplane.default_streams()
        self._data_plane = DataPlaneLink(target, root_certificates, token, self.client_id, streams) \
            if data_plane and dataplane.available() else None
        self._segments = SegmentMaps()
        self._staging = SegmentMaps(writable=True)
        self._staging_refused = False

    def wait_ready(self, timeout_s: float = 10.0) -> None:
        """Block until the channel connects; raises ``grpc.FutureTimeoutError`` after ``timeout_s``."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def register_namespace(self, namespace: Namespace, timeout_s: float | None = None) -> bytes:
        """Make ``namespace`` usable on the server; idempotent. Returns its 16-byte id.
        ``timeout_s`` bounds this call instead of the client's timeout."""
        return self.register(namespace, timeout_s).namespace_id

    def register(self, namespace: Namespace, timeout_s: float | None = None) -> wire.Registration:
        """``register_namespace``, answering the block layout the server gives the namespace too:
        check it against your ``BlockSpec`` (``Registration.matches``), for a server of another
        version may lay blocks out differently."""
        request = pb.RegisterNamespaceRequest(canonical_json=namespace.canonical_json())
        return wire.registration_from_proto(self._stub.RegisterNamespace(request, timeout=timeout_s or self._timeout))

    def lookup(self, ns_id: bytes, block_hashes: Sequence[bytes], lease_ttl_s: float | None = None,
               timeout_s: float | None = None) -> LookupResult:
        """Longest contiguous hit; with ``lease_ttl_s``, a lease pins the hit blocks for that long.
        ``timeout_s`` bounds this call instead of the client's timeout."""
        request = pb.LookupRequest(namespace_id=ns_id, block_hashes=block_hashes, lease_ttl_s=lease_ttl_s)
        return wire.lookup_from_proto(self._stub.Lookup(request, timeout=timeout_s or self._timeout))

    def holds(self, ns_id: bytes, block_hash: bytes, timeout_s: float | None = None) -> bool:
        """Whether a lookup would hit ``block_hash``, asked without a lease and without counting a
        lookup (a probe: an engine about to demote a device page asks first)."""
        request = pb.LookupRequest(namespace_id=ns_id, block_hashes=[block_hash], probe=True)
        return wire.lookup_from_proto(self._stub.Lookup(request, timeout=timeout_s or self._timeout)).hit_blocks == 1

    def load(self, ns_id: bytes, block_hashes: Sequence[bytes], dsts: Sequence,
             lease_id: int | None = None) -> LoadResult:
        """Copy whole blocks, in order, into ``dsts`` (one writable buffer of the block size each).

        Stops at the first block the server cannot serve: buffers ``[0, loaded_blocks)`` hold the
        blocks, the rest are untouched. Ends ``lease_id`` once the server has the call. Raises
        ``InvalidRequest`` for a stream that does not fill the buffers as asked (headers that
        disagree with the call: a sidecar of another version), never a result that says it did.
        """
        if len(dsts) != len(block_hashes):
            raise InvalidRequest(f"{len(block_hashes)} block hashes but {len(dsts)} destination buffers")
        views = [byte_view(d, writable=True) for d in dsts]
        block_bytes = _one_size(views, "destination buffers")
        request = pb.GetRequest(namespace_id=ns_id, block_hashes=block_hashes, lease_id=lease_id,
                                block_bytes=block_bytes, stream_as_loaded=True)
        stream = self._get_raw(request, timeout=self._timeout)
        tiers = list(_checked_header(next(stream, None), len(views), block_bytes, 0).tiers)
        assembler = BlockAssembler(len(tiers), block_bytes, self._limits.max_chunk_bytes, buffers=views,
                                   what="Get stream")
        for message in stream:  # a header per group of blocks, each followed by their chunks
            chunk = decode_chunk(message)
            if chunk is None:
                more = _checked_header(message, len(views), block_bytes, len(tiers)).tiers
                assembler.extend(len(more))
                tiers += more
                continue
            assembler.add(*chunk)
        assembler.finish()
        return LoadResult(len(block_hashes), tuple(tiers), len(tiers) * block_bytes)

    def get_slots(self, ns_id: bytes, block_hashes: Sequence[bytes], lease_ttl_s: float = 30.0) -> SlotGrant:
        """Lease the hit and locate its leading host-tier blocks; the caller must ``release`` the lease."""
        request = pb.GetSlotsRequest(namespace_id=ns_id, block_hashes=block_hashes, lease_ttl_s=lease_ttl_s)
        return wire.slots_from_proto(self._stub.GetSlots(request, timeout=self._timeout))

    def load_shm(self, ns_id: bytes, block_hashes: Sequence[bytes], dsts: Sequence, lease_ttl_s: float = 30.0,
                 verify: bool = False) -> LoadResult:
        """``load`` through the fast paths; the same contract and result, except that buffers past
        ``loaded_blocks`` may have been written (their bytes are no block's).

        Host-tier blocks are copied from the mapped segment (same host) or streamed by the data
        plane (another host), the rest of the hit comes through Get; blocks past the hit are not
        tried. ``verify`` checks each copied block's per-layer checksums (a mismatch sends that
        block and the rest through Get, and a granted block that comes back from Get is checked
        against the same checksums: the result stops before the first block that still fails, a
        miss). If the lease expired before the copies were done, they are discarded and every
        block comes through Get.
        """
        if len(dsts) != len(block_hashes):
            raise InvalidRequest(f"{len(block_hashes)} block hashes but {len(dsts)} destination buffers")
        views = [byte_view(d, writable=True) for d in dsts]
        try:
            grant = self.get_slots(ns_id, block_hashes, lease_ttl_s)
        except grpc.RpcError as exc:  # past a per-client limit (leases, say): Get takes no lease
            if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            return self._load_all(ns_id, block_hashes, views)
        if grant.lease_id is None:  # nothing hit, or the lease was refused: no pin, no mapping
            return self._load_all(ns_id, block_hashes, views) if grant.lease_refused else LoadResult(len(dsts), (), 0)
        try:
            check_block_bytes(_one_size(views, "destination buffers"), grant.block_bytes, "destination buffer",
                              len(views))
            copied = self._copy_slots(grant, views, verify)
            tail = self._load_batched(ns_id, block_hashes[copied : grant.hit_blocks], views[copied : grant.hit_blocks])
            if verify:
                tail = tail[: _verified_run(grant, views, copied, len(tail))]
        except BaseException:
            with contextlib.suppress(grpc.RpcError):  # the call's own error is the one to raise; the lease lapses
                self._release_if_held(grant.lease_id, 0)  # the call fails: the caller keeps no copy
            raise
        if not self._release_if_held(grant.lease_id, copied):  # expired while we copied: the slots may be reused
            return self._load_all(ns_id, block_hashes, views)
        served = (HostTier.name,) * copied + tail
        return LoadResult(len(block_hashes), served, len(served) * grant.block_bytes)

    def slot_views(self, grant: SlotGrant) -> list[np.ndarray]:
        """Read-only ``[block_bytes]`` views of the grant's leading slots that can be mapped here
        (none on another host). Their bytes are the blocks' only while the grant's lease lives."""
        if not self._shared_memory:
            return []
        views = []
        for slot in grant.slots:
            source = self._segments.slot(grant.segment_path, slot.offset, slot.nbytes)
            if source is None or slot.nbytes != grant.block_bytes:
                break
            views.append(source)
        return views

    def release_grant(self, grant: SlotGrant, copied_blocks: int) -> bool:
        """End the grant's lease, saying how many of its leading slots were copied and kept (mapped
        or streamed; the sidecar counts those as loaded, and blocks taken through Get instead where
        Get sent them). False when the lease had expired: copies taken from its slots are void, and
        none is counted."""
        return grant.lease_id is None or self._release_if_held(grant.lease_id, copied_blocks)

    def stream_slots(self, grant: SlotGrant, dsts: Sequence, first_slot: int = 0) -> int:
        """Copy the grant's slots ``[first_slot, first_slot + len(dsts))`` into ``dsts`` through the
        sidecar's data plane (for a client that cannot map the segment). Returns ``len(dsts)``, or
        0 where there is no data plane or the stream failed (``dsts`` then hold no block; take Get).
        The bytes are the blocks' only if ``release_grant`` then returns True."""
        if self._data_plane is None or not grant.data_grant or not dsts:
            return 0
        views = [byte_view(d, writable=True) for d in dsts]
        slots = grant.slots[first_slot : first_slot + len(views)]
        if len(slots) != len(views) or any(s.nbytes != v.nbytes for s, v in zip(slots, views)):
            raise InvalidRequest(f"{len(views)} buffers do not match slots [{first_slot}, {first_slot + len(views)}) "
                                 f"of a grant of {len(grant.slots)} slots of {grant.block_bytes} bytes")
        return len(views) if self._data_plane.read(grant, views, first_slot, self._timeout) else 0

    def _copy_slots(self, grant: SlotGrant, views: Sequence, verify: bool) -> int:
        """Copy the leading slots into ``views``; returns how many blocks were copied (with ``verify``:
        before the first that fails its checksums, which Get then fetches again)."""
        sources = self.slot_views(grant)
        if not sources and grant.slots and grant.block_bytes == views[0].nbytes:
            sources = views[: self.stream_slots(grant, views[: len(grant.slots)])]  # streamed in place
        for i, source in enumerate(sources):
            if source.nbytes != views[i].nbytes:
                return i
            if source is not views[i]:
                np.copyto(views[i], source)  # [block_bytes] uint8, memcpy with the GIL released
            if verify and not layers_match(views[i], grant.slots[i].layer_checksums):
                return i
        return len(sources)

    def _load_all(self, ns_id: bytes, block_hashes: Sequence[bytes], views: Sequence) -> LoadResult:
        """``load``'s result for every block, through Get calls within the transfer limits."""
        served = self._load_batched(ns_id, block_hashes, views)
        return LoadResult(len(block_hashes), served, sum(view.nbytes for view in views[: len(served)]))

    def _load_batched(self, ns_id: bytes, block_hashes: Sequence[bytes], views: Sequence) -> tuple[str, ...]:
        """Get in calls of at most max_transfer_blocks (and max_transfer_bytes); the tiers of the blocks
        served, stopping at a miss."""
        served: tuple[str, ...] = ()
        step = max(1, self._limits.transfer_blocks(views[0].nbytes)) if views else 1
        for start in range(0, len(block_hashes), step):
            result = self.load(ns_id, block_hashes[start : start + step], views[start : start + step])
            served += result.tiers
            if not result.complete:
                break
        return served

    def _release_if_held(self, lease_id: int, copied_blocks: int) -> bool:
        """Release the GetSlots lease ``lease_id``, of whose slots ``copied_blocks`` were copied and
        kept; False when the server no longer knows it (it expired)."""
        request = pb.ReleaseRequest(lease_id=lease_id, copied_blocks=copied_blocks)
        try:
            self._stub.Release(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return False
        return True

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
            yield pb.PutRequest(chunk=pb.Chunk(block_index=index, offset=offset, data=data.tobytes()))

    def put_shm(self, ns_id: bytes, block_hashes: Sequence[bytes], payloads: Sequence,
                parent: bytes | None = None, ttl_s: float = 30.0) -> PutResult:
        """``put`` through the same-host staging segment; the same contract and result.

        Falls back to ``put`` when the sidecar has no staging area, has no room in it now, or its
        segment cannot be mapped here (another host or container; ``shared_memory=False``); and
        when the reservation is about to lapse before a slot is written (its slots may go to
        another client: a late write would spoil that one's commit), lapsed by the commit, or its
        commit finds the slots changed (a late writer of a lapsed reservation spoiled them).
        """
        views = [byte_view(p) for p in payloads]
        if self._staging_refused or not self._shared_memory:
            return self.put(ns_id, block_hashes, payloads, parent)
        request = pb.ReserveSlotsRequest(namespace_id=ns_id, block_hashes=block_hashes, parent=parent,
                                         block_bytes=_one_size(views, "payloads"), ttl_s=ttl_s)
        reserved_at = time.monotonic()
        try:
            reservation = self._stub.ReserveSlots(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                self._staging_refused = True  # this sidecar has no staging area
            if exc.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise
            return self.put(ns_id, block_hashes, payloads, parent)
        write_by = reserved_at + reservation.ttl_s * (1 - STAGING_WRITE_MARGIN)
        checksums = []
        for view, slot in zip(views, reservation.slots):
            target = self._staging.slot(reservation.segment_path, slot.offset, slot.nbytes)
            if target is None:  # cannot map it here: the reservation lapses on its own
                self._staging_refused = True
                return self.put(ns_id, block_hashes, payloads, parent)
            if time.monotonic() > write_by:  # too late to write: the slot may be another client's soon
                return self.put(ns_id, block_hashes, payloads, parent)
            np.copyto(target, view)  # [block_bytes] uint8
            checksums.append(pb.LayerChecksums(layer_checksums=layer_checksums(view, reservation.num_layers)))
        commit = pb.CommitSlotsRequest(reservation_id=reservation.reservation_id, blocks=checksums)
        try:
            return wire.put_result_from_proto(self._stub.CommitSlots(commit, timeout=self._timeout))
        except grpc.RpcError as exc:  # lapsed, or its slots spoiled: nothing was stored
            if exc.code() not in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED):
                raise
            return self.put(ns_id, block_hashes, payloads, parent)

    def report_prefill(self, ns_id: bytes, saved_tokens: int, computed_tokens: int) -> None:
        """Tell the sidecar's metrics what a prefill saved (tokens loaded) and computed."""
        request = pb.ReportPrefillRequest(namespace_id=ns_id, saved_tokens=saved_tokens,
                                          computed_tokens=computed_tokens)
        self._stub.ReportPrefill(request, timeout=self._timeout)

    def release(self, lease_id: int, timeout_s: float | None = None) -> None:
        """End a Lookup's lease (a GetSlots lease: ``release_grant``); NOT_FOUND if it was never
        issued, already released, or expired. ``timeout_s`` bounds this call instead of the
        client's timeout."""
        self._stub.Release(pb.ReleaseRequest(lease_id=lease_id), timeout=timeout_s or self._timeout)

    def delete_namespace(self, ns_id: bytes) -> int:
        """Remove every block of a namespace from every tier; returns how many."""
        request = pb.DeleteNamespaceRequest(namespace_id=ns_id)
        return self._stub.DeleteNamespace(request, timeout=self._timeout).removed_blocks

    def stats(self) -> StoreStats:
        return wire.stats_from_proto(self._stub.Stats(pb.StatsRequest(), timeout=self._timeout))

    def drop_unlinked_segments(self) -> list[str]:
        """Unmap the sidecar's shared-memory segments that are no longer at their paths (its
        successor's start unlinked a killed sidecar's): call it while the sidecar does not answer,
        so their memory is freed for the new one's. Returns the paths dropped."""
        return self._segments.drop_unlinked() + self._staging.drop_unlinked()

    def close(self) -> None:
        self._channel.close()
        if self._data_plane is not None:
            self._data_plane.close()
        self._segments.close()
        self._staging.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ca_from_env() -> bytes | None:
    """PEM roots from ``KVSTORE_TLS_CA`` (a file): a sidecar serving TLS beyond loopback."""
    path = os.environ.get("KVSTORE_TLS_CA")
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidRequest(f"cannot read KVSTORE_TLS_CA={path!r}: {exc.strerror}") from None


def _verified_run(grant: SlotGrant, views: Sequence, first: int, count: int) -> int:
    """How many of ``views[first : first + count]`` (blocks Get served) match the checksums of
    their slots in ``grant``, stopping at the first that does not. Blocks past the slots were not
    on the host tier, and the tier that served them verified them."""
    for i in range(first, min(first + count, len(grant.slots))):
        if not layers_match(views[i], grant.slots[i].layer_checksums):
            return i - first
    return count


def _checked_header(message: bytes | None, requested: int, block_bytes: int, announced: int) -> pb.GetHeader:
    """The ``GetHeader`` in ``message``, a Get stream's first message or one after a group's chunks,
    checked against the call: ``requested`` blocks of ``block_bytes`` (the caller's buffers), of
    which earlier headers announced ``announced``. ``InvalidRequest`` names what disagrees."""
    response = pb.GetResponse.FromString(message) if message is not None else None
    if response is None or not response.HasField("header"):
        raise InvalidRequest("Get stream: the sidecar's answer did not start with a GetHeader")
    header = response.header
    if header.requested_blocks != requested or (requested and header.block_bytes != block_bytes):
        raise InvalidRequest(f"Get stream: the sidecar announced {header.requested_blocks} blocks of "
                             f"{header.block_bytes} bytes for a call of {requested} blocks of {block_bytes} bytes; "
                             "are the client and the sidecar of different versions?")
    if announced + len(header.tiers) > requested:
        raise InvalidRequest(f"Get stream: the sidecar announced {announced + len(header.tiers)} blocks for a "
                             f"call of {requested}")
    return header


def _one_size(views, what: str) -> int:
    """The common size of ``views`` (0 for none): one call moves blocks of one size."""
    sizes = sorted({v.nbytes for v in views})
    if len(sizes) > 1:
        raise InvalidRequest(f"the {what} of one call must all have the block size, got sizes {sizes}")
    return sizes[0] if sizes else 0
