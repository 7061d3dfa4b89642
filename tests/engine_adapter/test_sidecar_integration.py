"""The whole path over the sidecar: engine -> SidecarConnector -> gRPC -> TieredStore.

Two engines, each with its own connector and client (as two engine processes on one host would
have), share one sidecar: what engine A computed, engine B gets as a connector hit, computes only
the suffix of, and answers exactly as a cold run. A sidecar that is down changes nothing but the
hit count: the engine computes everything and still matches the cold run.
"""

from __future__ import annotations

import pytest
import torch

from connectors.factory import connector_from_config
from connectors.sidecar_connector import SidecarConnector
from engine_adapter.engine import Engine
from engine_adapter.model import DeepseekForCausalLM
from engine_adapter.namespace import namespace_for
from engine_adapter.paged_cache import PagePool
from engine_adapter.sequence import Request
from kvstore.service.client import KVStoreClient
from tests.connectors.sidecar_server import Sidecar, unused_address
from tests.engine_adapter.engine_helpers import Recorder, prompt_ids, reference_greedy
from tests.engine_adapter.hf_oracle import rel_err
from tests.engine_adapter.test_engine import NEW, P, assert_matches_cold


@pytest.fixture
def sidecar(make_store):
    server = Sidecar(make_store(host_bytes=8 << 20, page_bytes=1 << 20, disk_bytes=64 << 20, segment_bytes=8 << 20))
    yield server
    server.stop()


def engine_over(model, address: str, pages: int = 32):
    connector = connector_from_config(namespace_for(model.config, "deepseek", P), environ={"KVSTORE_SIDECAR": address})
    assert isinstance(connector, SidecarConnector)
    recorder = Recorder(model)
    return Engine(recorder, PagePool(model.config, pages, page_size=P), connector=connector), recorder, connector


def test_two_engines_share_hits_through_one_sidecar(v3, sidecar):
    model = v3.ours
    prompt = prompt_ids(45, seed=41)  # 5 reusable blocks of 8 tokens
    producer, _, a = engine_over(model, sidecar.target)
    [cold] = producer.run([Request(prompt, NEW)])
    assert cold.stats.connector_hit_tokens == 0 and cold.stats.computed_prompt_tokens == 45
    a.flush()
    assert sidecar.store.stats().stored_blocks >= 5

    consumer, recorder, b = engine_over(model, sidecar.target)
    [out] = consumer.run([Request(prompt, NEW)])
    assert (out.stats.connector_hit_tokens, out.stats.device_hit_tokens, out.stats.computed_prompt_tokens) == (40, 0, 5)
    assert out.output_ids == cold.output_ids
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=40)
    assert sidecar.store.stats().tier("host").loaded_blocks >= 5
    b.flush()
    assert sidecar.store.stats().leases_active == 0

    # and back: B's longer conversation turn is a hit for A's next one (A's device copy is gone)
    follow = prompt + list(out.output_ids) + prompt_ids(20, seed=42)
    [b_out] = consumer.run([Request(follow, NEW)])
    b.flush()
    third, recorder, c = engine_over(model, sidecar.target)
    [c_out] = third.run([Request(follow, NEW)])
    reused = len(follow) // P * P if len(follow) % P else len(follow) - P
    assert c_out.stats.connector_hit_tokens == reused
    assert c_out.output_ids == b_out.output_ids
    # The reused KV includes positions B produced while decoding (bf16 pages of decode-step KV, not
    # a one-pass prefill's): the tokens match a cold run, the logits to a looser bound than 1e-5.
    ref_tokens, ref_logits = reference_greedy(model, follow, NEW)
    assert list(c_out.output_ids) == ref_tokens
    assert rel_err(recorder.logits(range(reused, len(follow) + NEW - 1)), ref_logits[reused:]) < 1e-4
    for connector in (a, b, c):
        connector.close()


def test_an_engine_over_a_sidecar_that_is_down_computes_everything(v3):
    model = v3.ours
    prompt = prompt_ids(45, seed=43)
    engine, recorder, connector = engine_over(model, unused_address())
    connector.client._timeout = 5
    [out] = engine.run([Request(prompt, NEW)])
    assert out.stats.connector_hit_tokens == 0 and out.stats.computed_prompt_tokens == 45
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=0)
    connector.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("shared_memory", [True, False])
def test_on_cuda_engines_share_hits_through_the_sidecar(v32, sidecar, shared_memory):
    """Device pages gathered to the host for saves and scattered back for loads, on a real GPU,
    through shared memory or (a client that cannot map it) the data plane or Get."""
    model = DeepseekForCausalLM.from_pretrained(v32.directory, dtype=torch.float32, device="cuda")
    prompt = prompt_ids(45, seed=43)
    cold = Engine(model, PagePool(model.config, 32, page_size=P, device="cuda")).generate([prompt], NEW)
    namespace = namespace_for(model.config, "deepseek", P)
    saver = SidecarConnector(sidecar.target, namespace)
    Engine(model, PagePool(model.config, 32, page_size=P, device="cuda"), connector=saver).run([Request(prompt, NEW)])
    saver.flush()
    with KVStoreClient(sidecar.target, shared_memory=shared_memory) as client:
        loader = SidecarConnector(client, namespace)
        engine = Engine(model, PagePool(model.config, 32, page_size=P, device="cuda"), connector=loader)
        [out] = engine.run([Request(prompt, NEW)])
        loader.close()
    saver.close()
    assert (out.stats.connector_hit_tokens, out.stats.computed_prompt_tokens) == (40, 5)
    assert [list(out.output_ids)] == cold
    assert engine.pool.layer_page_bytes(0, 0).is_cuda
