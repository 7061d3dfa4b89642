"""The engine's connector call path, against a dict-backed KVConnector (see engine_helpers).

Engine A computes a prompt and saves its blocks; engine B (a fresh pool, as after a restart or on
another process) gets them back through lookup -> start_load -> wait_layer per layer.
"""

from __future__ import annotations

import pytest

from engine_adapter.engine import Engine
from engine_adapter.paged_cache import PagePool
from engine_adapter.sequence import Request
from kvstore.keys import namespace_hashes
from tests.engine_adapter.engine_helpers import DictConnector, Recorder, block_layout, prompt_ids
from tests.engine_adapter.test_engine import NEW, P, assert_matches_cold


def engine_with(model, connector: DictConnector, num_pages: int = 32, **engine_options) -> tuple[Engine, Recorder]:
    recorder = Recorder(model)
    return Engine(recorder, PagePool(model.config, num_pages, page_size=P), connector=connector,
                  **engine_options), recorder


@pytest.mark.parametrize("pair_name", ["v3", "v32"])
def test_saved_blocks_come_back_through_the_connector(pair_name, request):
    model = request.getfixturevalue(pair_name).ours
    connector = DictConnector(block_layout(model, P))
    prompt = prompt_ids(45, seed=20)  # 5 full blocks in the prompt; V3.2: a 40-token hit > index_topk
    producer, _ = engine_with(model, connector)
    producer.run([Request(prompt, NEW)])
    hashes = namespace_hashes(producer.namespace, prompt)
    assert set(hashes) <= set(connector.blocks) and connector.parents[hashes[3]] == hashes[2]
    assert connector.flushes == 1  # before the finished request's pages became reusable
    page = producer.pool.match_prefix(hashes[:1])[0]
    assert (connector.blocks[hashes[0]][: producer.pool.layer_bytes] == producer.pool.layer_page_bytes(0, page)).all()

    consumer, recorder = engine_with(model, connector)
    [out] = consumer.run([Request(prompt, NEW)])
    assert connector.lookups[-1] == hashes[:5]  # (45 - 1) // 8 = 5 reusable blocks, no device hit
    assert out.stats.connector_hit_tokens == 40 and out.stats.device_hit_tokens == 0
    assert out.stats.computed_prompt_tokens == 5
    assert connector.waited == list(range(model.config.num_hidden_layers))  # every layer, in order, once
    assert_matches_cold(model, recorder, prompt, out.output_ids, computed_from=40)
    assert consumer.pool.match_prefix(hashes) != []  # loaded pages are registered on the device
    assert connector.leases == set()
    consumer.check_integrity()


def test_the_connector_is_asked_only_beyond_the_device_hit(v3):
    connector = DictConnector(block_layout(v3.ours, P))
    prompt = prompt_ids(41, seed=21)
    engine_with(v3.ours, connector)[0].run([Request(prompt, NEW)])
    engine, _ = engine_with(v3.ours, connector)
    hashes = namespace_hashes(engine.namespace, prompt)
    [short] = engine.run([Request(prompt[:17], NEW)])  # blocks 0, 1 from the connector
    assert short.stats.connector_hit_tokens == 16
    [full] = engine.run([Request(prompt, NEW)])
    assert connector.lookups[-1] == hashes[2:5]
    assert (full.stats.device_hit_tokens, full.stats.connector_hit_tokens) == (16, 24)
    assert full.stats.computed_prompt_tokens == 1
    engine.check_integrity()


def test_a_failed_load_is_recomputed(v3):
    connector = DictConnector(block_layout(v3.ours, P))
    prompt = prompt_ids(30, seed=22)
    engine_with(v3.ours, connector)[0].run([Request(prompt, NEW)])
    connector.fail_at_layers = {1}
    engine, recorder = engine_with(v3.ours, connector)
    [out] = engine.run([Request(prompt, NEW)])
    assert out.stats.load_failures == 1 and out.stats.connector_hit_tokens == 0
    assert out.stats.computed_prompt_tokens == 30 and connector.leases == set()
    assert_matches_cold(v3.ours, recorder, prompt, out.output_ids, computed_from=0)
    engine.check_integrity()


