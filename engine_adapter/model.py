"""DeepSeek-V3 / V3.2 causal LM over ``SequenceCache``s.

    forward(token_ids [T], positions [T], cache)           -> logits [T, vocab]   one sequence
    forward_decode(token_ids [B], positions [B], caches)   -> logits [B, vocab]   one token each of B

The cache holds positions ``[0, start)`` and a call appends the new tokens at ``[start, ...)``: a
full prefill (start = 0), a suffix after a prefix hit, and a decode step (T = 1) are the same
``forward``. ``forward_decode`` runs B sequences' next tokens as one batch: embedding, projections,
norms, MLP and MoE see [B, hidden]; only attention runs per sequence, against its own cache (the
per-layer code takes a list of ``Segment``s, rows of the batch per cache). MoE routing is per token,
so a batch gives each sequence its own decode's numbers, up to float32 summation order. Module and
parameter names match the HF checkpoints, so ``from_pretrained`` loads them by name.

The model knows nothing about pages, blocks, the store or scheduling: the caches are its only memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from engine_adapter.cache import ContiguousCache, Segment, SequenceCache
from engine_adapter.config import ModelConfig
from engine_adapter.indexer import Indexer
from engine_adapter.mla import MLAttention
from engine_adapter.mlp import MLP
from engine_adapter.moe import MoE, Router
from engine_adapter.norm import RMSNorm
from engine_adapter.rope import Rotation, inverse_frequencies
from engine_adapter.weights import load_checkpoint

INIT_STD = 0.02  # ``random``: normal init of every projection and embedding


class DecoderLayer(nn.Module):
    """Pre-norm residual block: MLA, then a dense MLP (first layers) or the MoE."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAttention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        dense = not config.is_moe_layer(layer)
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if dense else MoE(config)

    def forward(self, h: torch.Tensor, rotation: Rotation, segments: list[Segment]) -> torch.Tensor:
        """h [N, hidden] -> [N, hidden]; attention per segment, everything else over all N rows."""
        h = h + self.self_attn(self.input_layernorm(h), rotation, segments)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekModel(nn.Module):
    """The decoder stack; HF name ``model``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """Decoder stack plus ``lm_head``; build with ``from_pretrained`` or ``random``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._tie_embeddings()
        self.inv_freq, self.attention_factor = inverse_frequencies(config)  # [rope_dim / 2] CPU float32

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
        """token_ids [T], positions [T] (= start .. start + T - 1, start = cache.length) -> logits [T, vocab].

        Appends the T tokens to every layer of the cache.
        """
        _check_tokens(token_ids, positions)
        return self._forward(token_ids, positions, [Segment(cache, slice(0, token_ids.numel()))])

    @torch.no_grad()
    def forward_decode(self, token_ids: torch.Tensor, positions: torch.Tensor,
                       caches: Sequence[SequenceCache]) -> torch.Tensor:
        """token_ids [B], positions [B] (positions[b] = caches[b].length) -> logits [B, vocab].

        One new token for each of B distinct sequences; appends token b to every layer of caches[b].
        """
        _check_tokens(token_ids, positions)
        if len(caches) != token_ids.numel() or len({id(c) for c in caches}) != len(caches):
            raise ValueError(f"forward_decode needs one distinct cache per token: {token_ids.numel()} tokens, "
                             f"{len(caches)} caches ({len({id(c) for c in caches})} distinct)")
        return self._forward(token_ids, positions, [Segment(cache, slice(b, b + 1)) for b, cache in enumerate(caches)])

    def _forward(self, token_ids: torch.Tensor, positions: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        """token_ids [N], positions [N], segments tiling [0, N) -> logits [N, vocab]."""
        starts = [segment.cache.length for segment in segments]
        h = self.model.embed_tokens(token_ids)  # [N, hidden]
        rotation = Rotation.at(positions, self.inv_freq, self.attention_factor, h.dtype)
        for layer in self.model.layers:
            h = layer(h, rotation, segments)
        for (cache, rows), start in zip(segments, starts):
            assert cache.length == start + rows.stop - rows.start, "SequenceCache bug: a layer did not grow by T"
        return self.lm_head(self.model.norm(h))  # [N, vocab]

    def new_cache(self) -> ContiguousCache:
        """An empty ContiguousCache with the components this model produces."""
        return ContiguousCache(self.config.num_hidden_layers, with_indexer=self.config.is_v32)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> DeepseekForCausalLM:
        """Load ``config.json`` and the HF safetensors (single file or sharded) of a directory."""
        config = ModelConfig.from_pretrained_dir(directory)
        model = cls._allocate(config, dtype, device)
        load_checkpoint(model, directory, config.num_hidden_layers)
        return model.eval()

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
               device: str | torch.device = "cpu") -> DeepseekForCausalLM:
        """Random weights (normal, std 0.02; norms 1; router bias 0), identical for a seed on any device."""
        model = cls._allocate(config, torch.float32, "cpu")
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                _init_(name, tensor, generator)
        return model._cast(dtype).to(device)._tie_embeddings().eval()

    @classmethod
    def _allocate(cls, config: ModelConfig, dtype: torch.dtype,
                  device: str | torch.device) -> DeepseekForCausalLM:
        """A model with uninitialised storage of the right dtypes on ``device`` (no init cost)."""
        with torch.device("meta"):
            model = cls(config)
        return model._cast(dtype).to_empty(device=device)._tie_embeddings()

    def _tie_embeddings(self) -> DeepseekForCausalLM:
        """Share lm_head with the embedding when the config says so (again after moves that untie)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    def _cast(self, dtype: torch.dtype) -> DeepseekForCausalLM:
        """To ``dtype``, except what DeepSeek keeps in float32 (router bias, indexer head weights)."""
        self.to(dtype)
        for module in self.modules():
            if isinstance(module, (Router, Indexer)):
                module.keep_fp32_()
        return self


def _check_tokens(token_ids: torch.Tensor, positions: torch.Tensor) -> None:
    if token_ids.dim() != 1 or positions.shape != token_ids.shape or token_ids.numel() == 0:
        raise ValueError(f"token_ids and positions must both be [T] with T >= 1, got "
                         f"{tuple(token_ids.shape)} and {tuple(positions.shape)}")


def _init_(name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
    if name.endswith(("e_score_correction_bias", "norm.bias")):
        tensor.zero_()
    elif name.endswith("norm.weight"):
        tensor.fill_(1.0)
    else:
        tensor.normal_(0.0, INIT_STD, generator=generator)
