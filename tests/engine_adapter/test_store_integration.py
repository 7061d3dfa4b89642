"""The whole path: engine -> StoreConnector -> TieredStore (real host shm + disk tiers).

Engine A computes a prompt and saves its blocks into the store. Engine B (a fresh device pool,
as in another process) gets the prefix from the host tier; engine C, over a store reopened on
the same directory (host tier empty, as after a restart), gets it from disk. Every run computes
only the suffix and matches a cold run; a corrupt block on disk turns into recomputation.
"""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import torch

from connectors.store_connector import StoreConnector
from engine_adapter.engine import Engine
from engine_adapter.model import DeepseekForCausalLM
from engine_adapter.namespace import namespace_for
from engine_adapter.paged_cache import PagePool
from engine_adapter.sequence import Request
from kvstore.keys import namespace_hashes
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier
from kvstore.tiers.segment import HEADER_BYTES
from tests.engine_adapter.engine_helpers import Recorder, prompt_ids
from tests.engine_adapter.test_engine import NEW, P, assert_matches_cold
from tests.kvstore.store_helpers import hold_store_lock, until


def open_store(tmp_path, host: bool = True) -> TieredStore:
    tiers = [HostTier(8 << 20, page_bytes=1 << 20, shm_dir=str(tmp_path), prefault=False)] if host else []
    return TieredStore(tiers + [DiskTier(str(tmp_path / "disk"), 64 << 20)], background_writes=False)


def saved_by_a_producer(model, store, prompt):
    """An engine that has computed ``prompt`` and saved its blocks into ``store``; and its connector."""
    producer, _, connector = engine_over(model, store)
    producer.run([Request(prompt, NEW)])
    connector.flush()
    return producer, connector


def engine_over(model, store, **options):
    connector = StoreConnector(store, namespace_for(model.config, "deepseek", P), **options)
    recorder = Recorder(model)
    return Engine(recorder, PagePool(model.config, 32, page_size=P), connector=connector), recorder, connector


@pytest.mark.parametrize("pair_name", ["v3", "v32"])
def test_a_prefix_from_host_then_from_disk_gives_the_cold_outputs(pair_name, request, tmp_path):
    model = request.getfixturevalue(pair_name).ours
    prompt = prompt_ids(45, seed=31)  # 5 reusable blocks of 8 tokens; V3.2: a 40-token hit > index_topk
    store = open_store(tmp_path)
    producer, connector = saved_by_a_producer(model, store, prompt)
    assert store.stats().stored_blocks >= 5

    consumer, recorder, _ = engine_over(model, store)
    [out] = consumer.run([Request(prompt, NEW)])
    assert (out.stats.connector_hit_tokens, out.stats.device_hit_tokens, out.stats.computed_prompt_tokens) == (40, 0, 5)
    assert store.stats().tier("host").loaded_blocks >= 5
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=40)
    store.flush()
    store.check_integrity()
    store.close()

    store = open_store(tmp_path)  # a restart: the host tier starts empty, the disk tier remembers
    restarted, recorder, _ = engine_over(model, store)
    [out] = restarted.run([Request(prompt, NEW)])
    assert out.stats.connector_hit_tokens == 40 and out.stats.computed_prompt_tokens == 5
    assert store.stats().tier("disk").loaded_blocks >= 5
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=40)
    store.close()


def test_a_corrupt_block_on_disk_is_recomputed_not_reused(v3, tmp_path):
    model = v3.ours
    prompt = prompt_ids(45, seed=32)
    store = open_store(tmp_path, host=False)
    producer, connector = saved_by_a_producer(model, store, prompt)
    disk = store.tiers[0]
    key = connector.ns_id + namespace_hashes(producer.namespace, prompt)[2]
    entry = disk._index[key]
    with open(os.path.join(disk.path, "segments", f"{entry.segment:08d}.seg"), "r+b") as f:
        f.seek(entry.offset + HEADER_BYTES + 100)
        byte = f.read(1)
        f.seek(entry.offset + HEADER_BYTES + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    consumer, recorder, _ = engine_over(model, store)
    [out] = consumer.run([Request(prompt, NEW)])
    assert out.stats.connector_hit_tokens < 40 or out.stats.load_failures == 1
    assert out.stats.computed_prompt_tokens > 5, "the corrupt block and what follows were recomputed"
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=len(prompt) - out.stats.computed_prompt_tokens)
    assert disk.stats().checksum_failures == 1
    store.close()


