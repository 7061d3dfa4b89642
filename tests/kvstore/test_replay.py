"""Trace replay through the real store: exact hit counts, tier splits, determinism, the CLI."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from kvstore.errors import InvalidRequest
from kvstore.policies import DEFAULT_POLICY
from kvstore.replay import TierSplit, default_capacities, replay, sweep, tier_slots
from kvstore.replay_report import format_summary, format_sizing, format_sweep
from kvstore.trace import TraceRequest, write_trace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
B = 512


def req(*ids, tokens=None):
    return TraceRequest(0.0, tokens if tokens is not None else B * len(ids), 0, tuple(ids))


def test_a_repeated_prompt_hits_everything_but_the_first_time():
    trace = [req(1, 2, 3), req(1, 2, 3, tokens=3 * B - 100)]
    result = replay(trace, capacity_tokens=10 * B)
    assert result.hit_tokens == 2 * B + (B - 100)  # the partial last block counts its real tokens
    assert result.max_hit_tokens == result.hit_tokens and result.fraction_of_max == 1.0


def test_lru_evicts_the_coldest_chain_tail_first():
    # capacity 3 slots: chain A (2 blocks), then B (2 blocks) evicts A's tail, not A's head
    trace = [req(1, 2), req(10, 11), req(1, 2)]
    result = replay(trace, capacity_tokens=3 * B, policy="lru", with_optimal=True)
    assert result.hit_tokens == B  # block 1 survived, block 2 was the victim
    assert result.optimal_hit_tokens == 2 * B  # Belady keeps chain A whole by bypassing B's tail


def test_tier_split_reports_hits_per_tier_and_splits_capacity():
    trace = [req(1, 2, 3, 4), req(5, 6, 7, 8), req(1, 2, 3, 4)]
    result = replay(trace, capacity_tokens=8 * B, tiers=TierSplit.parse("host=0.5,disk=0.5"))
    assert result.tier_capacity_tokens == {"host": 4 * B, "disk": 4 * B}
    assert sum(result.tier_hit_tokens.values()) == result.hit_tokens == 4 * B
    assert result.tier_hit_tokens["disk"] > 0, "the first chain was demoted to disk and hit there"


@pytest.mark.parametrize("write_policy", ["on_eviction", "write_through"])
def test_a_prompt_longer_than_two_tiers_keeps_its_head_as_one_tier_does(write_policy):
    """300 blocks sent 4 times into 195 slots split 1:3: the optimum keeps the head (585 block
    hits, as one tier of the same size). Before, the tiers broke the chain between them: LRU hit
    114 (on_eviction) and 0 (write_through)."""
    trace = [req(*range(300))] * 4
    result = replay(trace, capacity_tokens=100_000, policy="lru", tiers=TierSplit.parse("host=0.25,disk=0.75"),
                    write_policy=write_policy)
    assert result.hit_tokens == result.optimal_hit_tokens == 585 * B


def test_replay_is_deterministic_and_never_beats_belady():

    rng = random.Random(7)
    trace = [req(*[c * 1000 + d for d in range(rng.randint(1, 6))]) for c in (rng.randint(0, 30) for _ in range(400))]
    first, second = replay(trace, 20 * B), replay(trace, 20 * B)
    assert first.hit_tokens == second.hit_tokens
    assert first.hit_tokens <= first.optimal_hit_tokens <= first.max_hit_tokens


def test_sweep_computes_every_capacity_and_policy():
    trace = [req(1, 2), req(3, 4), req(1, 2), req(1, 2, 5)]
    results = sweep(trace, [B, 2 * B, 8 * B], ["lru"])
    assert [r.capacity_tokens for r in results] == [B, 2 * B, 8 * B]
    assert all(r.optimal_hit_tokens is not None for r in results)
    assert [r.hit_tokens for r in results] == sorted(r.hit_tokens for r in results)  # monotone here
    assert "belady" in format_sweep(results) and "lru" in format_summary(results[0], "t")


def test_long_policy_names_stay_apart_in_both_tables():
    """Before, the sizing table's 12-character columns ran names together: 'lruhit_density_pooled'."""
    trace = [req(1, 2), req(3, 4), req(1, 2), req(1, 2, 5)]
    results = sweep(trace, [B, 8 * B], ["lru", "hit_density_pooled", "hit_density"])
    for table in format_sweep(results).split("\n\n"):
        header = table.splitlines()[1].split()
        assert header[-4:] == ["lru", "hit_density_pooled", "hit_density", "belady"], header


