"""Conversions between tensors and page formats: exact bytes where the format is exact, fp8
tolerances where it is not, and what re-quantising a dequantised page gives back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.errors import InvalidRequest
from kvstore.quant import (
    MLA_FP8_TOKEN_BYTES,
    dequantize_indexer_fp8,
    dequantize_mla_fp8_ds,
    hf_rope_to_interleaved,
    interleaved_to_hf_rope,
    pack_indexer_bf16,
    pack_mla_bf16,
    quantize_indexer_fp8,
    quantize_mla_fp8_ds,
    unpack_indexer_bf16,
    unpack_mla_bf16,
)

T = 64  # tokens per page in every test


def _latent(seed: int, tokens: int = T) -> torch.Tensor:
    """[T, 512] fp32 with per-tile magnitudes spread over six decades (so tiles get distinct scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 4, 128, generator=g)
    x *= 10.0 ** (torch.rand(tokens, 4, 1, generator=g) * 6 - 3)
    return x.reshape(tokens, 512)


def _rope(seed: int, tokens: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 64, generator=g).to(torch.bfloat16)  # [T, 64] bf16


def _indexer_keys(seed: int, tokens: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 128, generator=g) * 10.0 ** (torch.rand(tokens, 1, generator=g) * 6 - 3)


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    """Little-endian bytes of bf16-representable values, computed from their fp32 bits (no torch bf16)."""
    as_u32 = x.float().numpy().astype("<f4").view("<u4")
    return (as_u32 >> 16).astype("<u2").view(np.uint8).reshape(*x.shape[:-1], -1)


def _fp8_max_code(codes: torch.Tensor) -> torch.Tensor:
    return codes.float().abs().amax(dim=-1)


# ---- rope order ----------------------------------------------------------------------------


def test_hf_to_interleaved_order():
    hf = torch.arange(64, dtype=torch.float32)
    inter = hf_rope_to_interleaved(hf)
    assert inter.tolist() == [v for pair in zip(range(32), range(32, 64)) for v in pair]  # 0, 32, 1, 33, ...
    expected = torch.empty(64)
    expected[0::2] = hf[:32]
    expected[1::2] = hf[32:]
    assert torch.equal(inter, expected)


def test_rope_round_trip_is_exact_on_batched_bf16():
    hf = torch.randn(2, 3, T, 64).to(torch.bfloat16)
    inter = hf_rope_to_interleaved(hf)
    assert inter.shape == hf.shape and inter.dtype == torch.bfloat16
    assert torch.equal(inter[..., 0::2], hf[..., :32]) and torch.equal(inter[..., 1::2], hf[..., 32:])
    back = interleaved_to_hf_rope(inter)
    assert torch.equal(back.view(torch.int16), hf.view(torch.int16))
    assert torch.equal(hf_rope_to_interleaved(interleaved_to_hf_rope(inter)), inter)


# ---- mla_bf16 ------------------------------------------------------------------------------


def test_pack_mla_bf16_bytes():
    latent, rope = _latent(1).to(torch.bfloat16), _rope(2)
    page = pack_mla_bf16(latent, rope)
    assert page.dtype == torch.uint8 and page.shape == (T, 1152)
    assert np.array_equal(page[:, :1024].numpy(), _bf16_bits(latent))  # bytes 0-1023: latent
    assert np.array_equal(page[:, 1024:].numpy(), _bf16_bits(rope))  # bytes 1024-1151: rope


def test_unpack_mla_bf16_is_exact_inverse():
    latent, rope = _latent(3).to(torch.bfloat16), _rope(4)
    out_latent, out_rope = unpack_mla_bf16(pack_mla_bf16(latent, rope))
    assert out_latent.dtype == out_rope.dtype == torch.bfloat16
    assert torch.equal(out_latent.view(torch.int16), latent.view(torch.int16))
    assert torch.equal(out_rope.view(torch.int16), rope.view(torch.int16))
    assert torch.equal(pack_mla_bf16(out_latent, out_rope), pack_mla_bf16(latent, rope))


def test_pack_mla_bf16_rounds_fp32_like_to_bfloat16():
    latent = _latent(5)
    page = pack_mla_bf16(latent, _rope(6).float())
    assert torch.equal(page, pack_mla_bf16(latent.to(torch.bfloat16), _rope(6)))


