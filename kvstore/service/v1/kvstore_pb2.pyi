from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReadSlotsRequest(_message.Message):
    __slots__ = ("grant", "chunk_bytes", "first_slot", "num_slots")
    GRANT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    grant: bytes
    chunk_bytes: int
    first_slot: int
    num_slots: int
    def __init__(self, grant: _Optional[bytes] = ..., chunk_bytes: _Optional[int] = ..., first_slot: _Optional[int] = ..., num_slots: _Optional[int] = ...) -> None: ...

class SlotBytes(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class Namespace(_message.Message):
    __slots__ = ("model", "model_config_hash", "num_layers", "components", "block_size", "engine", "engine_version", "weights_hash", "cache_salt", "hash_algorithm", "extra")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_config_hash: str
    num_layers: int
    components: _containers.RepeatedScalarFieldContainer[str]
    block_size: int
    engine: str
    engine_version: str
    weights_hash: str
    cache_salt: str
    hash_algorithm: str
    extra: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, model: _Optional[str] = ..., model_config_hash: _Optional[str] = ..., num_layers: _Optional[int] = ..., components: _Optional[_Iterable[str]] = ..., block_size: _Optional[int] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., weights_hash: _Optional[str] = ..., cache_salt: _Optional[str] = ..., hash_algorithm: _Optional[str] = ..., extra: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class KeyValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("fields", "canonical_json")
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    CANONICAL_JSON_FIELD_NUMBER: _ClassVar[int]
    fields: Namespace
    canonical_json: str
    def __init__(self, fields: _Optional[_Union[Namespace, _Mapping]] = ..., canonical_json: _Optional[str] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "block_bytes", "layer_bytes", "num_layers", "block_size")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_bytes: int
    layer_bytes: int
    num_layers: int
    block_size: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., layer_bytes: _Optional[int] = ..., num_layers: _Optional[int] = ..., block_size: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "lease_ttl_s", "probe")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_s: float
    probe: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., lease_ttl_s: _Optional[float] = ..., probe: bool = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_blocks", "block_size", "tiers", "lease_id", "lease_refused")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_REFUSED_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    block_size: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    lease_id: int
    lease_refused: bool
    def __init__(self, num_blocks: _Optional[int] = ..., block_size: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., lease_id: _Optional[int] = ..., lease_refused: bool = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "lease_id", "chunk_bytes", "block_bytes", "stream_as_loaded")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_AS_LOADED_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_id: int
    chunk_bytes: int
    block_bytes: int
    stream_as_loaded: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., lease_id: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., stream_as_loaded: bool = ...) -> None: ...

class GetHeader(_message.Message):
    __slots__ = ("requested_blocks", "tiers", "block_bytes")
    REQUESTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    requested_blocks: int
    tiers: _containers.RepeatedScalarFieldContainer[str]
    block_bytes: int
    def __init__(self, requested_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[str]] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("block_index", "offset", "data")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    offset: int
    data: bytes
    def __init__(self, block_index: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: GetHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[GetHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class GetSlotsRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "lease_ttl_s")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ttl_s: float
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("offset", "nbytes", "layer_checksums")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    nbytes: int
    layer_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., layer_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class GetSlotsResponse(_message.Message):
    __slots__ = ("requested_blocks", "hit_blocks", "segment_path", "slots", "lease_id", "lease_refused", "block_bytes", "data_grant", "data_port")
    REQUESTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_REFUSED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_GRANT_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    requested_blocks: int
    hit_blocks: int
    segment_path: str
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    lease_id: int
    lease_refused: bool
    block_bytes: int
    data_grant: bytes
    data_port: int
    def __init__(self, requested_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., segment_path: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., lease_id: _Optional[int] = ..., lease_refused: bool = ..., block_bytes: _Optional[int] = ..., data_grant: _Optional[bytes] = ..., data_port: _Optional[int] = ...) -> None: ...

class PutHeader(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "parent", "block_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    block_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., block_bytes: _Optional[int] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: PutHeader
    chunk: Chunk
    def __init__(self, header: _Optional[_Union[PutHeader, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "duplicates", "rejected", "durable")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    rejected: int
    durable: bool
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., rejected: _Optional[int] = ..., durable: bool = ...) -> None: ...

class ReserveSlotsRequest(_message.Message):
    __slots__ = ("namespace_id", "block_hashes", "parent", "block_bytes", "ttl_s")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    block_bytes: int
    ttl_s: float
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class ReserveSlotsResponse(_message.Message):
    __slots__ = ("reservation_id", "segment_path", "slots", "ttl_s", "num_layers")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_PATH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    segment_path: str
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    ttl_s: float
    num_layers: int
    def __init__(self, reservation_id: _Optional[int] = ..., segment_path: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., ttl_s: _Optional[float] = ..., num_layers: _Optional[int] = ...) -> None: ...

class LayerChecksums(_message.Message):
    __slots__ = ("layer_checksums",)
    LAYER_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    layer_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitSlotsRequest(_message.Message):
    __slots__ = ("reservation_id", "blocks")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: int
    blocks: _containers.RepeatedCompositeFieldContainer[LayerChecksums]
    def __init__(self, reservation_id: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[LayerChecksums, _Mapping]]] = ...) -> None: ...

class ReportPrefillRequest(_message.Message):
    __slots__ = ("namespace_id", "saved_tokens", "computed_tokens")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    SAVED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    saved_tokens: int
    computed_tokens: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., saved_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class ReportPrefillResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "copied_blocks")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    COPIED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    copied_blocks: int
    def __init__(self, lease_id: _Optional[int] = ..., copied_blocks: _Optional[int] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteNamespaceRequest(_message.Message):
    __slots__ = ("namespace_id",)
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ...) -> None: ...

class DeleteNamespaceResponse(_message.Message):
    __slots__ = ("removed_blocks",)
    REMOVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    removed_blocks: int
    def __init__(self, removed_blocks: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "bytes_read", "bytes_written", "checksum_failures", "io_errors", "hit_blocks", "loaded_blocks", "evictions", "demotions_in", "promotions_in", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FAILURES_FIELD_NUMBER: _ClassVar[int]
    IO_ERRORS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DEMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_IN_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    bytes_read: int
    bytes_written: int
    checksum_failures: int
    io_errors: int
    hit_blocks: int
    loaded_blocks: int
    evictions: int
    demotions_in: int
    promotions_in: int
    extra: _containers.ScalarMap[str, str]
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., bytes_read: _Optional[int] = ..., bytes_written: _Optional[int] = ..., checksum_failures: _Optional[int] = ..., io_errors: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., demotions_in: _Optional[int] = ..., promotions_in: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "namespaces", "lookups", "lookup_blocks", "hit_blocks", "puts", "stored_blocks", "duplicate_blocks", "rejected_blocks", "leases_active", "lease_expiries", "counters")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRIES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: int
    lookups: int
    lookup_blocks: int
    hit_blocks: int
    puts: int
    stored_blocks: int
    duplicate_blocks: int
    rejected_blocks: int
    leases_active: int
    lease_expiries: int
    counters: _containers.ScalarMap[str, int]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[int] = ..., lookups: _Optional[int] = ..., lookup_blocks: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., puts: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., duplicate_blocks: _Optional[int] = ..., rejected_blocks: _Optional[int] = ..., leases_active: _Optional[int] = ..., lease_expiries: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ...) -> None: ...