def test_a_load_hung_on_disk_is_recomputed_at_its_deadline_not_waited_for(v3, tmp_path):
    """The disk stops answering mid-way through a hit: the engine gives up after ``load_timeout_s``,
    recomputes the whole prompt into the same pages and gets the cold outputs; the stuck read,
    when it returns at last, changes nothing."""
    model = v3.ours
    prompt = prompt_ids(45, seed=33)
    store = open_store(tmp_path, host=False)
    producer, connector = saved_by_a_producer(model, store, prompt)
    disk, unstick, read = store.tiers[0], threading.Event(), store.tiers[0].read
    disk.read = lambda *args, **kwargs: unstick.wait(30) and read(*args, **kwargs)
    # a deadline the load's thread surely reaches the hung read within on a busy machine: given up
    # before it reads, the load gives no verdict on the disk, and the next request would try it again
    consumer, recorder, connector = engine_over(model, store, load_timeout_s=2.0)
    started = time.monotonic()
    [out] = consumer.run([Request(prompt, NEW)])
    assert time.monotonic() - started < 20, "the engine waited for the hung load"
    assert (out.stats.load_failures, out.stats.connector_hit_tokens, out.stats.computed_prompt_tokens) == (1, 0, 45)
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=0)
    other = Engine(Recorder(model), PagePool(model.config, 32, page_size=P), connector=connector)
    [next_one] = other.run([Request(prompt, NEW)])  # the disk still hangs: no second wait on it
    assert (next_one.stats.load_failures, next_one.stats.connector_hit_tokens) == (0, 0)
    assert next_one.output_ids == out.output_ids
    unstick.set()
    assert until(lambda: store.stats().leases_active == 0)
    consumer.check_integrity()
    [again] = consumer.run([Request(prompt, NEW)])  # the device pages it recomputed still serve
    assert again.stats.device_hit_tokens == 40 and again.output_ids == out.output_ids
    store.close()


def test_the_engine_serves_while_the_stores_lock_is_held_by_a_thread_stuck_in_io(v3, tmp_path):
    """Lookups miss after ``lookup_timeout_s``, saves wait on their own thread, releases are
    handed off: the engine computes the prompt cold instead of stalling on the store."""
    model = v3.ours
    prompt = prompt_ids(45, seed=34)
    store = open_store(tmp_path)
    producer, connector = saved_by_a_producer(model, store, prompt)
    consumer, recorder, connector = engine_over(model, store, lookup_timeout_s=0.3)
    unstick = hold_store_lock(store, 60)
    started = time.monotonic()
    [out] = consumer.run([Request(prompt, NEW)])
    assert time.monotonic() - started < 20, "the engine stalled on the store's lock"
    assert (out.stats.connector_hit_tokens, out.stats.computed_prompt_tokens) == (0, 45)
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=0)
    unstick.set()
    connector.flush()
    assert store.stats().leases_active == 0
    store.close()


def test_an_engine_over_a_store_closed_under_it_computes_everything(v3, tmp_path):
    """Shutdown order gone wrong (the store's owner closed it first): misses, never a wedged step."""
    model = v3.ours
    prompt = prompt_ids(45, seed=35)
    store = open_store(tmp_path)
    producer, connector = saved_by_a_producer(model, store, prompt)
    consumer, recorder, _ = engine_over(model, store)
    store.close()
    [out] = consumer.run([Request(prompt, NEW)])
    assert (out.error, out.stats.connector_hit_tokens, out.stats.computed_prompt_tokens) == (None, 0, 45)
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=0)
    consumer.check_integrity()


def test_a_store_that_dropped_the_indexer_keys_is_a_miss_never_a_partial_hit(v32, tmp_path):
    """V3.2 blocks carry the indexer keys as a component of the same block. A store that kept
    only the latents would either write blocks of the wrong size (refused) or write them under
    another format's namespace (a different key space): both end as a miss for a V3.2 engine."""
    from dataclasses import replace

    import numpy as np

    from kvstore.errors import InvalidRequest
    from kvstore.layout import BlockSpec

    model = v32.ours
    prompt = prompt_ids(45, seed=33)
    store = open_store(tmp_path)
    full_ns = namespace_for(model.config, "deepseek", P)
    assert full_ns.components == ("mla_bf16", "indexer_bf16")
    latents_only = replace(full_ns, components=("mla_bf16",))
    assert latents_only.id != full_ns.id

    hashes = namespace_hashes(full_ns, prompt)
    ns_id = store.register_namespace(full_ns)
    latent_bytes = BlockSpec.of(latents_only).block_bytes
    with pytest.raises(InvalidRequest, match="expected exactly"):
        store.put(ns_id, hashes[:1], [np.zeros(latent_bytes, np.uint8)])  # incomplete block: refused

    dropped = StoreConnector(store, latents_only)  # what an indexer-dropping store would hold
    store.put(dropped.ns_id, namespace_hashes(latents_only, prompt), [np.zeros(latent_bytes, np.uint8)] * 5)
    consumer, recorder, _ = engine_over(model, store)
    [out] = consumer.run([Request(prompt, NEW)])
    assert out.stats.connector_hit_tokens == 0 and out.stats.computed_prompt_tokens == 45
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=0)
    store.close()


