"""Conversions between model tensors and the component page formats of ``kvstore.layout``.

Every function works on any torch device; pages are ``uint8`` tensors in the exact byte order
the store keeps (little-endian, as every supported platform is).

FP8 is e4m3 (``torch.float8_e4m3fn``, max 448) with float32 scales ``amax / 448`` per tile
(MLA: 4 tiles of 128 latent values per token; indexer: one scale per token), floored as vLLM's
kernels floor them, so small and zero tiles give vLLM's bytes and never NaN. ``pow2_scales``
rounds each scale up to a power of two (the UE8M0 variant some engines use): a namespace must
record which one produced its bytes, since the two are not interchangeable.

Rope order: the store keeps the rope key interleaved, pairs (x0,x1),(x2,x3)... as vLLM, SGLang and
FlashMLA do. HF transformers caches it de-interleaved (rotated evens, then rotated odds).
"""

from __future__ import annotations

import torch

from kvstore.errors import InvalidRequest

KV_LORA_RANK = 512
ROPE_DIM = 64
INDEXER_DIM = 128
FP8_MAX = 448.0
MLA_TILE = 128
MLA_FP8_TOKEN_BYTES = KV_LORA_RANK + 4 * (KV_LORA_RANK // MLA_TILE) + 2 * ROPE_DIM  # 656


def _check_last_dim(name: str, x: torch.Tensor, width: int) -> None:
    if x.shape[-1] != width:
        raise InvalidRequest(f"{name} must have last dimension {width}, got shape {tuple(x.shape)}")


def _check_same_tokens(latent: torch.Tensor, rope: torch.Tensor) -> None:
    if latent.shape[:-1] != rope.shape[:-1]:
        raise InvalidRequest(
            f"latent and rope key must cover the same tokens, got shapes {tuple(latent.shape)} and {tuple(rope.shape)}"
        )


def hf_rope_to_interleaved(hf: torch.Tensor) -> torch.Tensor:
    """[..., 64] HF order (evens then odds) -> [..., 64] interleaved pairs."""
    _check_last_dim("rope key", hf, ROPE_DIM)
    half = ROPE_DIM // 2
    out = torch.empty_like(hf)
    out[..., 0::2] = hf[..., :half]
    out[..., 1::2] = hf[..., half:]
    return out


def interleaved_to_hf_rope(inter: torch.Tensor) -> torch.Tensor:
    """[..., 64] interleaved pairs -> [..., 64] HF order (evens then odds)."""
    _check_last_dim("rope key", inter, ROPE_DIM)
    return torch.cat([inter[..., 0::2], inter[..., 1::2]], dim=-1)


def _bytes_of(x: torch.Tensor) -> torch.Tensor:
    """[..., n] tensor -> [..., n * itemsize] uint8 view of the same memory."""
    return x.contiguous().view(torch.uint8)


def _mla_scales(amax: torch.Tensor, pow2_scales: bool) -> torch.Tensor:
    """Per-tile scales ``amax / 448`` clamped to FLT_MIN, as vLLM's ``concat_and_cache_ds_mla``
    kernel does: an all-zero tile gets a normal, non-zero scale. (Clamping ``amax`` instead gave a
    subnormal scale, which is 0 under flush-to-zero, and 0/0 made the whole tile NaN.)"""
    scale = (amax.float() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return _pow2(scale) if pow2_scales else scale


def _indexer_scales(amax: torch.Tensor, pow2_scales: bool) -> torch.Tensor:
    """Per-token scales as vLLM's ``indexer_k_quant_and_cache`` kernel computes them:
    ``max(amax, 1e-4) / 448``, rounded up to a power of two for UE8M0."""
    scale = amax.float().clamp_min(1e-4) / FP8_MAX
    return _pow2(scale) if pow2_scales else scale


def _pow2(scale: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(scale)))


def pack_mla_bf16(latent: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """latent [T, 512], rope [T, 64] (interleaved) -> page [T, 1152] uint8 (bf16 values)."""
    _check_last_dim("latent", latent, KV_LORA_RANK)
    _check_last_dim("rope key", rope, ROPE_DIM)
    _check_same_tokens(latent, rope)
    values = torch.cat([latent.to(torch.bfloat16), rope.to(torch.bfloat16)], dim=-1)  # [T, 576]
    return _bytes_of(values)


def unpack_mla_bf16(page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """page [T, 1152] uint8 -> (latent [T, 512] bf16, rope [T, 64] bf16)."""
    _check_last_dim("mla_bf16 page", page, 2 * (KV_LORA_RANK + ROPE_DIM))
    values = page.contiguous().view(torch.bfloat16)  # [T, 576]
    return values[..., :KV_LORA_RANK], values[..., KV_LORA_RANK:]


def quantize_mla_fp8_ds(
    latent: torch.Tensor, rope: torch.Tensor, pow2_scales: bool = False
) -> torch.Tensor:
    """latent [T, 512], rope [T, 64] -> page [T, 656] uint8 in the FlashMLA FP8 layout.

    Bytes 0-511: fp8 e4m3 latent; 512-527: 4 fp32 scales (one per 128 values, value = fp8 x
    scale); 528-655: 64 bf16 rope key, not quantised.
    """
    _check_last_dim("latent", latent, KV_LORA_RANK)
    _check_last_dim("rope key", rope, ROPE_DIM)
    _check_same_tokens(latent, rope)
    tiles = latent.float().reshape(*latent.shape[:-1], KV_LORA_RANK // MLA_TILE, MLA_TILE)
    scale = _mla_scales(tiles.abs().amax(dim=-1), pow2_scales)  # [T, 4] fp32
    fp8 = (tiles / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat(
        [
            _bytes_of(fp8.reshape(*latent.shape[:-1], KV_LORA_RANK)),
            _bytes_of(scale),
            _bytes_of(rope.to(torch.bfloat16)),
        ],
        dim=-1,
    )


def dequantize_mla_fp8_ds(page: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """page [T, 656] uint8 -> (latent [T, 512] fp32, rope [T, 64] bf16)."""
    _check_last_dim("mla_fp8_ds page", page, MLA_FP8_TOKEN_BYTES)
    page = page.contiguous()
    fp8 = page[..., :KV_LORA_RANK].view(torch.float8_e4m3fn).float()
    scale = page[..., KV_LORA_RANK : KV_LORA_RANK + 16].contiguous().view(torch.float32)  # [T, 4]
    tiles = fp8.reshape(*fp8.shape[:-1], KV_LORA_RANK // MLA_TILE, MLA_TILE) * scale.unsqueeze(-1)
    rope = page[..., KV_LORA_RANK + 16 :].contiguous().view(torch.bfloat16)
    return tiles.reshape(*fp8.shape), rope


def quantize_indexer_fp8(keys: torch.Tensor, pow2_scales: bool = False) -> torch.Tensor:
    """keys [T, 128] -> page [T * 132] uint8, blocked: all T fp8 rows, then all T fp32 scales."""
    _check_last_dim("indexer keys", keys, INDEXER_DIM)
    if keys.dim() != 2:
        raise InvalidRequest(f"indexer keys must be [T, 128], got shape {tuple(keys.shape)}")
    scale = _indexer_scales(keys.abs().amax(dim=-1), pow2_scales)  # [T] fp32
    fp8 = (keys.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return torch.cat([_bytes_of(fp8).reshape(-1), _bytes_of(scale).reshape(-1)])


def dequantize_indexer_fp8(page: torch.Tensor) -> torch.Tensor:
    """page [T * 132] uint8 (blocked) -> keys [T, 128] fp32."""
    page = page.contiguous().reshape(-1)
    if page.numel() % (INDEXER_DIM + 4):
        raise InvalidRequest(f"indexer_fp8 page of {page.numel()} bytes is not a multiple of 132")
    tokens = page.numel() // (INDEXER_DIM + 4)
    values = page[: tokens * INDEXER_DIM].view(torch.float8_e4m3fn).float().reshape(tokens, INDEXER_DIM)
    scale = page[tokens * INDEXER_DIM :].contiguous().view(torch.float32)  # [T]
    return values * scale.unsqueeze(-1)


def pack_indexer_bf16(keys: torch.Tensor) -> torch.Tensor:
    """keys [T, 128] -> page [T, 256] uint8 (bf16 values)."""
    _check_last_dim("indexer keys", keys, INDEXER_DIM)
    return _bytes_of(keys.to(torch.bfloat16))


def unpack_indexer_bf16(page: torch.Tensor) -> torch.Tensor:
    """page [T, 256] uint8 -> keys [T, 128] bf16."""
    _check_last_dim("indexer_bf16 page", page, 2 * INDEXER_DIM)
    return page.contiguous().view(torch.bfloat16)