# ---- mla_fp8_ds ----------------------------------------------------------------------------


def test_mla_fp8_known_bytes():
    """Hand-checked e4m3 codes: 1.0 = 0x38, -2.0 = 0xC0, 448 = 0x7E; scale = amax / 448."""
    latent = torch.zeros(1, 512)
    latent[0, 0], latent[0, 1], latent[0, 2] = 448.0, 1.0, -2.0  # tile 0: amax 448 -> scale 1
    latent[0, 128], latent[0, 129] = 896.0, 2.0  # tile 1: amax 896 -> scale 2
    rope = torch.full((1, 64), 1.0, dtype=torch.bfloat16)
    page = quantize_mla_fp8_ds(latent, rope)
    assert page.shape == (1, 656)
    assert page[0, :3].tolist() == [0x7E, 0x38, 0xC0]
    assert page[0, 128:130].tolist() == [0x7E, 0x38]
    scales = page[0, 512:528].numpy().view("<f4")
    assert scales[0] == 1.0 and scales[1] == 2.0
    assert page[0, 528:530].tolist() == [0x80, 0x3F]  # bf16 1.0 = 0x3F80, little-endian
    dequant, _ = dequantize_mla_fp8_ds(page)
    assert dequant[0, :3].tolist() == [448.0, 1.0, -2.0] and dequant[0, 128:130].tolist() == [896.0, 2.0]


@pytest.mark.parametrize("pow2_scales", [False, True])
def test_mla_fp8_page_layout(pow2_scales):
    latent, rope = _latent(10), _rope(11)
    page = quantize_mla_fp8_ds(latent, rope, pow2_scales=pow2_scales)
    assert MLA_FP8_TOKEN_BYTES == 656
    assert page.dtype == torch.uint8 and page.shape == (T, 656) and page.numel() == T * 656

    scales = page[:, 512:528].contiguous().numpy().view("<f4")  # [T, 4] fp32 at bytes 512-527
    amax_over_448 = np.abs(latent.numpy().reshape(T, 4, 128)).max(-1) / np.float32(448.0)
    if pow2_scales:
        mantissa, _ = np.frexp(scales)
        assert np.all(mantissa == 0.5)  # powers of two
        assert np.all(scales >= amax_over_448) and np.all(scales / 2 < amax_over_448)
    else:
        assert np.array_equal(scales, amax_over_448)

    assert np.array_equal(page[:, 528:].numpy(), _bf16_bits(rope))  # bytes 528-655: rope, untouched

    codes = page[:, :512].contiguous().view(torch.float8_e4m3fn).float()  # bytes 0-511: fp8 latent
    assert float(codes.abs().max()) <= 448.0
    dequant, dequant_rope = dequantize_mla_fp8_ds(page)
    assert dequant.dtype == torch.float32 and dequant.shape == (T, 512)
    expected = (codes.reshape(T, 4, 128) * torch.from_numpy(scales.copy()).unsqueeze(-1)).reshape(T, 512)
    assert torch.equal(dequant, expected)  # value = fp8 x scale
    assert torch.equal(dequant_rope.view(torch.int16), rope.view(torch.int16))


@pytest.mark.parametrize("pow2_scales", [False, True])
def test_mla_fp8_dequantised_within_e4m3_tolerance(pow2_scales):
    latent = _latent(20)
    page = quantize_mla_fp8_ds(latent, _rope(21), pow2_scales=pow2_scales)
    dequant, _ = dequantize_mla_fp8_ds(page)
    scales = torch.from_numpy(page[:, 512:528].contiguous().numpy().view("<f4").copy())  # [T, 4]
    err = (dequant - latent).abs().reshape(T, 4, 128)
    x = latent.abs().reshape(T, 4, 128)
    # e4m3 keeps 3 mantissa bits: half an ulp is at most 1/16 of the value; below the normal
    # range (|code| < 2**-6) the step is 2**-9 of the scale.
    assert bool((err <= x / 16 + scales.unsqueeze(-1) * 2.0**-10).all())
    tile_amax = x.amax(-1, keepdim=True)
    assert bool((err <= tile_amax / 16).all())
    assert float(err.max()) > 0  # the data really was lossy (the check is not vacuous)


