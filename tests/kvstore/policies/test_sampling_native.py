"""kvstore.policies._sampling, HitDensity's sampling loop in C: the same leaf, the same draws and
the same questions to ``eligible`` as the Python loop, on random inputs and through a replay."""

from __future__ import annotations

import random
from array import array
from types import SimpleNamespace

import pytest

from kvstore.policies import hit_density
from kvstore.policies.hit_density import HitDensityPolicy, native_sampling
from kvstore.replay import replay
from kvstore.synthetic_traces import multi_turn_chat
from kvstore.trace import TraceRequest

pytestmark = pytest.mark.skipif(not native_sampling(), reason="kvstore.policies._sampling is not built (needs gcc)")

SMALL = tuple(range(6)) + (6,) * 10  # the age bucket of ages below 16


def bucket_slow(age: int) -> int:
    return 7 + age % 3


def random_policy_state(rng: random.Random, n: int) -> dict:
    classes, buckets = 5, 10
    return dict(
        leaves=[rng.randbytes(32) for _ in range(n)],
        classes=array("H", (rng.randrange(classes) for _ in range(n))),
        lasts=array("q", (rng.randrange(0, 40) for _ in range(n))),  # ages from 0 to 40: both bucket paths
        densities=[[rng.choice((0.0, 0.5, rng.random())) for _ in range(buckets)] for _ in range(classes)],
        now=40,
    )


def python_loop(samples, random_, leaves, classes, lasts, densities, small, now, slow, eligible):
    """``HitDensityPolicy._sampled_python`` itself, over explicit arguments in place of a policy."""
    policy = SimpleNamespace(samples=samples, _leaves=leaves, _leaf_cls=classes, _leaf_last=lasts, _now=now,
                             _bucket_of_small_age=small, _bucket_slow=slow)
    scheme = SimpleNamespace(density_of_fine_class=densities, rng=SimpleNamespace(random=random_))
    return HitDensityPolicy._sampled_python(policy, scheme, eligible)


@pytest.mark.parametrize("seed", range(40))
def test_the_c_loop_picks_what_the_python_loop_picks(seed):
    rng = random.Random(seed)
    state = random_policy_state(rng, n=rng.choice((1, 3, 32, 200)))
    refused = set(rng.sample(state["leaves"], len(state["leaves"]) // 3))
    picks, asked = [], []
    for loop in (hit_density._sampling.least_dense, python_loop):
        draws, questions = random.Random(seed * 7), []

        def eligible(key, questions=questions):
            questions.append(key)
            return key not in refused

        picks.append(loop(32, draws.random, state["leaves"], state["classes"], state["lasts"], state["densities"],
                          SMALL, state["now"], bucket_slow, eligible))
        asked.append((questions, draws.random()))  # the same questions, and the stream left in the same place
    assert picks[0] == picks[1] and asked[0] == asked[1]
    assert picks[0] is None or picks[0] not in refused


def test_bad_arguments_are_refused_not_read_out_of_bounds():
    state = random_policy_state(random.Random(1), n=4)
    args = dict(state, small=SMALL)

    def call(**changes):
        a = {**args, **changes}
        return hit_density._sampling.least_dense(32, random.Random(0).random, a["leaves"], a["classes"], a["lasts"],
                                                 a["densities"], a["small"], a["now"], bucket_slow, lambda k: True)

    with pytest.raises(TypeError, match=r"array\('H'\)"):
        call(classes=array("I", state["classes"]))
    with pytest.raises(TypeError, match=r"array\('q'\)"):
        call(lasts=array("d", state["lasts"]))
    with pytest.raises(TypeError, match="bytes-like"):
        call(lasts=list(state["lasts"]))
    with pytest.raises(ValueError, match="an item per leaf"):
        call(lasts=array("q", [0]))
    with pytest.raises(IndexError, match="class index"):
        call(densities=state["densities"][:1], classes=array("H", [3] * 4))
    assert call(leaves=[], classes=array("H"), lasts=array("q")) is None


def test_a_replay_makes_the_same_decisions_with_either_loop(monkeypatch):
    trace = [TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"]))
             for r in multi_turn_chat(seed=4, n_conversations=300, duration_s=300.0)]
    native = {name: replay(trace, 30 * 512, name, with_optimal=False).hit_tokens for name in ("hit_density", "adaptive")}
    monkeypatch.setattr(hit_density, "_sampling", None)
    assert not native_sampling()
    python = {name: replay(trace, 30 * 512, name, with_optimal=False).hit_tokens for name in ("hit_density", "adaptive")}
    assert native == python and min(native.values()) > 0


def test_callbacks_that_change_the_leaf_set_get_an_error_or_a_resize_not_a_crash():
    """No buffer is held while Python code runs, and the leaf list is re-measured before it is
    read: a callback may resize the arrays, and one that empties the list gets an IndexError, as
    the Python loop would raise (the policy never does either; this is memory safety)."""
    densities = [[0.5] * 10 for _ in range(5)]

    def run(state, eligible, draws):
        return hit_density._sampling.least_dense(32, draws, state["leaves"], state["classes"], state["lasts"],
                                                 densities, SMALL, state["now"], bucket_slow, eligible)

    state = random_policy_state(random.Random(2), n=8)

    def grow(key):
        state["classes"].append(0), state["lasts"].append(0)  # a BufferError if a buffer were held
        return False

    assert run(state, grow, random.Random(0).random) is None and len(state["classes"]) > 8
    state = random_policy_state(random.Random(2), n=8)

    def clear(key):  # asked of the first sample, refuses it: the second is asked about next
        state["leaves"].clear()
        return False

    with pytest.raises(IndexError, match="leaf index 7"):
        run(state, clear, iter([0.0, 0.99] * 16).__next__)
    state = random_policy_state(random.Random(2), n=8)
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        run(state, lambda k: True, lambda: 1.0)


def test_a_density_whose_float_conversion_runs_python_may_resize_the_arrays():
    """A density that is not a float is converted by its own ``__float__``, Python code: no
    buffer is held then either, so it may grow the arrays (a BufferError if one were held)."""
    state = random_policy_state(random.Random(3), n=8)

    class Growing:
        def __float__(self):
            state["classes"].append(0), state["lasts"].append(0)
            return 0.5

    densities = [[Growing()] * 10 for _ in range(5)]
    best = hit_density._sampling.least_dense(32, random.Random(0).random, state["leaves"], state["classes"],
                                             state["lasts"], densities, SMALL, state["now"], bucket_slow,
                                             lambda k: True)
    assert best in state["leaves"] and len(state["classes"]) == 8 + 8  # one conversion per draw
