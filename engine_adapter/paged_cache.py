"""The device tier: a paged latent cache the model reads directly, and a sequence's view of it.

Per layer the pool is ONE uint8 tensor, so a page of a layer is one contiguous byte range laid
out exactly like one layer of a store block payload (``kvstore.layout``, components in namespace
order, ``engine_adapter.namespace.components_for``)::

    storage[layer]  [num_pages, layer_bytes] uint8
      bytes [0, P*1152)            mla_bf16      [P, 576] bf16: 512 latent, then 64 rope key (interleaved)
      bytes [P*1152, P*1408)       indexer_bf16  [P, 128] bf16 (V3.2 only)

``mla[layer]`` and ``indexer[layer]`` are typed views of the same memory. The connector moves
whole pages of a layer through ``layer_page_bytes`` (``connectors.base.PageBytes``); the model
sees a sequence's pages through ``PagedSequenceCache``, which writes bf16 into them and reads
them back in the model's compute dtype.

Page ids, reference counts and prefix caching come from ``PageAllocator``. This module knows
nothing about tokens, hashes' meaning, requests or the store.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine_adapter.cache import CachedLayer, SequenceCache
from engine_adapter.config import ModelConfig
from engine_adapter.page_allocator import EvictHook, PageAllocator

MLA_LATENT, MLA_ROPE = 512, 64  # the mla_bf16 format: this latent, then this rope key, per token
MLA_WIDTH = MLA_LATENT + MLA_ROPE  # 576 bf16
MLA_BYTES_PER_TOKEN = 2 * MLA_WIDTH  # 1152, the mla_bf16 format
INDEXER_WIDTH = 128
INDEXER_BYTES_PER_TOKEN = 2 * INDEXER_WIDTH  # 256, the indexer_bf16 format


class PagePool(PageAllocator):
    """``num_pages`` pages of ``page_size`` tokens in every layer, on ``device``."""

    def __init__(self, config: ModelConfig, num_pages: int, page_size: int = 64,
                 device: str | torch.device = "cpu", on_evict: EvictHook | None = None) -> None:
        super().__init__(num_pages, on_evict)
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if (config.kv_lora_rank, config.qk_rope_head_dim) != (MLA_LATENT, MLA_ROPE):  # the same sum is not the format
            raise ValueError(f"the mla_bf16 format holds 512 + 64 values per token, the model caches "
                             f"{config.kv_lora_rank} + {config.qk_rope_head_dim}")
        if config.is_v32 and config.index_head_dim != INDEXER_WIDTH:
            raise ValueError(f"the indexer_bf16 format holds 128 values per token, got {config.index_head_dim}")
        # the concrete device ("cuda" resolves to "cuda:N"), so it compares equal to a tensor's .device
        self.config, self.page_size, self.device = config, page_size, torch.empty(0, device=device).device
        self.with_indexer = config.is_v32
        mla_bytes = page_size * MLA_BYTES_PER_TOKEN
        self.layer_bytes = mla_bytes + (page_size * INDEXER_BYTES_PER_TOKEN if self.with_indexer else 0)
        self.storage = [torch.zeros(num_pages, self.layer_bytes, dtype=torch.uint8, device=self.device)
                        for _ in range(config.num_hidden_layers)]  # per layer [num_pages, layer_bytes]
        self.mla = [_typed(s[:, :mla_bytes], page_size, MLA_WIDTH) for s in self.storage]  # [N, P, 576] bf16
        self.indexer = ([_typed(s[:, mla_bytes:], page_size, INDEXER_WIDTH) for s in self.storage]
                        if self.with_indexer else None)  # [N, P, 128] bf16

    @property
    def num_layers(self) -> int:
        return len(self.storage)

    def layer_page_bytes(self, layer: int, page: int) -> torch.Tensor:
        """[layer_bytes] uint8 view: layer ``layer`` of page ``page``, as one layer of a block payload."""
        return self.storage[layer][page]

    def layer_pages(self, layer: int) -> torch.Tensor:
        """[num_pages, layer_bytes] uint8: every page of layer ``layer`` (``PageBytes``)."""
        return self.storage[layer]


def _typed(raw: torch.Tensor, page_size: int, width: int) -> torch.Tensor:
    """[N, page_size * width * 2] uint8 (row-strided) -> [N, page_size, width] bf16 view."""
    return raw.view(torch.bfloat16).unflatten(1, (page_size, width))


class PagedSequenceCache(SequenceCache):
    """One sequence's cache over its ``block_table`` (page ids, position p in page p // page_size).

    The block table is the caller's list and may grow between forward calls; it must cover every
    position appended. ``length`` positions are taken as already present (a prefix hit). Reads
    return ``dtype`` (the model's compute dtype); the pages always hold bf16.

    ``before_read(layer)``, when set, is called before each read of a layer: a connector's
    ``LoadHandle.wait_layer`` goes there so layer l is read only after its loaded pages arrived.
    """

    def __init__(self, pool: PagePool, block_table: list[int], length: int = 0,
                 dtype: torch.dtype = torch.bfloat16,
                 before_read: Callable[[int], None] | None = None) -> None:
        if length > len(block_table) * pool.page_size:
            raise ValueError(f"length {length} exceeds the {len(block_table)} pages of the block table")
        self.pool, self.block_table, self.dtype = pool, block_table, dtype
        self.before_read = before_read
        self._lengths = [length] * pool.num_layers

    @property
    def length(self) -> int:
        return min(self._lengths)

    def truncate(self, length: int) -> None:
        """Forget positions ``[length, ...)`` in every layer (a failed load or an aborted forward)."""
        assert all(n >= length for n in self._lengths), f"truncate to {length} beyond {self._lengths}: caller bug"
        self._lengths = [length] * len(self._lengths)

    def append(self, layer, latent, rope_key, indexer_key) -> None:
        if (indexer_key is not None) != self.pool.with_indexer:
            raise ValueError(f"the pool keeps indexer keys: {self.pool.with_indexer}; append got "
                             f"indexer_key={'a tensor' if indexer_key is not None else 'None'}")
        start, count = self._lengths[layer], latent.shape[0]
        pages, slots = self._slots(start, start + count)  # [T], [T]
        self.pool.mla[layer][pages, slots] = torch.cat([latent, rope_key], dim=-1).to(torch.bfloat16)
        if indexer_key is not None:
            self.pool.indexer[layer][pages, slots] = indexer_key.to(torch.bfloat16)
        self._lengths[layer] = start + count

    def read(self, layer: int) -> CachedLayer:
        if self.before_read is not None:
            self.before_read(layer)
        length = self._lengths[layer]
        if length == 0:
            raise ValueError(f"layer {layer} is empty; append before reading")
        pages = self._table(-(-length // self.pool.page_size))  # [n]
        mla = self.pool.mla[layer][pages].flatten(0, 1)[:length].to(self.dtype)  # [S, 576]
        latent_width = self.pool.config.kv_lora_rank
        indexer = None
        if self.pool.with_indexer:
            indexer = self.pool.indexer[layer][pages].flatten(0, 1)[:length].to(self.dtype)  # [S, 128]
        return CachedLayer(mla[:, :latent_width], mla[:, latent_width:], indexer)

    def _slots(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [start, end) -> (page id [T], slot in page [T]) on the pool's device."""
        size = self.pool.page_size
        if end > len(self.block_table) * size:
            raise ValueError(f"positions up to {end} need {-(-end // size)} pages, the block table has "
                             f"{len(self.block_table)}")
        positions = torch.arange(start, end, device=self.pool.device)
        return self._table(len(self.block_table))[positions // size], positions % size

    def _table(self, num_pages: int) -> torch.Tensor:
        return torch.tensor(self.block_table[:num_pages], dtype=torch.long, device=self.pool.device)
