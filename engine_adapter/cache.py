"""The per-sequence KV cache the model reads and appends to: the seam between model and memory.

Per token and layer an MLA model caches three things (DESIGN.md section 4):

    component     shape       content
    latent        [T, 512]    kv_a_layernorm(kv_a_proj(x)[:512]), shared by all heads
    rope_key      [T, 64]     kv_a_proj(x)[512:] with RoPE at its absolute position, INTERLEAVED
                              pairs (x0,x1),(x2,x3)... (HF caches it de-interleaved)
    indexer_key   [T, 128]    V3.2 only: LayerNorm(wk(x)), half-split RoPE on dims [0, 64)

Token ``i`` of a layer's cache sits at absolute position ``i``: a sequence cache always holds the
contiguous prefix ``[0, length)``. The model knows nothing about pages, blocks or tiers; a paged
implementation satisfies the same interface by gathering its pages in ``read``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch


class CachedLayer(NamedTuple):
    """Everything one layer has cached for positions ``[0, S)``."""

    latent: torch.Tensor  # [S, kv_lora_rank]
    rope_key: torch.Tensor  # [S, qk_rope_head_dim] interleaved
    indexer_key: torch.Tensor | None  # [S, index_head_dim]; None when the model has no indexer


class SequenceCache(ABC):
    """The cache of ONE sequence, all layers.

    Contract:
    - ``append(layer, ...)`` adds T tokens after the ones the layer holds; it mutates the cache and
      keeps its own copy (the caller may reuse its tensors afterwards).
    - ``read(layer)`` returns everything the layer holds, in position order; it does not mutate.
      The returned tensors may alias the cache's storage: treat them as read-only and do not keep
      them across a later ``append``.
    - ``length`` is the number of positions present in EVERY layer, i.e. where the next forward
      call starts. During a forward call layers run ahead of one another; between calls all layers
      hold the same number of tokens.
    """

    @property
    @abstractmethod
    def length(self) -> int:
        """Positions ``[0, length)`` are cached in every layer."""

    @abstractmethod
    def append(
        self,
        layer: int,
        latent: torch.Tensor,  # [T, kv_lora_rank]
        rope_key: torch.Tensor,  # [T, qk_rope_head_dim] interleaved
        indexer_key: torch.Tensor | None,  # [T, index_head_dim] or None
    ) -> None:
        """Append T tokens to ``layer``."""

    @abstractmethod
    def read(self, layer: int) -> CachedLayer:
        """All tokens ``layer`` holds."""


class Segment(NamedTuple):
    """Rows ``rows`` of a batch of new tokens are the next tokens of ``cache``, in position order.

    A forward call's segments tile its rows ``[0, N)`` in order, one segment per cache: a prefill
    chunk is one segment of T rows, a batched decode step B segments of one row each.
    """

    cache: SequenceCache
    rows: slice


class ContiguousCache(SequenceCache):
    """A SequenceCache in growing contiguous tensors, one set per layer (tests, demos, reference).

    Each append re-concatenates (quadratic over a long decode); the paged cache is the fast one.

    ``with_indexer`` says whether indexer keys are kept: False for V3, True for V3.2. A V3.2 model
    refuses a cache without them (its attention would silently change once past ``index_topk``).
    """

    def __init__(self, num_layers: int, with_indexer: bool = False) -> None:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        self.num_layers = num_layers
        self.with_indexer = with_indexer
        self._layers: list[CachedLayer | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return min(self.layer_length(layer) for layer in range(self.num_layers))

    def layer_length(self, layer: int) -> int:
        cached = self._layers[self._check_layer(layer)]
        return 0 if cached is None else cached.latent.shape[0]

    def append(self, layer, latent, rope_key, indexer_key) -> None:
        self._check_layer(layer)
        if latent.shape[0] != rope_key.shape[0]:
            raise ValueError(f"latent {tuple(latent.shape)} and rope key {tuple(rope_key.shape)} "
                             "must cover the same tokens")
        if (indexer_key is not None) != self.with_indexer:
            raise ValueError(f"this cache was built with_indexer={self.with_indexer}; "
                             f"append got indexer_key={'a tensor' if indexer_key is not None else 'None'}")
        new = CachedLayer(latent, rope_key, indexer_key)
        old = self._layers[layer]
        if old is None:  # own a copy, as the contract says
            self._layers[layer] = CachedLayer(*(None if t is None else t.clone() for t in new))
        else:
            self._layers[layer] = CachedLayer(*(_cat(a, b) for a, b in zip(old, new)))

    def read(self, layer: int) -> CachedLayer:
        cached = self._layers[self._check_layer(layer)]
        if cached is None:
            raise ValueError(f"layer {layer} is empty; append before reading")
        return cached

    def _check_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        return layer


def _cat(old: torch.Tensor | None, new: torch.Tensor | None) -> torch.Tensor | None:
    return None if old is None else torch.cat([old, new], dim=0)
