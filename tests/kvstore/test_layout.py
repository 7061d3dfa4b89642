"""Block layouts: byte totals of the real models (DESIGN.md section 4) and exact offsets."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace
from kvstore.layout import (
    DEEPSEEK_NUM_LAYERS,
    DEEPSEEK_V3_COMPONENTS,
    DEEPSEEK_V32_COMPONENTS,
    FORMATS,
    BlockSpec,
    component_format,
)

V3 = BlockSpec(DEEPSEEK_NUM_LAYERS, 64, DEEPSEEK_V3_COMPONENTS)
V32 = BlockSpec(DEEPSEEK_NUM_LAYERS, 64, DEEPSEEK_V32_COMPONENTS)


def test_per_token_bytes_of_each_format():
    assert {name: f.bytes_per_token for name, f in FORMATS.items()} == {
        "mla_bf16": 1152,  # (512 + 64) * 2
        "mla_fp8_ds": 656,  # 512 + 4 * 4 + 64 * 2
        "indexer_fp8": 132,  # 128 + 4
        "indexer_bf16": 256,  # 128 * 2
    }
    assert {name: f.kind for name, f in FORMATS.items()} == {
        "mla_bf16": "mla", "mla_fp8_ds": "mla", "indexer_fp8": "indexer", "indexer_bf16": "indexer",
    }
    assert component_format("indexer_fp8").page_bytes(64) == 8192 + 256  # blocked page of DESIGN.md


def test_deepseek_v3_bf16_totals():
    assert DEEPSEEK_NUM_LAYERS == 61 and DEEPSEEK_V3_COMPONENTS == ("mla_bf16",)
    assert V3.bytes_per_token == 70_272
    assert V3.layer_bytes == 1152 * 64 == 73_728
    assert V3.block_bytes == 4_497_408
    assert V3.block_bytes == V3.bytes_per_token * 64


def test_deepseek_v32_fp8_totals():
    assert DEEPSEEK_V32_COMPONENTS == ("mla_fp8_ds", "indexer_fp8")
    assert V32.bytes_per_token == 48_068
    assert V32.layer_bytes == (656 + 132) * 64 == 50_432
    assert V32.block_bytes == 3_076_352
    assert V32.block_bytes == V32.bytes_per_token * 64


def test_spec_of_namespace_copies_geometry():
    ns = Namespace(model="m", model_config_hash="c", num_layers=3, components=["mla_bf16", "indexer_bf16"],
                   block_size=16)
    spec = BlockSpec.of(ns)
    assert spec == BlockSpec(3, 16, ("mla_bf16", "indexer_bf16"))
    assert spec.components == ("mla_bf16", "indexer_bf16")
    assert spec.block_bytes == 3 * 16 * (1152 + 256) == 67_584


def test_layer_ranges_are_contiguous_and_cover_the_block():
    assert V32.layer_range(0) == (0, 50_432)
    assert V32.layer_range(1) == (50_432, 50_432)
    assert V32.layer_range(60) == (3_025_920, 50_432)
    end = 0
    for layer in range(V32.num_layers):
        offset, length = V32.layer_range(layer)
        assert offset == end
        end = offset + length
    assert end == V32.block_bytes


def test_component_ranges_inside_a_layer():
    mla_page, indexer_page = 656 * 64, 132 * 64  # 41,984 and 8,448
    assert V32.component_range(0, "mla_fp8_ds") == (0, mla_page)
    assert V32.component_range(0, "indexer_fp8") == (41_984, indexer_page)
    assert V32.component_range(1, "mla_fp8_ds") == (50_432, mla_page)
    assert V32.component_range(1, "indexer_fp8") == (50_432 + 41_984, 8_448)
    assert V32.component_range(60, "indexer_fp8") == (3_025_920 + 41_984, 8_448)
    assert sum(V32.component_range(60, "indexer_fp8")) == V32.block_bytes
    assert V3.component_range(7, "mla_bf16") == V3.layer_range(7) == (7 * 73_728, 73_728)


def test_component_order_follows_the_spec():
    spec = BlockSpec(2, 4, ("indexer_fp8", "mla_bf16"))
    assert spec.component_range(0, "indexer_fp8") == (0, 528)
    assert spec.component_range(0, "mla_bf16") == (528, 4608)
    assert spec.component_range(1, "indexer_fp8") == (5136, 528)
    assert spec.component_range(1, "mla_bf16") == (5664, 4608)
    assert spec.block_bytes == 10_272


def test_tiny_conftest_spec(spec):
    assert spec.block_bytes == 9_216  # the size tests/conftest.py promises


def test_unknown_format_raises():
    with pytest.raises(InvalidRequest, match="valid formats"):
        component_format("mla_fp4")
    with pytest.raises(InvalidRequest):
        BlockSpec(2, 64, ("mla_bf16", "indexer_fp4"))
    ns = Namespace(model="m", model_config_hash="c", num_layers=2, components=("bogus",))
    with pytest.raises(InvalidRequest):
        BlockSpec.of(ns)


@pytest.mark.parametrize(
    "components",
    [
        ("mla_bf16", "mla_fp8_ds"),
        ("mla_bf16", "mla_bf16"),
        ("indexer_fp8", "indexer_bf16"),
        ("mla_fp8_ds", "indexer_fp8", "indexer_fp8"),
    ],
)
def test_duplicate_kinds_raise(components):
    with pytest.raises(InvalidRequest):
        BlockSpec(2, 64, components)


@pytest.mark.parametrize("num_layers, block_size, components", [(0, 64, ("mla_bf16",)), (2, 0, ("mla_bf16",)),
                                                                 (-1, 64, ("mla_bf16",)), (2, 64, ())])
def test_bad_geometry_raises(num_layers, block_size, components):
    with pytest.raises(InvalidRequest):
        BlockSpec(num_layers, block_size, components)


@pytest.mark.parametrize("layer", [-1, 61, 62, 1000])
def test_layer_out_of_range_raises(layer):
    with pytest.raises(InvalidRequest):
        V32.layer_range(layer)
    with pytest.raises(InvalidRequest):
        V32.component_range(layer, "mla_fp8_ds")


def test_component_not_in_block_raises():
    with pytest.raises(InvalidRequest):
        V32.component_range(0, "mla_bf16")
    with pytest.raises(InvalidRequest):
        V3.component_range(0, "indexer_fp8")