@pytest.mark.parametrize("chunk_size", [512, 2])
def test_a_load_that_fails_after_every_layer_arrived_is_recomputed(v3, chunk_size):
    """A connector may signal layers before it knows the load is valid (SidecarConnector when the
    slots' release comes back expired): the check after the forward (``wait``) must discard it."""
    connector = DictConnector(block_layout(v3.ours, P))
    prompt = prompt_ids(45, seed=20)
    engine_with(v3.ours, connector)[0].run([Request(prompt, NEW)])
    connector.fail_after_every_layer = True
    engine, recorder = engine_with(v3.ours, connector, chunk_size=chunk_size)
    [out] = engine.run([Request(prompt, NEW)])
    assert out.stats.load_failures == 1 and out.stats.connector_hit_tokens == 0
    assert out.stats.computed_prompt_tokens == 45
    assert_matches_cold(v3.ours, recorder, prompt, out.output_ids, computed_from=0)
    engine.check_integrity()


def test_evicted_pages_demote_to_the_connector_and_come_back(v3):
    """The engine wires pool.on_evict to the connector: the device tier demotes instead of
    dropping. (A test helper's demote took its arguments in another order than the API's; this
    test wired the hook itself, so the engine's own wiring went untested.)"""
    connector = DictConnector(block_layout(v3.ours, P))
    engine, _ = engine_with(v3.ours, connector, num_pages=6)
    first, other = prompt_ids(33, seed=23), prompt_ids(30, seed=24)
    engine.run([Request(first, NEW)])
    connector.blocks.clear()  # forget the saves: whatever comes back now was demoted on eviction
    engine.run([Request(other, NEW)])
    hashes = namespace_hashes(engine.namespace, first)
    assert set(hashes[1:4]) <= set(connector.blocks) and hashes[0] not in connector.blocks
    [again] = engine.run([Request(first, NEW)])
    assert (again.stats.device_hit_tokens, again.stats.connector_hit_tokens) == (8, 24)
    assert engine.pool.failed_demotions == 0
    engine.check_integrity()


class FailingAdmission(DictConnector):
    """A DictConnector whose ``lookup`` (or ``start_load``) raises for requests whose prompt
    begins with ``poisoned`` (a block hash), after taking its lease, as a broken connector might."""

    def __init__(self, layout, poisoned: bytes, at: str) -> None:
        super().__init__(layout)
        self.poisoned, self.at = poisoned, at

    def lookup(self, request_id, block_hashes):
        hit = super().lookup(request_id, block_hashes)
        if self.at == "lookup" and block_hashes[:1] == [self.poisoned]:
            raise RuntimeError("connector broke")
        return hit

    def start_load(self, hit, block_hashes, pages, pool):
        if self.at == "start_load" and block_hashes[:1] == [self.poisoned]:
            raise RuntimeError("connector broke")
        return super().start_load(hit, block_hashes, pages, pool)


@pytest.mark.parametrize("at", ["lookup", "start_load"])
def test_a_request_whose_admission_raises_is_ended_alone_and_holds_nothing(v3, at):
    """Before, the raising request stayed at the head of the queue: every later step raised again."""
    poisoned, healthy = prompt_ids(30, seed=25), prompt_ids(26, seed=26)
    saver = DictConnector(block_layout(v3.ours, P))
    engine_with(v3.ours, saver)[0].run([Request(poisoned, NEW)])  # so start_load has a hit to load
    connector = FailingAdmission(saver.layout, namespace_hashes(engine_with(v3.ours, saver)[0].namespace,
                                                                 poisoned)[0], at)
    connector.blocks = saver.blocks
    engine, recorder = engine_with(v3.ours, connector, num_pages=12)
    outs = engine.run([Request(poisoned, NEW), Request(healthy, NEW)])
    assert [out.error for out in outs] == ["RuntimeError: connector broke", None]
    assert outs[0].output_ids == ()
    assert_matches_cold(v3.ours, recorder, healthy, outs[1].output_ids, computed_from=0)
    assert connector.leases == set()
    engine.check_integrity()
    assert engine.pool.num_free + engine.pool.num_cached == engine.pool.num_pages, "no page held by the ended one"
    [again] = engine.run([Request(healthy, NEW)])  # the engine goes on
    assert again.error is None and again.output_ids == outs[1].output_ids
