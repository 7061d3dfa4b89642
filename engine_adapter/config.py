"""The model's shape and hyper-parameters, read from a HF ``config.json``.

``ModelConfig`` uses the HF field names so a checkpoint's config maps onto it one to one. It knows
DeepSeek-V3 (``deepseek_v3``: MLA + MoE) and DeepSeek-V3.2 (``deepseek_v32``: the same plus the DSA
lightning indexer); ``is_v32`` tells them apart. It validates on construction and raises
``ModelConfigError`` naming the field and what would be valid.

It knows nothing about weights, devices or the cache.

RoPE: HF 5.x writes ``rope_parameters`` (``rope_type``, ``rope_theta``, ``factor`` ...); released
DeepSeek checkpoints write ``rope_theta`` plus a legacy ``rope_scaling`` dict (``type: yarn``).
Both normalise to ``rope_theta`` and ``rope_scaling`` (a ``YarnScaling`` or None for plain RoPE).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """The config describes a model this engine cannot run, or is inconsistent."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension, resolved to concrete numbers (HF ``_compute_yarn_parameters``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # None: derived from factor / mscale / mscale_all_dim
    truncate: bool = True

    def __post_init__(self) -> None:
        _check_positive_number("rope_scaling.factor", self.factor)
        _check_int("rope_scaling.original_max_position_embeddings", self.original_max_position_embeddings, minimum=1)
        for name in ("beta_fast", "beta_slow"):
            _check_positive_number(f"rope_scaling.{name}", getattr(self, name))
        for name in ("mscale", "mscale_all_dim", "attention_factor"):
            if getattr(self, name) is not None:
                _check_positive_number(f"rope_scaling.{name}", getattr(self, name), zero_ok=name != "attention_factor")

    @classmethod
    def from_hf(cls, params: dict[str, Any], max_position_embeddings: int) -> YarnScaling:
        """HF rope dict (``rope_parameters`` or legacy ``rope_scaling``) -> YarnScaling."""
        original = params.get("original_max_position_embeddings", max_position_embeddings)
        factor = params.get("factor") or max_position_embeddings / original  # HF's fallback
        return cls(
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


# config.json fields that only V3.2 has; the rest of config.json (token ids, init range ...) is ignored.
_V32_FIELDS = ("index_n_heads", "index_head_dim", "index_topk")


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek V3 / V3.2 architecture, HF field names. V3.2 iff the three ``index_*`` are set."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_shared_experts: int
    n_routed_experts: int
    routed_scaling_factor: float
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    index_topk: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.rope_scaling, dict):  # accept the HF dict form too
            params = dict(self.rope_scaling, rope_theta=self.rope_theta)
            object.__setattr__(self, "rope_scaling", _rope_from_hf(
                {"rope_scaling": params, "max_position_embeddings": self.max_position_embeddings})[1])
        _validate(self)

    @property
    def is_v32(self) -> bool:
        """True for DeepSeek-V3.2 (DSA lightning indexer in every layer)."""
        return self.index_topk is not None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_group

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a HF config dict (the parsed ``config.json``)."""
        _reject_unsupported(hf)
        derived = {"rope_theta", "rope_scaling", "first_k_dense_replace", "q_lora_rank"}
        required = [f.name for f in fields(cls) if f.default is MISSING and f.name not in derived]
        missing = [name for name in required if name not in hf]
        if missing:
            raise ModelConfigError(f"config.json lacks required fields: {', '.join(missing)}")
        names = [f.name for f in fields(cls) if f.name not in derived]
        values = {name: hf[name] for name in names if name in hf}
        if hf.get("model_type") == "deepseek_v32" or "index_topk" in hf:
            if missing := [name for name in _V32_FIELDS if name not in hf]:
                raise ModelConfigError(f"V3.2 config.json lacks indexer fields: {', '.join(missing)}")
        else:
            values.update({name: None for name in _V32_FIELDS})  # V3: ignore stray index_* fields
        values["q_lora_rank"] = hf.get("q_lora_rank")
        values["first_k_dense_replace"] = _dense_layer_count(hf)
        values["rope_theta"], values["rope_scaling"] = _rope_from_hf(hf)
        return cls(**values)

    @classmethod
    def from_pretrained_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise ModelConfigError(f"no config.json in {path}")
        return cls.from_hf(json.loads(config_file.read_text()))


def _dense_layer_count(hf: dict[str, Any]) -> int:
    """``first_k_dense_replace``, cross-checked against V3.2's ``mlp_layer_types`` when present."""
    layer_types = hf.get("mlp_layer_types")
    if layer_types is None:
        if "first_k_dense_replace" not in hf:
            raise ModelConfigError("config.json lacks first_k_dense_replace (and mlp_layer_types)")
        return int(hf["first_k_dense_replace"])
    dense = sum(1 for t in layer_types if t == "dense")
    if list(layer_types) != ["dense"] * dense + ["sparse"] * (len(layer_types) - dense):
        raise ModelConfigError(f"mlp_layer_types must be 'dense'* then 'sparse'*, got {layer_types}")
    return dense


