"""Keys: the namespace fingerprint and the chained prefix hash of full blocks.

A key is ``(namespace_id, block_hash)``, both 16-byte xxh3-128 digests.

- ``namespace_id`` fingerprints everything that makes cached bytes incompatible (model, config,
  layer count, component formats, block size, engine and version, hash algorithm, tenant salt).
- ``block_hash`` is a chain over full blocks only::

      h_0 = xxh3_128(seed || tokens_0 [|| extra_0])
      h_i = xxh3_128(h_{i-1} || tokens_i [|| extra_i])

  where ``seed`` is the namespace id, tokens are packed as little-endian uint32 and ``extra_i``
  (optional: LoRA adapter, multimodal item hashes) is the length-prefixed encoding of the block's
  extra keys. The token part has a fixed width, so the encoding is unambiguous.

The function is pure and deterministic across processes, ranks, restarts and hosts (no random
seed, no Python ``hash()``). Golden vectors in the tests pin it: a change is a new
``HASH_ALGORITHM`` name, never an edit.

This module knows nothing about tiers, layouts' byte contents or where blocks live.
"""

from __future__ import annotations

import json
import numbers
import threading
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Iterable, Mapping, Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidRequest

try:  # the same chain's loop in C (kvstore/_chain.c), built by ``pip install`` where it can be
    from kvstore import _chain as _native
except ImportError:  # no compiler or no xxhash.h at install time: the Python loop below
    _native = None