@pytest.mark.parametrize("seed", range(3))
def test_mla_fp8_requantise_without_pow2_is_byte_exact(seed):
    """Plain amax/448 scales: re-quantising a dequantised page reproduces it byte for byte."""
    page = quantize_mla_fp8_ds(_latent(30 + seed), _rope(40 + seed))
    assert torch.equal(quantize_mla_fp8_ds(*dequantize_mla_fp8_ds(page)), page)


def test_mla_fp8_requantise_with_pow2():
    """Power-of-two scales: byte-exact exactly for the tokens whose tiles all keep a largest code
    above 224. A tile whose largest value rounded down to code 224 (= 448 / 2) gets half the scale
    and doubled codes on re-quantisation: different bytes, identical values. One re-quantisation
    reaches a fixed point."""
    page = quantize_mla_fp8_ds(_latent(50), _rope(51), pow2_scales=True)
    latent, rope = dequantize_mla_fp8_ds(page)
    again = quantize_mla_fp8_ds(latent, rope, pow2_scales=True)

    max_code = _fp8_max_code(page[:, :512].contiguous().view(torch.float8_e4m3fn).reshape(T, 4, 128))  # [T, 4]
    halved_tiles = max_code <= 224
    halved_rows = halved_tiles.any(-1)
    assert 0 < int(halved_rows.sum()) < T  # this seed exercises both cases
    assert torch.equal(again[~halved_rows], page[~halved_rows])
    assert bool((again[halved_rows] != page[halved_rows]).any(-1).all())

    old_scales = page[:, 512:528].contiguous().view(torch.float32)
    new_scales = again[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(new_scales[halved_tiles], old_scales[halved_tiles] / 2)
    assert torch.equal(new_scales[~halved_tiles], old_scales[~halved_tiles])

    assert torch.equal(dequantize_mla_fp8_ds(again)[0], latent)  # same values either way
    assert torch.equal(quantize_mla_fp8_ds(*dequantize_mla_fp8_ds(again), pow2_scales=True), again)


def test_mla_fp8_pow2_byte_exact_for_engine_style_pages():
    """A page whose every tile uses the full code range round-trips exactly with pow2 scales."""
    g = torch.Generator().manual_seed(60)
    codes = torch.randint(-448, 449, (T, 4, 128), generator=g).float()
    codes[:, :, 0] = 448.0  # each tile reaches the top code
    codes = codes.to(torch.float8_e4m3fn).float()
    scales = 2.0 ** torch.randint(-20, 10, (T, 4, 1), generator=g).float()
    latent = (codes * scales).reshape(T, 512)
    page = quantize_mla_fp8_ds(latent, _rope(61), pow2_scales=True)
    assert torch.equal(page[:, 512:528].contiguous().view(torch.float32), scales.squeeze(-1))
    assert torch.equal(page[:, :512].contiguous().view(torch.float8_e4m3fn).float(), codes.reshape(T, 512))
    assert torch.equal(quantize_mla_fp8_ds(*dequantize_mla_fp8_ds(page), pow2_scales=True), page)


# ---- indexer_fp8 ---------------------------------------------------------------------------


@pytest.mark.parametrize("pow2_scales", [False, True])
def test_indexer_fp8_blocked_layout(pow2_scales):
    keys = _indexer_keys(70)
    page = quantize_indexer_fp8(keys, pow2_scales=pow2_scales)
    assert page.dtype == torch.uint8 and page.shape == (T * 132,) and page.numel() == 8448
    codes = page[: T * 128].view(torch.float8_e4m3fn).float().reshape(T, 128)  # first T*128 bytes
    scales = page[T * 128 :].numpy().view("<f4")  # last T*4 bytes: [T] fp32
    amax_over_448 = np.abs(keys.numpy()).max(-1) / np.float32(448.0)
    if pow2_scales:
        assert np.all(np.frexp(scales)[0] == 0.5)
        assert np.all(scales >= amax_over_448) and np.all(scales / 2 < amax_over_448)
    else:
        assert np.array_equal(scales, amax_over_448)
    dequant = dequantize_indexer_fp8(page)
    assert dequant.shape == (T, 128) and dequant.dtype == torch.float32
    assert torch.equal(dequant, codes * torch.from_numpy(scales.copy()).unsqueeze(-1))
    # the page may arrive [T, 132]-shaped from a pool: same bytes, same result
    assert torch.equal(dequantize_indexer_fp8(page.reshape(T, 132)), dequant)


@pytest.mark.parametrize("pow2_scales", [False, True])
def test_indexer_fp8_round_trip_tolerance(pow2_scales):
    keys = _indexer_keys(80)
    page = quantize_indexer_fp8(keys, pow2_scales=pow2_scales)
    scales = torch.from_numpy(page[T * 128 :].numpy().view("<f4").copy()).unsqueeze(-1)
    err = (dequantize_indexer_fp8(page) - keys).abs()
    assert bool((err <= keys.abs() / 16 + scales * 2.0**-10).all())
    assert bool((err <= keys.abs().amax(-1, keepdim=True) / 16).all())
    assert float(err.max()) > 0


def test_indexer_fp8_requantise_without_pow2_is_byte_exact():
    page = quantize_indexer_fp8(_indexer_keys(90))
    assert torch.equal(quantize_indexer_fp8(dequantize_indexer_fp8(page)), page)


def test_indexer_fp8_requantise_with_pow2():
    """Same rule as MLA: byte-exact unless a token's largest code rounded down to 224."""
    page = quantize_indexer_fp8(_indexer_keys(91), pow2_scales=True)
    keys = dequantize_indexer_fp8(page)
    again = quantize_indexer_fp8(keys, pow2_scales=True)
    halved = _fp8_max_code(page[: T * 128].view(torch.float8_e4m3fn).reshape(T, 128)) <= 224  # [T]
    assert 0 < int(halved.sum()) < T
    old_scales, new_scales = page[T * 128 :].view(torch.float32), again[T * 128 :].view(torch.float32)
    assert torch.equal(new_scales[halved], old_scales[halved] / 2)
    assert torch.equal(new_scales[~halved], old_scales[~halved])
    old_codes, new_codes = page[: T * 128].reshape(T, 128), again[: T * 128].reshape(T, 128)
    assert torch.equal(new_codes[~halved], old_codes[~halved])
    assert torch.equal(dequantize_indexer_fp8(again), keys)
    assert torch.equal(quantize_indexer_fp8(dequantize_indexer_fp8(again), pow2_scales=True), again)


def test_indexer_fp8_pow2_byte_exact_for_full_range_tokens():
    g = torch.Generator().manual_seed(92)
    codes = torch.randint(-448, 449, (T, 128), generator=g).float()
    codes[:, 5] = -448.0
    codes = codes.to(torch.float8_e4m3fn).float()
    scales = 2.0 ** torch.randint(-20, 10, (T, 1), generator=g).float()
    page = quantize_indexer_fp8(codes * scales, pow2_scales=True)
    assert torch.equal(page[T * 128 :].view(torch.float32), scales.squeeze(-1))
    assert torch.equal(quantize_indexer_fp8(dequantize_indexer_fp8(page), pow2_scales=True), page)


# ---- indexer_bf16 --------------------------------------------------------------------------


def test_indexer_bf16_pack_unpack_exact():
    keys = _indexer_keys(95).to(torch.bfloat16)
    page = pack_indexer_bf16(keys)
    assert page.dtype == torch.uint8 and page.shape == (T, 256)
    assert np.array_equal(page.numpy(), _bf16_bits(keys))
    assert torch.equal(unpack_indexer_bf16(page).view(torch.int16), keys.view(torch.int16))


# ---- zeros and bad shapes ------------------------------------------------------------------


@pytest.mark.parametrize("pow2_scales", [False, True])
def test_all_zero_input_gives_zeros_without_nan(pow2_scales):
    page = quantize_mla_fp8_ds(torch.zeros(T, 512), torch.zeros(T, 64), pow2_scales=pow2_scales)
    assert not bool(page[:, :512].any())  # fp8 +0.0 is byte 0
    scales = page[:, 512:528].contiguous().view(torch.float32)
    assert bool(torch.isfinite(scales).all()) and bool((scales > 0).all())
    latent, rope = dequantize_mla_fp8_ds(page)
    assert not bool(latent.isnan().any()) and bool((latent == 0).all()) and bool((rope == 0).all())

    ipage = quantize_indexer_fp8(torch.zeros(T, 128), pow2_scales=pow2_scales)
    assert not bool(ipage[: T * 128].any())
    iscales = ipage[T * 128 :].view(torch.float32)
    assert bool(torch.isfinite(iscales).all()) and bool((iscales > 0).all())
    keys = dequantize_indexer_fp8(ipage)
    assert not bool(keys.isnan().any()) and bool((keys == 0).all())


def test_one_zero_tile_beside_a_nonzero_tile():
    latent = _latent(96)
    latent[:, 128:256] = 0  # tile 1 of every token is zero
    dequant, _ = dequantize_mla_fp8_ds(quantize_mla_fp8_ds(latent, _rope(97)))
    assert bool((dequant[:, 128:256] == 0).all())
    assert bool(torch.isfinite(dequant).all())


@pytest.mark.parametrize(
    "call",
    [
        lambda: hf_rope_to_interleaved(torch.zeros(4, 63)),
        lambda: interleaved_to_hf_rope(torch.zeros(4, 128)),
        lambda: pack_mla_bf16(torch.zeros(4, 511), torch.zeros(4, 64)),
        lambda: pack_mla_bf16(torch.zeros(4, 512), torch.zeros(4, 65)),
        lambda: unpack_mla_bf16(torch.zeros(4, 1151, dtype=torch.uint8)),
        lambda: quantize_mla_fp8_ds(torch.zeros(4, 576), torch.zeros(4, 64)),
        lambda: quantize_mla_fp8_ds(torch.zeros(4, 512), torch.zeros(4, 32)),
        lambda: dequantize_mla_fp8_ds(torch.zeros(4, 655, dtype=torch.uint8)),
        lambda: dequantize_mla_fp8_ds(torch.zeros(4, 1152, dtype=torch.uint8)),
        lambda: quantize_indexer_fp8(torch.zeros(4, 127)),
        lambda: quantize_indexer_fp8(torch.zeros(128)),
        lambda: quantize_indexer_fp8(torch.zeros(2, 4, 128)),
        lambda: dequantize_indexer_fp8(torch.zeros(133, dtype=torch.uint8)),
        lambda: dequantize_indexer_fp8(torch.zeros(4 * 128, dtype=torch.uint8)),
        lambda: pack_indexer_bf16(torch.zeros(4, 129)),
        lambda: unpack_indexer_bf16(torch.zeros(4, 255, dtype=torch.uint8)),
    ],
)
def test_wrong_widths_raise(call):
    with pytest.raises(InvalidRequest):
        call()


@pytest.mark.parametrize("pack", [pack_mla_bf16, quantize_mla_fp8_ds])
def test_latent_and_rope_of_different_token_counts_are_refused(pack):
    with pytest.raises(InvalidRequest, match="same tokens"):
        pack(torch.zeros(4, 512), torch.zeros(3, 64))


@pytest.mark.parametrize("pow2_scales", [False, True])
def test_zero_tiles_and_tokens_stay_zero_with_denormals_flushed(pow2_scales):
    """An all-zero tile once got a subnormal scale: 0 under flush-to-zero, and 0/0 made it NaN."""
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        latent = _latent(80)
        latent[:, :128] = 0  # tile 0 of every token
        keys = _indexer_keys(81)
        keys[0] = 0
        mla, _ = dequantize_mla_fp8_ds(quantize_mla_fp8_ds(latent, _rope(82), pow2_scales=pow2_scales))
        indexer = dequantize_indexer_fp8(quantize_indexer_fp8(keys, pow2_scales=pow2_scales))
    finally:
        torch.set_flush_denormal(False)
    assert bool(torch.isfinite(mla).all()) and bool((mla[:, :128] == 0).all())
    assert bool(torch.isfinite(indexer).all()) and bool((indexer[0] == 0).all())


def test_indexer_scales_are_floored_as_vllm_floors_them():
    """vLLM's indexer_k_quant_and_cache: scale = max(amax, 1e-4) / 448."""
    keys = torch.zeros(3, 128)
    keys[1, 5], keys[2, 7] = 5e-5, 2.0
    page = quantize_indexer_fp8(keys)
    scales = page[3 * 128 :].contiguous().view(torch.float32)
    expected = torch.tensor([1e-4, 1e-4, 2.0]) / 448.0
    assert torch.equal(scales, expected)
