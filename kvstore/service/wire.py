"""Protobuf messages <-> the store's own types, in both directions (server and client).

Numbers cross as they are; ``TierStats.extra`` values cross as strings. This module knows the
message shapes and nothing about what the store does with them.
"""

from __future__ import annotations

from dataclasses import fields
from typing import NamedTuple

from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace
from kvstore.layout import BlockSpec
from kvstore.results import LookupResult, PutResult, StoreStats
from kvstore.service.shm import Slot, SlotGrant
from kvstore.service.staging import Reservation
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.tiers.base import TierStats

MAX_NAMESPACE_STRING_CHARS = 4096  # any one string of a registered namespace (a name, salt, hash, key or value)
MAX_NAMESPACE_JSON_CHARS = 16384  # its whole canonical_json: a namespace stays in memory until the sidecar restarts
MAX_REQUEST_BYTES = 4 * MAX_NAMESPACE_JSON_CHARS  # a RegisterNamespace request, refused unread past it (JSON escapes, field tags)
_NAMESPACE_OPTIONAL = ("block_size", "engine", "engine_version", "weights_hash", "cache_salt", "hash_algorithm")
_TIER_NUMBERS = tuple(f.name for f in fields(TierStats) if f.name not in ("name", "extra"))
_STORE_NUMBERS = tuple(f.name for f in fields(StoreStats) if f.name not in ("tiers", "counters"))


def optional(message, name: str):
    """The value of a proto3 ``optional`` field, or None when unset."""
    return getattr(message, name) if message.HasField(name) else None


# ---- namespaces ------------------------------------------------------------------------

def namespace_from_request(request: pb.RegisterNamespaceRequest) -> Namespace:
    """The namespace a RegisterNamespace call names; ``InvalidRequest`` for anything else."""
    which = request.WhichOneof("namespace")
    if which is None:
        raise InvalidRequest("RegisterNamespace needs the namespace's fields or its canonical_json")
    if (size := request.ByteSize()) > MAX_REQUEST_BYTES:  # before parsing: a 4 MiB one held the event loop 1.4 s
        raise InvalidRequest(f"a RegisterNamespace request of {size} bytes, at most {MAX_REQUEST_BYTES}: a namespace's "
                             f"canonical_json has at most {MAX_NAMESPACE_JSON_CHARS} characters")
    try:
        if which == "canonical_json":
            return _within_size(Namespace.from_json(request.canonical_json))
        return _within_size(_namespace_from_fields(request.fields))
    except InvalidRequest:
        raise
    except RecursionError:  # json.loads of arrays or objects nested thousands deep
        raise InvalidRequest("canonical_json is nested too deeply to be a namespace; send "
                             "Namespace.canonical_json() or the Namespace message's fields") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidRequest(f"not a valid namespace ({exc!r}); send Namespace.canonical_json() "
                             f"or the Namespace message's fields") from None


def _within_size(namespace: Namespace) -> Namespace:
    """``namespace``, if its strings and its canonical_json are within MAX_NAMESPACE_STRING_CHARS and
    MAX_NAMESPACE_JSON_CHARS; else ``InvalidRequest`` naming the field and the limit."""
    strings = [(f.name, value) for f in fields(namespace) if isinstance(value := getattr(namespace, f.name), str)]
    strings += [("components", c) for c in namespace.components] + [("extra", s) for kv in namespace.extra for s in kv
                                                                                      if isinstance(s, str)]
    for name, value in strings:
        if len(value) > MAX_NAMESPACE_STRING_CHARS:
            raise InvalidRequest(f"Namespace.{name} has a string of {len(value)} characters, at most "
                                 f"{MAX_NAMESPACE_STRING_CHARS}: the sidecar keeps every namespace in memory until "
                                 "it restarts (pass a digest of a longer value)")
    size = len(namespace.canonical_json())
    if size > MAX_NAMESPACE_JSON_CHARS:
        raise InvalidRequest(f"the namespace's canonical_json has {size} characters, at most {MAX_NAMESPACE_JSON_CHARS} "
                             f"({len(namespace.extra)} extra pairs, {len(namespace.components)} components): the "
                             "sidecar keeps every namespace in memory until it restarts")
    return namespace


def _namespace_from_fields(msg: pb.Namespace) -> Namespace:
    given = {name: getattr(msg, name) for name in _NAMESPACE_OPTIONAL if msg.HasField(name)}
    return Namespace(model=msg.model, model_config_hash=msg.model_config_hash, num_layers=msg.num_layers,
                     components=tuple(msg.components), extra=tuple((kv.key, kv.value) for kv in msg.extra),
                     **given)


class Registration(NamedTuple):
    """What a RegisterNamespace answers: the namespace's id and the byte layout the sidecar gives
    its blocks (a client checks it against its own ``BlockSpec``)."""

    namespace_id: bytes
    block_bytes: int
    layer_bytes: int
    num_layers: int
    block_size: int

    def matches(self, spec: BlockSpec) -> bool:
        return (self.block_bytes, self.layer_bytes, self.num_layers, self.block_size) == \
            (spec.block_bytes, spec.layer_bytes, spec.num_layers, spec.block_size)


