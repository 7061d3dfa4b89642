"""The weights fingerprint separates checkpoints of one config, and the engine keys KV by it."""

import pytest
import torch

from connectors.store_connector import StoreConnector
from engine_adapter.engine import Engine
from engine_adapter.fingerprint import weights_fingerprint
from engine_adapter.model import DeepseekForCausalLM
from engine_adapter.namespace import namespace_for
from engine_adapter.paged_cache import PagePool
from engine_adapter.sequence import Request
from kvstore.store import TieredStore
from kvstore.tiers.host import HostTier

from tests.engine_adapter.test_engine import P


@pytest.fixture(scope="module")
def config(v3):
    return v3.ours.config


@pytest.fixture(scope="module")
def model(config):
    def make(seed: int = 0, dtype: torch.dtype = torch.float32) -> DeepseekForCausalLM:
        return DeepseekForCausalLM.random(config, seed=seed, dtype=dtype)
    return make


def test_equal_weights_give_equal_fingerprints(model):
    assert weights_fingerprint(model(0)) == weights_fingerprint(model(0))


@pytest.mark.parametrize("seed, dtype", [(1, torch.float32), (0, torch.bfloat16)], ids=["seed", "dtype"])
def test_other_weights_or_dtype_give_another_fingerprint(model, seed, dtype):
    assert weights_fingerprint(model(seed, dtype)) != weights_fingerprint(model(0))


def test_a_fine_tune_of_one_tensor_changes_the_fingerprint(model):
    tuned = model(0)
    with torch.no_grad():
        tuned.model.layers[1].self_attn.kv_a_proj_with_mqa.weight.mul_(1.01)  # every element moves a little
    assert weights_fingerprint(tuned) != weights_fingerprint(model(0))


def test_two_checkpoints_under_one_name_never_share_kv(model, config, tmp_path):
    """Engine A stores a prompt's KV; engine B (other weights, same config and name, same store,
    even a connector namespace that names no weights) must miss it and answer exactly as it does
    cold: the engine seeds its block hashes with its weights' fingerprint."""
    store = TieredStore([HostTier(16 << 20, page_bytes=1 << 20, shm_dir=str(tmp_path), prefault=False)],
                        background_writes=False)
    prompt = torch.randint(0, config.vocab_size, (5 * P,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(weights: DeepseekForCausalLM, connected: bool):
        connector = None
        if connected:
            connector = StoreConnector(store, namespace_for(config, "same-name", P))  # names no weights
        engine = Engine(weights, PagePool(config, 16, page_size=P), model_name="same-name", connector=connector)
        [out] = engine.run([Request(prompt, 4)])
        if connector is not None:
            connector.flush()
        return out

    try:
        a, b = model(0), model(1)
        run(a, connected=True)
        cold_b = run(b, connected=False)
        warm_b = run(b, connected=True)
        again_a = run(a, connected=True)
    finally:
        store.close()
    assert warm_b.stats.connector_hit_tokens == 0
    assert warm_b.output_ids == cold_b.output_ids
    assert again_a.stats.connector_hit_tokens > 0  # the store does serve the checkpoint that wrote it


def test_one_weights_hash_in_two_dtypes_gives_two_namespaces(model, config):
    """A caller's own weights_hash may name a checkpoint in any dtype; the bytes differ by dtype."""
    pool = PagePool(config, 4, page_size=P)
    bf16 = Engine(model(0, torch.bfloat16), pool, weights_hash="rev-abc")
    fp32 = Engine(model(0, torch.float32), pool, weights_hash="rev-abc")
    assert bf16.namespace.id != fp32.namespace.id
    assert dict(fp32.namespace.extra)["compute_dtype"] == "torch.float32"
