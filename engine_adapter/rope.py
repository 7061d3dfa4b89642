"""Rotary position embedding: frequencies (plain or YaRN), the softmax scale, two rotation styles.

Numerics follow HF transformers (``modeling_rope_utils`` and ``DeepseekV3RotaryEmbedding``) exactly:
angles in float32, ``cos``/``sin`` multiplied by YaRN's attention factor, then cast to the model
dtype before the rotation.

Two rotation styles act on the same frequencies; pair ``i`` turns by ``position * inv_freq[i]``:

    style        pair i is         used by
    interleaved  (x[2i], x[2i+1])  MLA q_rope and rope key (the DeepSeek checkpoint layout)
    half_split   (x[i], x[i+d/2])  DSA indexer q and k, first qk_rope_head_dim dims (NeoX style)

``interleaved`` returns its result interleaved, which is the order the cache stores. (HF computes the
same numbers but returns them de-interleaved, evens then odds.)

This module knows nothing about attention or the cache.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from engine_adapter.config import ModelConfig, YarnScaling


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: ModelConfig) -> float:
    """MLA's logit scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim)**2`` under YaRN."""
    scale = config.qk_head_dim**-0.5
    yarn = config.rope_scaling
    if yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


def inverse_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim / 2] float32 on the CPU, attention_factor applied to cos and sin)."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    wavelengths = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)  # [dim/2], / 2pi
    if config.rope_scaling is None:
        return 1.0 / wavelengths, 1.0
    return _yarn_inverse_frequencies(wavelengths, dim, base, config.rope_scaling)


def _yarn_inverse_frequencies(
    wavelengths: torch.Tensor, dim: int, base: float, yarn: YarnScaling
) -> tuple[torch.Tensor, float]:
    """Blend interpolated (low-frequency) and extrapolated (high-frequency) pairs, HF's formula."""
    low, high = _correction_range(yarn, dim, base)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    pairs = torch.arange(dim // 2, dtype=torch.float32, device="cpu")  # [dim/2]
    ramp = ((pairs - low) / (high - low)).clamp(0, 1)  # [dim/2]
    keep = 1 - ramp  # 1: extrapolate (keep the trained frequency); 0: interpolate (divide by factor)
    extrapolated = 1.0 / wavelengths
    interpolated = 1.0 / (yarn.factor * wavelengths)
    inv_freq = interpolated * (1 - keep) + extrapolated * keep
    return inv_freq, _attention_factor(yarn)


def _correction_range(yarn: YarnScaling, dim: int, base: float) -> tuple[float, float]:
    """Pair indices where the ramp from extrapolation to interpolation starts and ends."""

    def pair_for(rotations: float) -> float:
        turns = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(base))

    low, high = pair_for(yarn.beta_fast), pair_for(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _attention_factor(yarn: YarnScaling) -> float:
    if yarn.attention_factor is not None:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


class Rotation(NamedTuple):
    """cos and sin of every pair's angle for T tokens; applies either rotation style."""

    cos: torch.Tensor  # [T, rope_dim / 2], model dtype, attention factor included
    sin: torch.Tensor  # [T, rope_dim / 2]

    @classmethod
    def at(cls, positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float,
           dtype: torch.dtype) -> Rotation:
        """positions [T] -> the rotation for those absolute positions."""
        angles = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # [T, rope_dim/2]
        return cls((angles.cos() * attention_factor).to(dtype), (angles.sin() * attention_factor).to(dtype))

    def interleaved(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ..., rope_dim] in pairs (x0,x1),(x2,x3)... -> rotated, same interleaved order."""
        cos, sin = self._broadcast(x)
        even, odd = x[..., 0::2], x[..., 1::2]  # [T, ..., rope_dim/2] each
        return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)

    def half_split(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ..., rope_dim] in pairs (x_i, x_{i+d/2}) -> rotated, same order."""
        cos, sin = self._broadcast(x)
        first, second = x.chunk(2, dim=-1)  # [T, ..., rope_dim/2] each
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def _broadcast(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, d/2] -> [T, 1, ..., 1, d/2] to match x [T, ..., d]."""
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.cos.shape[-1],)
        return self.cos.view(shape), self.sin.view(shape)