HASH_ALGORITHM = "xxh3-128-chain-v1"
DIGEST_BYTES = 16
MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True)
class Namespace:
    """Everything that decides whether two producers' block bytes are interchangeable.

    Two engines that would produce different bytes must differ in at least one field; two that
    produce the same bytes should be equal in all of them.
    """

    model: str
    model_config_hash: str
    num_layers: int
    components: tuple[str, ...]
    block_size: int = 64
    engine: str = "mla-kvstore"
    engine_version: str = "0"
    weights_hash: str = ""
    cache_salt: str = ""
    hash_algorithm: str = HASH_ALGORITHM
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size"):  # an int in any guise (numpy's too), never a float or bool
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InvalidRequest(f"Namespace.{name} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        for name in ("model", "model_config_hash", "engine", "engine_version", "weights_hash", "cache_salt"):
            if not isinstance(getattr(self, name), str):
                raise InvalidRequest(f"Namespace.{name} must be a string, got {getattr(self, name)!r}")
        if not self.model:
            raise InvalidRequest("Namespace.model must be a non-empty model name")
        if self.num_layers <= 0:
            raise InvalidRequest(f"Namespace.num_layers must be positive, got {self.num_layers}")
        if self.block_size <= 0:
            raise InvalidRequest(f"Namespace.block_size must be positive, got {self.block_size}")
        object.__setattr__(self, "components", _strings("components", self.components))
        object.__setattr__(self, "extra", _pairs("extra", self.extra))
        if not self.components:
            raise InvalidRequest("Namespace.components must name at least one component format")
        if self.hash_algorithm != HASH_ALGORITHM:
            raise InvalidRequest(
                f"unknown hash algorithm {self.hash_algorithm!r}; supported: {HASH_ALGORITHM!r}"
            )

    def canonical_json(self) -> str:
        """The fingerprinted form: sorted keys, no whitespace, lists for tuples."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @cached_property  # frozen, so computed once (the JSON encoding costs as much as 500 blocks' hashes)
    def id(self) -> bytes:
        """16-byte fingerprint; also the seed of this namespace's hash chains."""
        return xxhash.xxh3_128_digest(self.canonical_json().encode())

    @classmethod
    def from_json(cls, text: str) -> "Namespace":
        """The namespace ``canonical_json`` wrote; ``InvalidRequest`` for fields of the wrong type
        (``ValueError``, ``TypeError`` or ``KeyError`` for text that is no JSON object of them)."""
        return cls(**json.loads(text))


def _items(name: str, value, what: str) -> tuple:
    """The items of ``value``, any iterable but a string, bytes or a mapping (a mapping's items
    for ``extra``), as a tuple; else ``InvalidRequest`` saying ``Namespace.name`` must be ``what``."""
    if isinstance(value, Mapping) and name == "extra":
        value = value.items()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise InvalidRequest(f"Namespace.{name} must be {what}, got {value!r:.80}")
    return tuple(value)


def _strings(name: str, value) -> tuple[str, ...]:
    """``value``, an iterable of strings, as a tuple; else ``InvalidRequest`` naming ``Namespace.name``."""
    items = _items(name, value, "a list of strings")
    if not all(isinstance(item, str) for item in items):
        raise InvalidRequest(f"Namespace.{name} must be a list of strings, got {value!r:.80}")
    return items


def _pairs(name: str, value) -> tuple[tuple, ...]:
    """``value``, [key, value] pairs (or a mapping), as tuples: string keys, and values that are
    strings or, as namespaces written before these checks could hold, JSON numbers or booleans
    (their ids stay the same; the gRPC Namespace message carries strings only). Else ``InvalidRequest``."""
    what = "a list of [key, value] pairs of strings"
    pairs = tuple(_items(name, pair, what) for pair in _items(name, value, what))
    if not all(len(pair) == 2 and isinstance(pair[0], str) and isinstance(pair[1], _EXTRA_VALUES) for pair in pairs):
        raise InvalidRequest(f"Namespace.{name} must be {what}, got {value!r:.80}")
    return pairs


_EXTRA_VALUES = (str, int, float, bool)


def config_hash(config: dict) -> str:
    """Stable hex digest of a model config dict (for ``Namespace.model_config_hash``)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_128_hexdigest(text.encode())


def encode_extra_keys(items: Sequence[bytes | str]) -> bytes:
    """Length-prefixed encoding of one block's extra keys (empty input gives b"")."""
    out = bytearray()
    for item in items:
        raw = item.encode() if isinstance(item, str) else bytes(item)
        out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def _checked_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a 1-D integer array (no copy when already one); rejects ids outside [0, 2**32)."""
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidRequest(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidRequest(f"tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > MAX_TOKEN_ID):
        raise InvalidRequest(f"token ids must lie in [0, {MAX_TOKEN_ID}]")
    return arr


def chain_hashes(
    seed: bytes,
    tokens: Sequence[int] | np.ndarray,
    block_size: int,
    extra_keys: dict[int, Sequence[bytes | str]] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Block hashes of every *full* block of ``tokens`` (a trailing partial block is ignored).

    ``seed`` is the namespace id. ``parent`` continues an existing chain: pass the hash of the
    block just before ``tokens[0]`` (tokens must then start on a block boundary).
    ``extra_keys`` maps a block index (relative to ``tokens``) to that block's extra keys.
    Pure: the same inputs give the same digests in every process, with or without the native
    loop (``native_hashing()``).
    """
    if len(seed) != DIGEST_BYTES:
        raise InvalidRequest(f"seed must be {DIGEST_BYTES} bytes, got {len(seed)}")
    if parent is not None and len(parent) != DIGEST_BYTES:
        raise InvalidRequest(f"parent must be a {DIGEST_BYTES}-byte block hash, got {len(parent)} bytes")
    if block_size <= 0:
        raise InvalidRequest(f"block_size must be positive, got {block_size}")
    token_ids = _checked_tokens(tokens)
    n = len(token_ids) // block_size
    if n == 0:
        return []
    prev = parent if parent is not None else seed
    if _native is not None and not extra_keys:
        return _native.chain_digests(prev, np.ascontiguousarray(token_ids[: n * block_size], "<u4"), block_size)
    width = DIGEST_BYTES + 4 * block_size
    # rows: [n, 16 + 4*block_size] bytes = [previous digest | this block's tokens as <u4]. They live
    # in a per-thread scratch buffer with cached per-row views: allocating half a megabyte and
    # 2n view objects per call cost more (page faults, allocator) than the hashing itself.
    buf, rows = _scratch_rows(n, width)
    rows_u32 = np.frombuffer(buf, "<u4", count=n * width // 4).reshape(n, width // 4)
    rows_u32[:, DIGEST_BYTES // 4 :] = token_ids[: n * block_size].reshape(n, block_size)  # casts to <u4
    if extra_keys:
        return _chain_with_extras(rows[:n], prev, extra_keys)
    digest = xxhash.xxh3_128_digest
    out: list[bytes] = []
    append = out.append
    for row in rows[:n]:  # three C calls per block, no allocation; the native loop is 4x faster
        row[:DIGEST_BYTES] = prev
        prev = digest(row)
        append(prev)
    return out


_local = threading.local()
_MAX_CACHED_ROWS = 16384  # 1M tokens of 64-token blocks: about 8 MiB of scratch per thread


def _scratch_rows(n: int, width: int) -> tuple[bytearray, list[memoryview]]:
    """This thread's scratch buffer of at least ``n`` rows of ``width`` bytes, and a view per row."""
    cached = getattr(_local, "rows", None)
    if cached is not None and cached[0] == width and len(cached[2]) >= n:
        return cached[1], cached[2]
    capacity = max(n, 2048)
    buf = bytearray(capacity * width)
    view = memoryview(buf)
    rows = [view[i * width : (i + 1) * width] for i in range(capacity)]
    if capacity <= _MAX_CACHED_ROWS:  # longer prompts get a one-off buffer, not a permanent one
        _local.rows = (width, buf, rows)
    return buf, rows


def _chain_with_extras(rows: list[memoryview], prev: bytes, extra_keys: dict[int, Sequence[bytes | str]]) -> list[bytes]:
    out: list[bytes] = []
    for i, row in enumerate(rows):
        row[:DIGEST_BYTES] = prev
        data = bytes(row) + encode_extra_keys(extra_keys[i]) if i in extra_keys else row
        prev = xxhash.xxh3_128_digest(data)
        out.append(prev)
    return out


def native_hashing() -> bool:
    """Whether ``chain_hashes`` runs its C loop (else the Python loop: same digests, ~4x slower)."""
    return _native is not None


def namespace_hashes(namespace: Namespace, tokens: Sequence[int] | np.ndarray, **kw) -> list[bytes]:
    """``chain_hashes`` seeded with ``namespace.id`` at ``namespace.block_size``."""
    return chain_hashes(namespace.id, tokens, namespace.block_size, **kw)
