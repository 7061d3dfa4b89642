"""Batched decode: forward_decode over B caches gives each sequence's own decode, logits and cache."""

from __future__ import annotations

import pytest
import torch

from tests.engine_adapter.engine_helpers import prompt_ids
from tests.engine_adapter.hf_oracle import rel_err

LENGTHS = (5, 20, 37)  # V3.2: index_topk is 16, so two of the caches are past it
STEPS = 3


def prefilled(model, lengths):
    """A cache per length, each prefilled with its own prompt; the prompts' next tokens."""
    caches, next_ids = [], []
    for n in lengths:
        tokens = prompt_ids(n + 1, seed=n)
        cache = model.new_cache()
        model(torch.tensor(tokens[:n]), torch.arange(n), cache)
        caches.append(cache)
        next_ids.append(tokens[n])
    return caches, next_ids


@pytest.mark.parametrize("pair_name", ["v3", "v32"])
def test_forward_decode_equals_one_sequence_at_a_time(pair_name, request):
    model = request.getfixturevalue(pair_name).ours
    alone, token_ids = prefilled(model, LENGTHS)
    batched, _ = prefilled(model, LENGTHS)
    for step in range(STEPS):
        positions = [n + step for n in LENGTHS]
        expected = torch.cat([model(torch.tensor([t]), torch.tensor([p]), cache)
                              for t, p, cache in zip(token_ids, positions, alone)])  # [B, vocab]
        logits = model.forward_decode(torch.tensor(token_ids), torch.tensor(positions), batched)
        assert logits.shape == expected.shape and rel_err(logits, expected) < 1e-5
        token_ids = logits.argmax(-1).tolist()  # greedy: both runs continue with the same tokens
    for one, many in zip(alone, batched):
        assert one.length == many.length
        for layer in range(model.config.num_hidden_layers):
            for a, b in zip(one.read(layer), many.read(layer)):
                assert (a is None and b is None) or rel_err(b, a) < 1e-5


def test_forward_decode_rejects_mismatched_caches(v3):
    model = v3.ours
    cache = model.new_cache()
    with pytest.raises(ValueError, match="one distinct cache per token"):
        model.forward_decode(torch.tensor([1, 2]), torch.tensor([0, 0]), [cache])
    with pytest.raises(ValueError, match="one distinct cache per token"):
        model.forward_decode(torch.tensor([1, 2]), torch.tensor([0, 0]), [cache, cache])
    with pytest.raises(ValueError, match=r"\[T\]"):
        model.forward_decode(torch.tensor([1, 2]), torch.tensor([0]), [cache, model.new_cache()])
