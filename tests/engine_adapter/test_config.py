"""ModelConfig: HF config dicts in both rope spellings, V3 vs V3.2, and validation messages."""

from __future__ import annotations

import json
import math

import pytest

from engine_adapter.config import ModelConfig, ModelConfigError, YarnScaling
from engine_adapter.rope import softmax_scale

# DeepSeek-V3's published config.json (minus its fp8 quantization_config).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_nextn_predict_layers": 1, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
}
DEEPSEEK_V32 = dict(DEEPSEEK_V3, model_type="deepseek_v32", index_n_heads=64, index_head_dim=128,
                    index_topk=2048)


def test_deepseek_v3_legacy_rope_scaling():
    config = ModelConfig.from_hf(DEEPSEEK_V3)
    assert not config.is_v32 and config.first_k_dense_replace == 3 and config.qk_head_dim == 192
    assert config.rope_scaling == YarnScaling(factor=40.0, original_max_position_embeddings=4096,
                                              mscale=1.0, mscale_all_dim=1.0)
    assert softmax_scale(config) == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)


def test_deepseek_v32_and_hf5_rope_parameters():
    hf5 = {k: v for k, v in DEEPSEEK_V32.items() if k not in ("rope_scaling", "rope_theta")}
    hf5["rope_parameters"] = dict(DEEPSEEK_V3["rope_scaling"], rope_type="yarn", rope_theta=10000.0)
    hf5["mlp_layer_types"] = ["dense"] * 3 + ["sparse"] * 58
    config = ModelConfig.from_hf(hf5)
    assert config.is_v32
    assert (config.index_n_heads, config.index_head_dim, config.index_topk) == (64, 128, 2048)
    assert config.rope_scaling == ModelConfig.from_hf(DEEPSEEK_V3).rope_scaling


def test_plain_rope_and_dict_rope_scaling_in_the_constructor():
    plain = {k: v for k, v in DEEPSEEK_V3.items() if k != "rope_scaling"}
    assert ModelConfig.from_hf(plain).rope_scaling is None
    fields = {f: getattr(ModelConfig.from_hf(plain), f) for f in ModelConfig.__dataclass_fields__}
    fields["rope_scaling"] = dict(DEEPSEEK_V3["rope_scaling"])
    assert ModelConfig(**fields).rope_scaling == ModelConfig.from_hf(DEEPSEEK_V3).rope_scaling


def test_from_pretrained_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V32))
    assert ModelConfig.from_pretrained_dir(tmp_path).is_v32
    with pytest.raises(ModelConfigError, match="no config.json"):
        ModelConfig.from_pretrained_dir(tmp_path / "missing")


@pytest.mark.parametrize("change, message", [
    ({"n_group": 256}, "groups of at least 2 experts"),
    ({"n_group": 7}, "equal groups"),
    ({"topk_group": 9}, "topk_group"),
    ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
    ({"qk_rope_head_dim": 63}, "even"),
    ({"first_k_dense_replace": 62}, "first_k_dense_replace"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized"),
    ({"scoring_func": "softmax"}, "router"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "unsupported rope type"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"hidden_act": "gelu"}, "silu"),
])
def test_invalid_configs_name_the_problem(change, message):
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf(dict(DEEPSEEK_V3, **change))


def test_invalid_v32_configs():
    with pytest.raises(ModelConfigError, match="q_lora_rank"):
        ModelConfig.from_hf(dict(DEEPSEEK_V32, q_lora_rank=None))
    with pytest.raises(ModelConfigError, match="index_head_dim"):
        ModelConfig.from_hf(dict(DEEPSEEK_V32, index_head_dim=32))
    with pytest.raises(ModelConfigError, match="lacks indexer fields: index_n_heads"):
        ModelConfig.from_hf({k: v for k, v in DEEPSEEK_V32.items() if k != "index_n_heads"})
    fields = {f: getattr(ModelConfig.from_hf(DEEPSEEK_V32), f) for f in ModelConfig.__dataclass_fields__}
    with pytest.raises(ModelConfigError, match="all of"):
        ModelConfig(**dict(fields, index_n_heads=None))
    with pytest.raises(ModelConfigError, match="mlp_layer_types"):
        ModelConfig.from_hf(dict(DEEPSEEK_V32, mlp_layer_types=["sparse", "dense"]))


def test_missing_fields_are_listed():
    with pytest.raises(ModelConfigError, match="lacks required fields: kv_lora_rank"):
        ModelConfig.from_hf({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"})


@pytest.mark.parametrize("change, message", [
    ({"q_lora_rank": "32"}, r"q_lora_rank must be a positive int or None, got '32'"),  # a bare TypeError before
    ({"n_shared_experts": None}, r"n_shared_experts must be an int >= 0, got None"),
    ({"routed_scaling_factor": None}, r"routed_scaling_factor must be a finite positive number, got None"),  # taken
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor must be a finite positive number"),
    ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite positive number"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive int, got True"),
    ({"index_topk": 16.5}, r"index_topk must be a positive int or None, got 16.5"),  # taken before
    ({"rope_scaling": dict(DEEPSEEK_V3["rope_scaling"], original_max_position_embeddings=0)},
     "rope_scaling.original_max_position_embeddings must be a positive int"),  # a math domain error in the forward
    ({"rope_scaling": dict(DEEPSEEK_V3["rope_scaling"], factor=-2)}, "rope_scaling.factor must be a finite positive"),
    ({"rope_scaling": dict(DEEPSEEK_V3["rope_scaling"], mscale=-1.0)},
     "rope_scaling.mscale must be a finite number >= 0"),
])
def test_every_field_of_the_wrong_kind_is_refused_naming_it(change, message):
    """Until session 34 these raised a bare TypeError, or were taken and failed in the forward."""
    with pytest.raises(ModelConfigError, match=message):
        ModelConfig.from_hf(dict(DEEPSEEK_V32, **change))
    assert ModelConfig.from_hf(dict(DEEPSEEK_V32, rope_scaling=dict(DEEPSEEK_V3["rope_scaling"], mscale=0.0)))