def test_a_sweep_in_worker_processes_gives_what_one_process_gives():
    rng = random.Random(3)
    trace = [req(*[c * 1000 + d for d in range(rng.randint(1, 6))]) for c in (rng.randint(0, 40) for _ in range(500))]
    capacities, policies = [4 * B, 12 * B, 30 * B], ["lru", "adaptive"]
    moved = []
    alone = sweep(trace, capacities, policies)
    together = sweep(trace, capacities, policies, jobs=2, progress=moved.append)
    without_time = lambda r: {**r.as_dict(), "elapsed_s": None}  # noqa: E731
    assert [without_time(r) for r in together] == [without_time(r) for r in alone]
    assert [(r.capacity_tokens, r.policy) for r in together] == [(c, p) for c in capacities for p in policies]
    assert len({r.hit_tokens for r in together}) > 1 and sum(moved) == len(trace) * 6


def test_a_replay_failing_in_a_worker_fails_the_sweep():
    with pytest.raises(InvalidRequest, match="unknown eviction policy 'nope'"):
        sweep([req(1), req(1)], [4 * B], ["lru", "nope"], jobs=2)
    with pytest.raises(InvalidRequest, match="jobs must be at least 1"):
        sweep([req(1)], [4 * B], ["lru"], jobs=0)


def test_default_capacities_span_the_footprint():
    trace = [req(*range(i * 10, i * 10 + 10)) for i in range(10)]  # 100 distinct blocks
    caps = default_capacities(trace)
    assert caps[0] == 5 * B and caps[-1] == 100 * B


@pytest.mark.parametrize("tiers, smallest", [("host=0.25,disk=0.75", 4), ("host=0.1,disk=0.9", 10),
                                             ("host=0.3,disk=0.7", 4)])
def test_default_capacities_give_every_tier_a_block(tiers, smallest):
    """A small trace's 5% is below one block per tier: before, the default sweep was refused whole."""
    trace = [req(*range(i * 4, i * 4 + 4)) for i in range(10)]  # 40 distinct blocks: 5% is 2 blocks
    split = TierSplit.parse(tiers)
    caps = default_capacities(trace, tiers=split)
    assert caps[0] == smallest * B and caps[-1] == 40 * B
    assert all(min(tier_slots(c, split, B).values()) >= 1 for c in caps)
    with pytest.raises(InvalidRequest):
        tier_slots((smallest - 1) * B, split, B)  # the smallest is the least that splits


@pytest.mark.parametrize("text", ["host=0.5", "host=0.5,host=0.5", "host=x", "host=1.5,disk=-0.5"])
def test_bad_tier_splits_are_refused(text):
    with pytest.raises(InvalidRequest):
        TierSplit.parse(text)


@pytest.mark.parametrize("blocks, tiers, expected", [
    (90, "host=0.3,disk=0.7", {"host": 27, "disk": 63}),  # 46080 x 0.7 is 32255.99... in floats: 62 before
    (100, "host=0.29,disk=0.71", {"host": 29, "disk": 71}),
    (3, "host=0.5,disk=0.5", {"host": 1, "disk": 2}),  # the block rounding leaves over goes to the last tier
    (5859, "host=0.25,disk=0.75", {"host": 1464, "disk": 4395}),  # 3M tokens, as one tier's 5859
    (7, "host=0.2,disk=0.3,ssd=0.5", {"host": 1, "disk": 2, "ssd": 4}),
])
def test_a_split_capacity_holds_as_many_blocks_as_one_tier(blocks, tiers, expected):
    for extra_tokens in (0, B - 1):  # a part block of capacity holds nothing
        slots = tier_slots(blocks * B + extra_tokens, TierSplit.parse(tiers), B)
        assert slots == expected and sum(slots.values()) == blocks