def _rope_from_hf(hf: dict[str, Any]) -> tuple[float, YarnScaling | None]:
    """(rope_theta, rope_scaling) from ``rope_parameters`` (HF 5.x) or ``rope_scaling`` (legacy)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "yarn":
        raise ModelConfigError(f"unsupported rope type {rope_type!r}; supported: 'default', 'yarn'")
    return theta, YarnScaling.from_hf(params, int(hf.get("max_position_embeddings", 4096)))


def _reject_unsupported(hf: dict[str, Any]) -> None:
    """Features of the HF config that this engine does not implement, each with its reason."""
    if hf.get("quantization_config"):
        raise ModelConfigError("quantized checkpoints (quantization_config) are not supported; "
                               "convert the weights to bf16 first")
    if hf.get("hidden_act", "silu") != "silu":
        raise ModelConfigError(f"hidden_act must be 'silu', got {hf['hidden_act']!r}")
    if hf.get("attention_bias", False):
        raise ModelConfigError("attention_bias=True is not supported (DeepSeek checkpoints have none)")
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ModelConfigError("only the V3 router (scoring_func 'sigmoid', topk_method 'noaux_tc') is "
                               f"supported, got {hf.get('scoring_func')!r} / {hf.get('topk_method')!r}")
    if hf.get("rope_interleave", True) is not True:
        raise ModelConfigError("rope_interleave=False is not supported: DeepSeek MLA rope is interleaved")


_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "n_routed_experts", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                  "v_head_dim", "n_group", "topk_group", "num_experts_per_tok", "max_position_embeddings")
_POSITIVE_FLOATS = ("routed_scaling_factor", "rms_norm_eps", "rope_theta")


def _validate(c: ModelConfig) -> None:
    for name in _POSITIVE_INTS:
        _check_int(name, getattr(c, name), minimum=1)
    for name in ("q_lora_rank", *_V32_FIELDS):
        if getattr(c, name) is not None:
            _check_int(name, getattr(c, name), minimum=1, alternative=" or None")
    _check_int("n_shared_experts", c.n_shared_experts, minimum=0)
    _check_int("first_k_dense_replace", c.first_k_dense_replace, minimum=0)
    for name in _POSITIVE_FLOATS:
        _check_positive_number(name, getattr(c, name))
    if c.qk_rope_head_dim % 2:
        raise ModelConfigError(f"qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
    if c.first_k_dense_replace > c.num_hidden_layers:
        raise ModelConfigError(f"first_k_dense_replace must be in [0, {c.num_hidden_layers}], "
                               f"got {c.first_k_dense_replace}")
    _validate_router(c)
    _validate_indexer(c)


def _check_int(name: str, value: object, minimum: int, alternative: str = "") -> None:
    """``ModelConfigError`` unless ``value`` is an int (not a bool) of at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ModelConfigError(f"{name} must be {kind}{alternative}, got {value!r}")


def _check_positive_number(name: str, value: object, zero_ok: bool = False) -> None:
    """``ModelConfigError`` unless ``value`` is a finite number (not a bool) above 0 (or 0, where ``zero_ok``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            not (value >= 0 if zero_ok else value > 0):
        kind = "a finite number >= 0" if zero_ok else "a finite positive number"
        raise ModelConfigError(f"{name} must be {kind}, got {value!r}")


def _validate_router(c: ModelConfig) -> None:
    if c.n_routed_experts % c.n_group or c.experts_per_group < 2:
        raise ModelConfigError(
            f"n_routed_experts ({c.n_routed_experts}) must split into n_group ({c.n_group}) equal groups "
            "of at least 2 experts (a group's score is the sum of its top-2 experts)"
        )
    if c.topk_group > c.n_group:
        raise ModelConfigError(f"topk_group ({c.topk_group}) must be <= n_group ({c.n_group})")
    if c.num_experts_per_tok > c.topk_group * c.experts_per_group:
        raise ModelConfigError(
            f"num_experts_per_tok ({c.num_experts_per_tok}) must be <= topk_group x experts per group "
            f"({c.topk_group * c.experts_per_group})"
        )


def _validate_indexer(c: ModelConfig) -> None:
    given = [getattr(c, n) is not None for n in _V32_FIELDS]
    if any(given) and not all(given):
        raise ModelConfigError(f"V3.2 needs all of {', '.join(_V32_FIELDS)} or none of them")
    if not c.is_v32:
        return
    if c.q_lora_rank is None:
        raise ModelConfigError("V3.2 needs q_lora_rank: the indexer's queries read the q_a latent")
    if c.index_head_dim < c.qk_rope_head_dim:
        raise ModelConfigError(f"index_head_dim ({c.index_head_dim}) must be >= qk_rope_head_dim "
                               f"({c.qk_rope_head_dim}): its first qk_rope_head_dim dims carry RoPE")