@pytest.mark.parametrize("field, value, theirs", [
    ("num_layers", 2, "2 layers x 8 tokens (mla_bf16, 9216 bytes a layer)"),  # would fill layers 0-1 only
    ("block_size", 64, "3 layers x 64 tokens (mla_bf16, 73728 bytes a layer)"),
    ("components", ("mla_bf16", "indexer_bf16"), "3 layers x 8 tokens (mla_bf16+indexer_bf16, 11264 bytes a layer)"),
])
def test_a_connector_over_another_block_layout_is_refused_when_the_engine_is_built(v3, tmp_path, field, value,
                                                                                   theirs):
    from dataclasses import replace

    model = v3.ours
    store = open_store(tmp_path)
    connector = StoreConnector(store, replace(namespace_for(model.config, "deepseek", P), **{field: value}))
    ours = "3 layers x 8 tokens (mla_bf16, 9216 bytes a layer)"
    with pytest.raises(ValueError, match=re.escape(f"the connector moves blocks of {theirs}; this engine's page "
                                                   f"pool holds {ours}: build the connector over the engine's "
                                                   "namespace")):
        Engine(model, PagePool(model.config, 32, page_size=P), connector=connector)
    connector.close()
    store.close()


def test_a_page_pool_built_from_another_config_is_refused_with_a_connector(v3, tmp_path):
    from dataclasses import replace

    model = v3.ours
    store = open_store(tmp_path)
    connector = StoreConnector(store, namespace_for(model.config, "deepseek", P))
    other = replace(model.config, num_hidden_layers=model.config.num_hidden_layers + 1)
    with pytest.raises(ValueError, match="the page pool holds 4 layers .* build the pool from the model's own config"):
        Engine(model, PagePool(other, 32, page_size=P), connector=connector)
    connector.close()
    store.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_a_prefix_from_host_then_from_disk_gives_the_cold_tokens(v32, tmp_path):
    """The device-pool path of StoreConnector (loads: pinned rows, non-blocking copies on a
    stream of their own, a sync per layer; saves: a gather and an asynchronous copy to pinned
    memory on a copy stream) and of the store's whole-block reads for disk hits, on a real GPU."""
    model = DeepseekForCausalLM.from_pretrained(v32.directory, dtype=torch.float32, device="cuda")
    prompt = prompt_ids(45, seed=31)
    cold = Engine(model, PagePool(model.config, 32, page_size=P, device="cuda")).generate([prompt], NEW)
    namespace = namespace_for(model.config, "deepseek", P)

    def engine(store) -> tuple[Engine, StoreConnector]:
        connector = StoreConnector(store, namespace)
        return Engine(model, PagePool(model.config, 32, page_size=P, device="cuda"), connector=connector), connector

    store = open_store(tmp_path)
    producer, connector = engine(store)
    producer.run([Request(prompt, NEW)])
    connector.flush()
    [out] = engine(store)[0].run([Request(prompt, NEW)])
    assert (out.stats.connector_hit_tokens, out.stats.computed_prompt_tokens) == (40, 5)
    assert [list(out.output_ids)] == cold and store.stats().tier("host").loaded_blocks >= 5
    store.flush()
    store.close()

    store = open_store(tmp_path)  # host tier empty: the prefix comes from disk
    [out] = engine(store)[0].run([Request(prompt, NEW)])
    assert out.stats.connector_hit_tokens == 40 and [list(out.output_ids)] == cold
    assert store.stats().tier("disk").loaded_blocks >= 5
    store.close()


def test_a_finished_request_does_not_wait_for_its_saves_to_reach_the_store(v3, tmp_path):
    """The engine releases a request's pages once its saves are copied out of them, not once the
    store has written them: a slow store must not stall the engine's loop."""
    model = v3.ours
    store = open_store(tmp_path)
    producer, _, connector = engine_over(model, store)
    release, written = threading.Event(), threading.Event()
    real_put = store.put

    def slow_put(*args, **kwargs):
        release.wait(10)  # the test lets it go only after the engine has returned
        result = real_put(*args, **kwargs)
        written.set()
        return result

    store.put = slow_put
    try:
        [out] = producer.run([Request(prompt_ids(45, seed=33), NEW)])
        assert not written.is_set(), "the engine waited for the store to write its saves"
        assert len(out.output_ids) == NEW
    finally:
        release.set()
    connector.flush()  # what a caller that needs the blocks stored waits for
    assert written.is_set() and store.stats().stored_blocks >= 5
    store.close()


def test_a_connector_over_another_namespace_of_the_same_layout_is_warned_of(v3, tmp_path, caplog):
    """Its hits stay right, but its blocks are filed under the other model (or tenant, or weights):
    deleted, counted and shown under it. Before, nothing said so."""
    model = v3.ours
    store = open_store(tmp_path)
    pool = PagePool(model.config, 32, page_size=P)
    with caplog.at_level("WARNING", logger="engine_adapter.block_manager"):
        engine = Engine(model, pool)
        same = StoreConnector(store, engine.namespace)
        Engine(model, PagePool(model.config, 32, page_size=P), connector=same)
        assert not caplog.records
        other = StoreConnector(store, namespace_for(model.config, "another-model", P))
        Engine(model, PagePool(model.config, 32, page_size=P), connector=other)
    [record] = caplog.records
    assert f"this engine's is {engine.namespace.id.hex()}" in record.getMessage()
    for connector in (same, other):
        connector.close()
    store.close()
