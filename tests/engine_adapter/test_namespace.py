"""namespace_for: the components and fingerprint of the bytes this engine produces."""

from __future__ import annotations

from dataclasses import asdict, replace

from engine_adapter.config import ModelConfig
from engine_adapter.namespace import ENGINE_NAME, ENGINE_VERSION, namespace_for
from kvstore.keys import config_hash
from kvstore.layout import BlockSpec
from tests.engine_adapter.hf_oracle import TINY_V3, TINY_V32

V3 = ModelConfig.from_hf(TINY_V3)
V32 = ModelConfig.from_hf(TINY_V32)


def test_v3_namespace_fields():
    ns = namespace_for(V3, "tiny-v3", block_size=8)
    assert ns.components == ("mla_bf16",)
    assert (ns.engine, ns.engine_version) == (ENGINE_NAME, ENGINE_VERSION) == ("mla-kvstore-engine", "1")
    assert ns.model == "tiny-v3" and ns.num_layers == 3 and ns.block_size == 8
    assert ns.model_config_hash == config_hash(asdict(V3))
    assert BlockSpec.of(ns).layer_bytes == 8 * 1152


def test_v32_blocks_carry_the_indexer_component():
    ns = namespace_for(V32, "tiny-v32")
    assert ns.components == ("mla_bf16", "indexer_bf16") and ns.block_size == 64
    assert BlockSpec.of(ns).layer_bytes == 64 * (1152 + 256)


def test_same_inputs_same_id_and_every_input_counts():
    base = namespace_for(V3, "m")
    assert namespace_for(V3, "m").id == base.id
    others = [namespace_for(V3, "m", block_size=32), namespace_for(V3, "m", cache_salt="tenant-a"),
              namespace_for(V3, "other"), namespace_for(replace(V3, rope_theta=5e4), "m"),
              namespace_for(V32, "m")]
    assert len({base.id, *(ns.id for ns in others)}) == 1 + len(others)
