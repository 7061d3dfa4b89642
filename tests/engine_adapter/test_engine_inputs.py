"""The engine on what a caller may get wrong, and on what one request's failure may cost the others:
requests and pools are checked up front, a sampling failure ends only its own sequence, ``run``
hands back what others queued, and a request that fits its pool exactly is admitted."""

from __future__ import annotations

import dataclasses

import pytest

import engine_adapter.engine as engine_module
from engine_adapter.engine import Engine
from engine_adapter.paged_cache import PagePool
from engine_adapter.sequence import Request
from tests.engine_adapter.engine_helpers import prompt_ids
from tests.engine_adapter.test_engine import P, make_engine


@pytest.mark.parametrize("fields, message", [
    (dict(prompt_ids=(1.7, 2.9)), "prompt_ids must hold int token ids, got 1.7"),  # ran as (1, 2)
    (dict(prompt_ids=(1, True)), "prompt_ids must hold int token ids, got True"),
    (dict(prompt_ids="abc"), "prompt_ids must be a sequence of token ids"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an int >= 1, got 2.5"),  # gave 3 tokens
    (dict(max_new_tokens=None), r"max_new_tokens must be an int >= 1, got None"),  # a bare TypeError
    (dict(seed=2**64), r"seed must be an int in \[0, 2\*\*64\)"),  # an overflow in torch's generator
    (dict(seed=-1), r"seed must be an int in \[0, 2\*\*64\)"),
    (dict(stop_token_ids=5), "stop_token_ids must be a sequence of token ids, got 5"),  # a bare TypeError
    (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(request_id=7), "request_id must be a string, got 7"),
])
def test_a_request_of_the_wrong_kind_is_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Request(**{"prompt_ids": (1, 2, 3), **fields})


def test_numpy_and_python_ints_are_token_ids():
    np = pytest.importorskip("numpy")
    assert Request(np.arange(3), seed=np.int64(5)).prompt_ids == (0, 1, 2)


def test_a_tiny_temperature_samples_the_greedy_token(v3):
    """Dividing the logits by 1e-40 overflowed to inf and softmax gave NaN: sampling raised."""
    prompt = prompt_ids(12, seed=21)
    engine, _ = make_engine(v3.ours)
    [greedy] = engine.run([Request(prompt, 4)])
    [tiny] = engine.run([Request(prompt, 4, temperature=1e-40, seed=3)])
    assert tiny.error is None and tiny.output_ids == greedy.output_ids


def test_a_sampling_failure_ends_only_its_own_sequence_of_a_decode_batch(v3, monkeypatch):
    """Until session 34 the decode batch sampled in one go: one sequence's failure ended them all."""
    real_sample = engine_module.sample

    def sample(logits, temperature, generator):
        if temperature == 0.5:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real_sample(logits, temperature, generator)

    monkeypatch.setattr(engine_module, "sample", sample)
    engine, _ = make_engine(v3.ours)
    healthy = Request(prompt_ids(20, seed=5), 6, request_id="healthy")
    engine.add_request(healthy)
    outputs = engine.step()  # healthy prefills and samples its first token: it decodes from now on
    engine.add_request(Request((7,), 6, temperature=0.5, request_id="bad"))  # one token: it runs as a decode
    while engine.has_unfinished:
        outputs += engine.step()
    by_id = {out.request_id: out for out in outputs}
    assert by_id["bad"].error is not None and "probability tensor" in by_id["bad"].error
    assert by_id["healthy"].error is None and len(by_id["healthy"].output_ids) == 6
    assert list(by_id["healthy"].output_ids) == make_engine(v3.ours)[0].generate([healthy.prompt_ids], 6)[0]
    engine.check_integrity()


def test_run_keeps_the_outputs_of_requests_queued_before_it_for_the_next_step(v3):
    """Until session 34 run() stepped until every request finished and returned only its own:
    the others' outputs were taken from the scheduler and dropped."""
    engine, _ = make_engine(v3.ours)
    engine.add_request(Request(prompt_ids(10, seed=1), 3, request_id="queued"))
    [mine] = engine.run([Request(prompt_ids(10, seed=2), 6, request_id="mine")])
    assert mine.request_id == "mine" and len(mine.output_ids) == 6
    assert engine.has_unfinished, "the queued request's output is still to be handed back"
    later = []
    while engine.has_unfinished:
        later += engine.step()
    assert [out.request_id for out in later] == ["queued"] and len(later[0].output_ids) == 3


def test_a_request_that_needs_exactly_the_whole_pool_is_admitted_and_runs(v3):
    """25 prompt tokens and 8 new ones cache 32 positions (the last token sampled never is): 4
    pages of 8. Until session 34 the check counted 33 and refused it on a 4-page pool."""
    prompt = prompt_ids(25, seed=4)
    engine, _ = make_engine(v3.ours, num_pages=4)
    [out] = engine.run([Request(prompt, 8)])
    assert out.error is None and list(out.output_ids) == make_engine(v3.ours)[0].generate([prompt], 8)[0]
    with pytest.raises(ValueError, match="may reach 33 tokens = 5 pages; the pool has 4"):
        engine.add_request(Request(prompt, 9))


def test_a_pool_built_for_another_model_is_refused_without_a_connector_too(v3, v32):
    """Until session 34 only an engine with a connector checked: without one every request then
    failed (an IndexError, or a pool without the indexer's keys)."""
    config = v3.ours.config
    fewer_layers = dataclasses.replace(config, num_hidden_layers=2, first_k_dense_replace=1)
    for model, pool_config in ((v32.ours, config), (v3.ours, fewer_layers)):
        with pytest.raises(ValueError, match="build the pool from the model's own config"):
            Engine(model, PagePool(pool_config, 8, page_size=P))


def test_the_hits_are_the_first_admissions_after_a_preemption(v3):
    """Until session 34 a readmission overwrote device_hit_tokens with its own hit, generated tokens
    included: reused and computed no longer added up to anything."""
    prompts = [prompt_ids(14, seed=10), prompt_ids(15, seed=11)]
    engine, _ = make_engine(v3.ours, num_pages=5)
    outs = engine.run([Request(p, 12) for p in prompts])
    preempted = [out for out in outs if out.stats.preemptions]
    assert preempted
    for out in preempted:
        stats = out.stats
        assert stats.device_hit_tokens + stats.connector_hit_tokens <= stats.prompt_tokens
        assert stats.device_hit_tokens == 0, "nothing was cached at its first admission"
        assert stats.computed_prompt_tokens > stats.prompt_tokens, "its recomputation counts as computed"

