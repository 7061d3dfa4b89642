"""The store namespace of the bytes this engine's page pool holds.

Two producers share a namespace only if their block bytes are interchangeable (DESIGN.md section
5). For this engine the bytes are decided by:

    field             value
    model             the name the caller serves the model under
    model_config_hash ``kvstore.keys.config_hash`` of the HF-style config (ModelConfig's fields)
    components        ("mla_bf16",) for V3; ("mla_bf16", "indexer_bf16") for V3.2
    engine, version   ENGINE_NAME, ENGINE_VERSION: the indexer numerics (HF 5.23: no Hadamard,
                      half-split RoPE, unquantised) are this engine's, so they are named here
    block_size        the page size of the pool
    weights_hash      the weights (``fingerprint.weights_fingerprint``, or the caller's own hash):
                      two checkpoints of one config served under one name must not share KV
    compute_dtype     the dtype the model computes in (extra): the same weights in bf16 and in
                      fp32 write different bytes, even where a caller's weights_hash names both
    cache_salt        the tenant salt (one tenant can neither reuse nor probe another's prefixes)

Bump ENGINE_VERSION whenever a change to the model code changes a single cached byte.

This module knows the namespace fields, nothing about pages or the store's tiers.
"""

from __future__ import annotations

from dataclasses import asdict

from engine_adapter.config import ModelConfig
from kvstore.keys import Namespace, config_hash

ENGINE_NAME = "mla-kvstore-engine"
ENGINE_VERSION = "1"
V3_COMPONENTS = ("mla_bf16",)
V32_COMPONENTS = ("mla_bf16", "indexer_bf16")


def components_for(config: ModelConfig) -> tuple[str, ...]:
    """The component formats of one block, in payload order (the pool's page layout follows it)."""
    return V32_COMPONENTS if config.is_v32 else V3_COMPONENTS


def namespace_for(config: ModelConfig, model_name: str, block_size: int = 64, cache_salt: str = "",
                  weights_hash: str = "", compute_dtype: str = "") -> Namespace:
    """The namespace of the blocks this engine produces for ``config`` at ``block_size`` with the
    weights ``weights_hash`` identifies computing in ``compute_dtype`` (``str(torch dtype)``; empty:
    the caller vouches that ``model_name`` says both)."""
    return Namespace(
        model=model_name,
        model_config_hash=config_hash(asdict(config)),
        num_layers=config.num_hidden_layers,
        components=components_for(config),
        block_size=block_size,
        engine=ENGINE_NAME,
        engine_version=ENGINE_VERSION,
        weights_hash=weights_hash,
        cache_salt=cache_salt,
        extra=(("compute_dtype", compute_dtype),) if compute_dtype else (),
    )