def test_capacity_below_one_block_per_tier_is_refused():
    with pytest.raises(InvalidRequest, match="below one"):
        replay([req(1)], capacity_tokens=B // 2)
    with pytest.raises(InvalidRequest, match="the host tier's share of 2200 tokens is below one"):
        replay([req(1)], capacity_tokens=2200, tiers=TierSplit.parse("host=0.01,disk=0.99"))  # would hold 5 blocks


def _kvstore(*args):
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True, env=env, timeout=120)


def test_cli_replay_json_has_the_documented_keys(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [req(1, 2, 3), req(1, 2, 4), req(1, 2, 3)])
    done = _kvstore("replay", str(path), "--capacity-tokens", "2k", "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    for key in ("hit_rate", "max_hit_rate", "fraction_of_max", "optimal_hit_rate", "policy", "capacity_tokens"):
        assert key in out
    assert out["capacity_tokens"] == 2000 and out["policy"] == DEFAULT_POLICY and 0 < out["hit_rate"] <= out["max_hit_rate"]


def test_cli_sweep_writes_a_png(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [req(1, 2, 3), req(1, 2, 4), req(1, 2, 3), req(7, 8)])
    plot = tmp_path / "curve.png"
    done = _kvstore("replay", str(path), "--sweep", "--capacities", "1k,2k,4k", "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "belady" in done.stdout


def test_cli_replay_without_capacity_says_what_to_do(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [req(1)])
    done = _kvstore("replay", str(path))
    assert done.returncode == 2 and "--capacity-tokens" in done.stderr


def test_lru_split_over_two_tiers_hits_as_much_as_one_tier_of_the_same_size():
    """Exclusive caching: with victims demoted (on_eviction) and promoted copies dropped first
    when the disk needs room, host + disk behave as one LRU cache of their summed size."""
    import random

    rng = random.Random(11)
    docs = [rng.randint(2, 8) for _ in range(60)]
    trace = []
    for i in range(1500):
        doc = min(int(rng.expovariate(1 / 12)), len(docs) - 1)  # a few hot documents, a long tail
        trace.append(req(*[doc * 100 + d for d in range(docs[doc])], 10_000 + i))  # + a one-off question
    single = replay(trace, 60 * B, "lru", with_optimal=False)
    split = replay(trace, 60 * B, "lru", TierSplit.parse("host=0.25,disk=0.75"), with_optimal=False)
    assert split.tier_hit_tokens["disk"] > 0 and split.tier_hit_tokens["host"] > 0
    assert split.hit_tokens >= 0.98 * single.hit_tokens, (split.hit_tokens, single.hit_tokens)


def test_an_unhashed_tail_counts_as_input_and_is_never_hit():
    """1500 tokens over 2 ids: the 476 tokens past block 2 have no id. Before, a repeat hit 1500
    tokens (the last block counted 988); now 1024, and the maximum and the bound agree."""
    result = replay([req(1, 2, tokens=1500)] * 2, capacity_tokens=10 * B)
    assert (result.input_tokens, result.hit_tokens, result.max_hit_tokens, result.optimal_hit_tokens) == (
        3000, 2 * B, 2 * B, 2 * B)


def test_with_no_reuse_every_policy_reaches_all_of_the_maximum():
    """The maximum is 0; before, fraction_of_max was 0.0 and the sizing said 'not reached'."""
    results = sweep([req(1, 2), req(3, 4)], [B, 8 * B], ["lru"])
    assert all(r.max_hit_tokens == 0 and r.fraction_of_max == r.optimal_fraction_of_max == 1.0 for r in results)
    assert "not reached" not in format_sizing(results) and "(100.00% of max)" in format_summary(results[0], "t")


@pytest.mark.parametrize("capacities, tiers, message", [
    ([4 * B, B // 2], "host", "capacity of 256 tokens is below one 512-token block per tier"),
    ([64 * B, 4 * B], "host=0.9,disk=0.1", "the disk tier's share of 2048 tokens is below one 512-token block"),
    ([4 * B, 10**400], "host", "capacity of 1.00e.400 tokens is above 10..18"),
])
def test_a_sweep_checks_every_capacity_before_the_first_replay(monkeypatch, capacities, tiers, message):
    """Before, the bad capacity failed only when its replay came up, losing the finished ones."""
    import kvstore.replay

    monkeypatch.setattr(kvstore.replay, "replay", lambda *a, **kw: pytest.fail("a replay ran"))
    with pytest.raises(InvalidRequest, match=message):
        sweep([req(1)], capacities, ["lru"], tiers=TierSplit.parse(tiers))


def test_a_sweep_replays_a_repeated_capacity_or_policy_once():
    results = sweep([req(1, 2), req(1, 2)], [2 * B, 2 * B, 4 * B], ["lru", "lru"])
    assert [(r.capacity_tokens, r.policy) for r in results] == [(2 * B, "lru"), (4 * B, "lru")]


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_sweep_without_the_optimum_shows_no_belady(jobs):
    """Before, sweep had no with_optimal: Belady was always computed (--no-optimal was ignored)."""
    results = sweep([req(1, 2), req(1, 2), req(3)], [B, 4 * B], ["lru", "adaptive"], jobs=jobs, with_optimal=False)
    assert len(results) == 4 and all(r.optimal_hit_tokens is None for r in results)
    assert "belady" not in format_sweep(results) and results[-1].hit_tokens == 2 * B


@pytest.mark.parametrize("text, message", [
    ("host=nan,disk=0.5", "tier shares must be positive and sum to 1"),
    ("host,disk", "tiers 'host,disk': give each tier its share of the capacity, e.g. host=0.25,disk=0.75"),
])
def test_tier_shares_that_are_not_numbers_or_missing_are_refused_with_a_hint(text, message):
    """Before: NaN raised ValueError from int(); 'host,disk' got no hint of the form."""
    with pytest.raises(InvalidRequest, match=message):
        TierSplit.parse(text)


def test_a_capacity_no_float_can_split_is_refused():
    """Before: OverflowError from capacity x share."""
    with pytest.raises(InvalidRequest, match=r"a capacity of 1.00e\+400 tokens is above 10\*\*18"):
        replay([req(1)], capacity_tokens=10**400)


def test_the_summary_with_a_model_reads_tokens_then_bytes():
    result = replay([req(1), req(1)], 4000, tiers=TierSplit.parse("host=0.5,disk=0.5"))
    assert ("capacity 4.0k tokens (183.4 MiB of deepseek-v3.2 KV; host 1.5k tokens, 70.4 MiB; disk 2.0k tokens, "
            "93.9 MiB), write policy on_eviction") in format_summary(result, "t", "deepseek-v3.2")
    assert "capacity 4.0k tokens (host 1.5k, disk 2.0k), write policy" in format_summary(result, "t")


def _main(capsys, *args):
    from kvstore.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_replays_an_unordered_trace_in_timestamp_order_and_says_so(capsys, tmp_path):
    """Before, file order, silently: the shuffled trace hit less than the ordered one."""
    rng = random.Random(5)
    requests = [TraceRequest(float(i), B * 3, 0, (c * 10, c * 10 + 1, c * 10 + 2))
                for i, c in enumerate(rng.choices(range(8), k=200))]
    ordered, shuffled = tmp_path / "ordered.jsonl", tmp_path / "shuffled.jsonl"
    write_trace(str(ordered), requests)
    write_trace(str(shuffled), rng.sample(requests, len(requests)))
    answers = [_main(capsys, "replay", str(path), "--capacity-tokens", "6k", "--policy", "lru", "--json")
               for path in (ordered, shuffled)]
    (code, out, err), (code2, out2, err2) = answers
    assert (code, code2, err) == (0, 0, "")
    moved = json.loads(out2)["reordered_requests"]
    assert 0 < moved < 200 and err2 == f"kvstore replay: {moved} requests were out of timestamp order; replayed " \
        "in timestamp order\n"
    assert json.loads(out)["reordered_requests"] == 0
    assert json.loads(out2)["hit_tokens"] == json.loads(out)["hit_tokens"]


def test_cli_counts_unhashed_tails_once(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_length": 1500, "hash_ids": [1, 2]}\n' * 3)
    code, out, err = _main(capsys, "replay", str(path), "--capacity-tokens", "2k", "--json")
    assert code == 0 and json.loads(out)["unhashed_tail_requests"] == 3 and json.loads(out)["hit_tokens"] == 4 * B
    assert err.count("\n") == 1 and "3 requests have an unhashed tail (input_length beyond hash ids x 512" in err


def test_cli_sweep_honours_no_optimal(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [req(1, 2), req(1, 2)])
    code, out, err = _main(capsys, "replay", str(path), "--sweep", "--capacities", "2k,2k", "--policies", "lru",
                           "--no-optimal", "--json")
    assert code == 0, err
    assert [(r["capacity_tokens"], r["optimal_hit_tokens"]) for r in json.loads(out)] == [(2000, None)]


@pytest.mark.parametrize("args, message", [
    (("--capacity-tokens", "2k"), "not UTF-8 text (byte 0xe9"),
    ((), "give --capacity-tokens N (e.g. 3M), or --sweep"),
    (("--sweep", "--capacities", "1M,500"), "capacity of 500 tokens is below one 512-token block per tier"),
    (("--capacity-tokens", "1e400"), "a capacity of 1.00e+400 tokens is above 10**18"),
    (("--capacity-tokens", "2k", "--tiers", "host=nan,disk=0.5"), "tier shares must be positive"),
    (("--sweep", "--plot", "curve"), "cannot plot to curve: give the file an extension naming its format"),
    (("--sweep", "--plot", ""), "--plot needs a file name, such as curve.png"),
    (("--capacity-tokens=1e999999999",), "'1e999999999' is more tokens than any cache holds"),  # decimal.Overflow
    (("--sweep", "--capacities", "1e999999999GiB", "--model", "deepseek-v3"), "more tokens than any cache holds"),
    (("--sweep", "--policy", "lru"), "--policy is for one replay; with --sweep give --policies"),  # was ignored
    (("--capacity-tokens", "1e30GiB", "--model", "deepseek-v3"), "tokens is above 10**18"),  # Decimal's traceback
    (("--capacity-tokens", "100000000000000000000000TiB", "--model", "kimi-k2"), "tokens is above 10**18"),
    (("--capacity-tokens", "600M", "--tiers", "host=1,disk=0.0000009"),  # the disk got 0 blocks, refused late
     "tier shares {'host': 1.0, 'disk': 9e-07} add up to more than 1: the disk tier would get 0 of"),
    (("--sweep", "--plot", "dangling.png"), "cannot plot to dangling.png: the directory"),  # failed after the sweep
])
def test_cli_refuses_bad_input_in_one_line_exit_2(capsys, tmp_path, monkeypatch, args, message):
    """Each was a traceback, a late refusal or a misleading one before. The trace has a non-UTF-8
    byte on line 2: refusals about flags come before it is read."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dangling.png").symlink_to(tmp_path / "missing" / "x.png")
    path = tmp_path / "t.jsonl"
    path.write_bytes(b'{"input_length": 5, "hash_ids": [9]}\n{"input_length": 5, "hash_ids": [9], "x": "\xe9"}\n')
    code, out, err = _main(capsys, "replay", str(path), *args)
    assert (code, out) == (2, "") and err.startswith("kvstore replay: ") and err.count("\n") == 1
    assert message in err


@pytest.mark.skipif(bool(shutil.which("xelatex")), reason="a LaTeX that pgf runs is installed")
def test_a_plot_format_matplotlib_cannot_write_here_is_refused_before_the_sweep(capsys, tmp_path):
    """pgf was accepted, and failed for want of xelatex after the whole sweep had run."""
    path = tmp_path / "t.jsonl"
    write_trace(str(path), [req(1, 2), req(1, 2)])
    code, out, err = _main(capsys, "replay", str(path), "--sweep", "--plot", str(tmp_path / "curve.pgf"))
    assert code == 2 and "unknown format 'pgf'" in err
