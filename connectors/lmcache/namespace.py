"""The store namespace that holds one LMCache configuration's objects.

LMCache objects never mix with native blocks or with another LMCache configuration's: everything
that changes their bytes (model, KV shape and dtype, MLA or not, memory format, chunk size) goes
into the namespace, readable in ``extra`` and fingerprinted in ``model_config_hash``.

Geometry: a block holds the largest object (a full chunk) plus the frame header. The store sizes
blocks as ``num_layers x block_size x bytes per token`` of its component formats, so:

- ``block_size`` is LMCache's ``chunk_size``: one block per chunk, and the sidecar's token
  counters (lookups, hits) count LMCache's tokens exactly;
- ``components`` is ``("mla_bf16",)``: rows of ``chunk_size x 1152`` bytes, which is what an
  MLA layer of a bf16 chunk is;
- ``num_layers`` is the number of such rows that hold the header and the largest object. For
  DeepSeek-V3 (61 layers, bf16, 256-token chunks) that is 62: the 61 model layers and one row for
  the header, 18,284,544-byte blocks for 17,989,632-byte objects (1.6% overhead).

Pure: no LMCache, no torch (the connector passes names and sizes).
"""

from __future__ import annotations

from collections.abc import Mapping

from connectors.lmcache.framing import HEADER_BYTES, MAGIC
from kvstore.keys import Namespace, config_hash
from kvstore.layout import FORMATS

ENGINE = "lmcache"
ROW_FORMAT = FORMATS["mla_bf16"]


def lmcache_namespace(model: str, chunk_size: int, largest_object_bytes: int, identity: Mapping[str, str],
                      cache_salt: str = "", weights_hash: str = "") -> Namespace:
    """The namespace of objects of at most ``largest_object_bytes`` from chunks of ``chunk_size``
    tokens; ``identity`` names everything else that decides their bytes (``lmcache.*`` in ``extra``)."""
    row_bytes = chunk_size * ROW_FORMAT.bytes_per_token
    rows = -(-(HEADER_BYTES + largest_object_bytes) // row_bytes)
    return Namespace(model=model, model_config_hash=config_hash(dict(identity)), num_layers=rows,
                     components=(ROW_FORMAT.name,), block_size=chunk_size, engine=ENGINE,
                     engine_version=MAGIC.decode(), weights_hash=weights_hash, cache_salt=cache_salt,
                     extra=tuple(sorted((f"lmcache.{k}", str(v)) for k, v in identity.items())))
