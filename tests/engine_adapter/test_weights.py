"""Loading HF safetensors by name: sharded checkpoints, MTP layers, tied embeddings, errors; random init."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_adapter.config import ModelConfig
from engine_adapter.model import DeepseekForCausalLM
from engine_adapter.weights import INDEX_FILE, CheckpointError
from tests.engine_adapter.conftest import make_pair
from tests.engine_adapter.hf_oracle import TINY_V32, hf_prefill, prompt, rel_err
from tests.engine_adapter.test_model import run


def same_weights(a: DeepseekForCausalLM, b: DeepseekForCausalLM) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def rewrite(directory, tmp_path, edit) -> str:
    """A copy of a single-file checkpoint with its tensors passed through edit(dict)."""
    out = tmp_path / "edited"
    shutil.copytree(directory, out)
    tensors = load_file(out / "model.safetensors")
    edit(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_sharded_checkpoint_loads_the_same_weights(v3, tmp_path):
    v3.hf.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / INDEX_FILE).is_file()
    assert same_weights(DeepseekForCausalLM.from_pretrained(tmp_path, dtype=torch.float32), v3.ours)


def test_layers_past_num_hidden_layers_are_skipped(v3, tmp_path):
    """DeepSeek checkpoints carry the multi-token-prediction layer as model.layers.<num_hidden_layers>."""
    mtp = f"model.layers.{v3.ours.config.num_hidden_layers}.eh_proj.weight"
    directory = rewrite(v3.directory, tmp_path, lambda t: t.update({mtp: torch.zeros(2, 2)}))
    assert same_weights(DeepseekForCausalLM.from_pretrained(directory, dtype=torch.float32), v3.ours)


def test_missing_unexpected_and_misshaped_tensors_are_named(v3, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    with pytest.raises(CheckpointError, match="missing.*experts.3.up_proj"):
        DeepseekForCausalLM.from_pretrained(rewrite(v3.directory, tmp_path / "a", lambda t: t.pop(name)))
    with pytest.raises(CheckpointError, match="does not have.*bogus"):
        DeepseekForCausalLM.from_pretrained(
            rewrite(v3.directory, tmp_path / "b", lambda t: t.update({"model.bogus.weight": torch.zeros(1)})))
    with pytest.raises(CheckpointError, match="shape"):
        DeepseekForCausalLM.from_pretrained(
            rewrite(v3.directory, tmp_path / "c", lambda t: t.update({name: torch.zeros(3, 3)})))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        DeepseekForCausalLM.from_pretrained(_config_only(v3.directory, tmp_path / "d"))


def _config_only(directory, out):
    out.mkdir(parents=True)
    shutil.copy(directory / "config.json", out / "config.json")
    return out


def test_tied_embeddings_match_hf(tmp_path_factory):
    pair = make_pair(tmp_path_factory, "v3_tied", tie_word_embeddings=True)
    assert pair.ours.lm_head.weight is pair.ours.model.embed_tokens.weight
    token_ids = prompt(16)
    assert rel_err(run(pair.ours, token_ids)[0], hf_prefill(pair.hf, token_ids).logits) < 1e-4


@pytest.mark.parametrize("v32", [False, True])
def test_random_weights_are_seeded_and_run(v32):
    fields = {k: v for k, v in TINY_V32.items() if v32 or not k.startswith("index_")}
    config = ModelConfig.from_hf({k: v for k, v in fields.items() if k != "initializer_range"})
    a, b = (DeepseekForCausalLM.random(config, seed=7, dtype=torch.float32) for _ in range(2))
    assert same_weights(a, b)
    assert not same_weights(a, DeepseekForCausalLM.random(config, seed=8, dtype=torch.float32))
    logits, cache = run(a, prompt(40))
    assert logits.shape == (40, 256) and torch.isfinite(logits).all() and cache.length == 40
    assert (cache.read(0).indexer_key is not None) == v32