def registered(ns_id: bytes, spec: BlockSpec) -> pb.RegisterNamespaceResponse:
    return pb.RegisterNamespaceResponse(namespace_id=ns_id, block_bytes=spec.block_bytes, layer_bytes=spec.layer_bytes,
                                        num_layers=spec.num_layers, block_size=spec.block_size)


def registration_from_proto(msg: pb.RegisterNamespaceResponse) -> Registration:
    return Registration(msg.namespace_id, msg.block_bytes, msg.layer_bytes, msg.num_layers, msg.block_size)


# ---- lookup and put ----------------------------------------------------------------------

def lookup_to_proto(result: LookupResult) -> pb.LookupResponse:
    return pb.LookupResponse(num_blocks=result.num_blocks, block_size=result.block_size, tiers=result.tiers,
                             lease_id=result.lease_id, lease_refused=result.lease_refused)


def lookup_from_proto(msg: pb.LookupResponse) -> LookupResult:
    return LookupResult(msg.num_blocks, msg.block_size, tuple(msg.tiers), optional(msg, "lease_id"), msg.lease_refused)


SLOTS_MARGIN_BYTES = 4 << 10  # a GetSlotsResponse's other fields: a segment path, a data-plane grant, counts


def slots_that_fit(max_message_bytes: int, num_layers: int) -> int:
    """The most slots of ``num_layers`` checksums one GetSlotsResponse carries within
    ``max_message_bytes`` (at least 1). A slot costs at most its two varints (11 bytes each with
    their tags), its packed checksums (10 bytes each) and two framings (4 bytes each): at 61
    layers a 4 MiB message holds 6,500 slots, while a lookup may name 16,384 blocks."""
    slot_bytes = 2 * 11 + 10 * num_layers + 2 * 4
    return max(1, (max_message_bytes - SLOTS_MARGIN_BYTES) // slot_bytes)


def slots_to_proto(grant: SlotGrant) -> pb.GetSlotsResponse:
    slots = [pb.Slot(offset=s.offset, nbytes=s.nbytes, layer_checksums=s.layer_checksums) for s in grant.slots]
    return pb.GetSlotsResponse(requested_blocks=grant.requested_blocks, hit_blocks=grant.hit_blocks,
                               segment_path=grant.segment_path, slots=slots, lease_id=grant.lease_id,
                               lease_refused=grant.lease_refused, block_bytes=grant.block_bytes,
                               data_grant=grant.data_grant, data_port=grant.data_port)


def slots_from_proto(msg: pb.GetSlotsResponse) -> SlotGrant:
    slots = tuple(Slot(s.offset, s.nbytes, tuple(s.layer_checksums)) for s in msg.slots)
    return SlotGrant(msg.requested_blocks, msg.hit_blocks, msg.segment_path, slots, optional(msg, "lease_id"),
                     msg.lease_refused, msg.block_bytes, msg.data_grant, msg.data_port)


def put_header(message: pb.PutRequest | None) -> pb.PutHeader:
    """The header a Put stream must open with."""
    if message is None or message.WhichOneof("kind") != "header":
        raise InvalidRequest("a Put stream must open with a PutHeader (namespace, block hashes, block bytes)")
    return message.header


def put_chunk(message: pb.PutRequest) -> pb.Chunk:
    """A chunk of a Put stream; only the first message is a header."""
    if message.WhichOneof("kind") != "chunk":
        raise InvalidRequest("a Put stream has one PutHeader, first; every later message must be a Chunk")
    return message.chunk


def put_result_to_proto(result: PutResult, durable: bool = False) -> pb.PutResponse:
    return pb.PutResponse(stored=result.stored, duplicates=result.duplicates, rejected=result.rejected,
                          durable=durable)


def put_result_from_proto(msg: pb.PutResponse) -> PutResult:
    return PutResult(msg.stored, msg.duplicates, msg.rejected)


def reservation_to_proto(reservation: Reservation, segment_path: str, ttl_s: float) -> pb.ReserveSlotsResponse:
    slots = [pb.Slot(offset=o, nbytes=reservation.block_bytes) for o in reservation.offsets]
    return pb.ReserveSlotsResponse(reservation_id=reservation.reservation_id, segment_path=segment_path,
                                   slots=slots, ttl_s=ttl_s, num_layers=reservation.num_layers)


def commit_checksums(request: pb.CommitSlotsRequest) -> list[tuple[int, ...]]:
    return [tuple(block.layer_checksums) for block in request.blocks]


# ---- stats ---------------------------------------------------------------------------

def stats_to_proto(stats: StoreStats) -> pb.StatsResponse:
    tiers = [pb.TierStats(name=t.name, extra={k: str(v) for k, v in t.extra.items()},
                          **{n: getattr(t, n) for n in _TIER_NUMBERS}) for t in stats.tiers]
    return pb.StatsResponse(tiers=tiers, counters=stats.counters, **{n: getattr(stats, n) for n in _STORE_NUMBERS})


def stats_from_proto(msg: pb.StatsResponse) -> StoreStats:
    tiers = tuple(TierStats(name=t.name, extra=dict(t.extra), **{n: getattr(t, n) for n in _TIER_NUMBERS})
                  for t in msg.tiers)
    return StoreStats(tiers=tiers, counters=dict(msg.counters), **{n: getattr(msg, n) for n in _STORE_NUMBERS})
