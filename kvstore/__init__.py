"""mla-kvstore: a tiered KV-cache store for MLA/DSA models with prefix reuse.

The one public object is ``TieredStore`` (built from a ``StoreConfig``); keys come from
``kvstore.keys``, byte geometry from ``kvstore.layout``.
"""

from kvstore.buffers import aligned_empty
from kvstore.config import DiskConfig, HostConfig, StoreConfig
from kvstore.errors import InvalidRequest, KVStoreError, UnknownLease, UnknownNamespace
from kvstore.keys import Namespace, chain_hashes, namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.results import LoadResult, LookupResult, PutResult, StoreStats
from kvstore.store import TieredStore

__all__ = [
    "BlockSpec", "DiskConfig", "HostConfig", "InvalidRequest", "KVStoreError", "LoadResult",
    "LookupResult", "Namespace", "PutResult", "StoreConfig", "StoreStats", "TieredStore",
    "UnknownLease", "UnknownNamespace", "aligned_empty", "chain_hashes", "namespace_hashes",
]
