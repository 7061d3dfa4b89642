"""Do the eviction policies hold up on workloads they were not designed on?

Issue 5 judges the policy on multi-turn chat and agent traces we do not have. This benchmark
draws workload variants from the two seeded generators of ``kvstore.synthetic_traces`` with
their shape parameters spread over wide ranges (number of system prompts or agent types,
turns per conversation, popularity skew, think times, fan-out, one-off documents), replays each
through the real store at several capacities for every policy, and reports each policy's share
of the infinite-capacity maximum next to Belady's bound from the same run.

Capacities are fractions of each variant's distinct footprint (``--fractions``); points where
Belady's bound already keeps more than 99% of the maximum are reported but left out of the
summary (every policy is near the maximum there). The summary gives, per policy, the median and
the worst ratio to LRU and to Belady's bound over the points, and how many points it loses to LRU
by more than half a point of the maximum; for a selector (``adaptive``) measured beside its
candidates, its regret: how far below the best of them it falls at each point (negative where
it is above them all), its mean and its worst. Prints tables, or one JSON object with ``--json``.

    .venv/bin/python benchmarks/policy_generalisation.py [--variants 6] [--seed 0] [--jobs 2]
        [--fractions 0.005,0.01,0.02,0.04] [--policies lru,adaptive] [--scale 1] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from kvstore.belady import infinite_hit_tokens, optimal_hit_tokens
from kvstore.policies import POLICIES
from kvstore.replay import replay
from kvstore.synthetic_traces import GENERATORS
from kvstore.trace import TraceRequest, parse_request

BLOCK = 512
LOSS_MARGIN = 0.005  # of the maximum: a loss to LRU smaller than this is noise of one capacity
SATURATED = 0.99  # Belady's share of the maximum above which a point says nothing about a policy


@dataclass(frozen=True)
class Variant:
    """One workload: a generator, its seed and the shape parameters drawn for it."""

    name: str
    generator: str
    seed: int
    params: tuple[tuple[str, float | int], ...]

    def describe(self) -> str:
        return " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.params)


def _log_uniform(rng: random.Random, lo: float, hi: float) -> float:
    return math.exp(rng.uniform(math.log(lo), math.log(hi)))


def _chat_params(rng: random.Random, scale: float) -> dict:
    return {"n_conversations": max(10, round(rng.randint(400, 2500) * scale)), "n_system_prompts": round(_log_uniform(rng, 1, 40)),
            "mean_turns": rng.uniform(1.5, 10.0), "zipf_s": rng.uniform(0.6, 1.5),
            "think_median_s": _log_uniform(rng, 5.0, 300.0)}


def _agent_params(rng: random.Random, scale: float) -> dict:
    return {"n_sessions": max(3, round(rng.randint(60, 220) * scale)), "n_agent_types": round(_log_uniform(rng, 1, 30)),
            "branch_prob": rng.uniform(0.0, 0.6), "doc_prob": rng.uniform(0.0, 0.2)}


_DRAWS = {"chat": _chat_params, "agent": _agent_params}


def variants(count: int, seed: int, scale: float = 1.0) -> list[Variant]:
    """``count`` chat and ``count`` agent variants, their parameters drawn from ``seed``, with
    ``scale`` times as many conversations or sessions (the same draws otherwise)."""
    rng = random.Random(seed)
    out = []
    for generator, draw in _DRAWS.items():
        for i in range(count):
            params = draw(rng, scale)
            out.append(Variant(f"{generator}-{i}", generator, rng.randrange(2**31), tuple(params.items())))
    return out


@functools.lru_cache(maxsize=2)
def _trace(variant: Variant) -> tuple[TraceRequest, ...]:
    raw = GENERATORS[variant.generator](variant.seed, **dict(variant.params))
    return tuple(parse_request(obj, BLOCK, f"{variant.name} request {i}") for i, obj in enumerate(raw))


def _footprint_blocks(trace: tuple[TraceRequest, ...]) -> int:
    return len({h for r in trace for h in r.hash_ids})


def _capacity(variant: Variant, fraction: float) -> int:
    return max(1, int(_footprint_blocks(_trace(variant)) * fraction)) * BLOCK


def _run(task: tuple[Variant, float, str]) -> tuple[str, float, str, int, float]:
    """One point: hit tokens of ``policy`` (or Belady's bound, policy ``"belady"``) and seconds."""
    variant, fraction, policy = task
    trace = _trace(variant)
    capacity = _capacity(variant, fraction)
    started = time.perf_counter()
    if policy == "belady":
        hits = optimal_hit_tokens(trace, capacity // BLOCK, BLOCK)
    else:
        hits = replay(trace, capacity, policy, with_optimal=False).hit_tokens
    return variant.name, fraction, policy, hits, time.perf_counter() - started


def _maxima(variant: Variant) -> tuple[str, int, int, int, int]:
    trace = _trace(variant)
    return (variant.name, len(trace), _footprint_blocks(trace), sum(r.input_length for r in trace),
            infinite_hit_tokens(trace, BLOCK))


def measure(chosen: list[Variant], fractions: list[float], policies: list[str], jobs: int) -> dict:
    """Every point of the grid; tasks grouped by variant so a worker builds each trace once."""
    tasks = [(v, f, p) for v in chosen for f in fractions for p in [*policies, "belady"]]
    done = 0
    started = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        facts = {name: rest for name, *rest in pool.map(_maxima, chosen, chunksize=1)}
        points: dict[tuple[str, float], dict[str, int]] = {}
        for name, fraction, policy, hits, _ in pool.imap_unordered(_run, tasks, chunksize=1):
            points.setdefault((name, fraction), {})[policy] = hits
            done += 1
            if sys.stderr.isatty():
                print(f"\r{done}/{len(tasks)} replays, {time.perf_counter() - started:.0f} s", end="", file=sys.stderr)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    rows = []
    for v in chosen:
        requests, footprint, input_tokens, maximum = facts[v.name]
        for f in fractions:
            hits = points[(v.name, f)]
            rows.append({"variant": v.name, "fraction": f, "capacity_tokens": _capacity(v, f),
                         "of_max": {p: h / maximum if maximum else 1.0 for p, h in hits.items()}})
    return {"variants": [dict(asdict(v), requests=facts[v.name][0], distinct_blocks=facts[v.name][1],
                              max_hit_rate=facts[v.name][3] / max(facts[v.name][2], 1)) for v in chosen],
            "points": rows, "seconds": time.perf_counter() - started}


def summarise(points: list[dict], policies: list[str]) -> dict:
    """Per policy over the unsaturated points: ratios to LRU and to Belady, losses to LRU."""
    live = [p["of_max"] for p in points if p["of_max"]["belady"] <= SATURATED]
    out = {"points": len(live), "saturated_points": len(points) - len(live)}
    for policy in policies:
        to_lru = [m[policy] / m["lru"] for m in live if "lru" in m and m["lru"] > 0]
        to_opt = [m[policy] / m["belady"] for m in live if m["belady"] > 0]
        losses = [m["lru"] - m[policy] for m in live if "lru" in m and m["lru"] - m[policy] > LOSS_MARGIN]
        out[policy] = {"median_to_lru": statistics.median(to_lru) if to_lru else None,
                       "worst_to_lru": min(to_lru) if to_lru else None,
                       "median_to_belady": statistics.median(to_opt) if to_opt else None,
                       "worst_to_belady": min(to_opt) if to_opt else None,
                       "mean_of_max": statistics.fmean(m[policy] for m in live) if live else None,
                       "losses_to_lru": len(losses), "worst_loss_to_lru": max(losses, default=0.0)}
        candidates = [c.name for c in getattr(POLICIES[policy], "candidates", ())]
        if candidates and all(c in policies for c in candidates):
            regrets = [max(m[c] for c in candidates) - m[policy] for m in live]  # < 0: above them all
            out[policy].update(candidates=candidates, mean_regret=statistics.fmean(regrets) if regrets else None,
                               worst_regret=max(regrets, default=None))
    return out


def _print(result: dict, policies: list[str]) -> None:
    for v in result["variants"]:
        params = Variant(v["name"], v["generator"], v["seed"], tuple(map(tuple, v["params"]))).describe()
        print(f"{v['name']:>9}: {v['requests']} requests, {v['distinct_blocks']} blocks, "
              f"max hit rate {v['max_hit_rate']:.1%}; {params}")
    cols = [*policies, "belady"]
    print(f"\n{'variant':>9} {'of footprint':>12} " + " ".join(f"{c:>18}" for c in cols) + "   (share of the maximum)")
    for p in result["points"]:
        mark = "" if p["of_max"]["belady"] <= SATURATED else "   saturated"
        print(f"{p['variant']:>9} {p['fraction']:>12.2%} " + " ".join(f"{p['of_max'][c]:>18.1%}" for c in cols) + mark)
    s = result["summary"]
    if not s["points"]:
        print(f"\nevery point is saturated (Belady keeps over {SATURATED:.0%} of the maximum): give smaller --fractions")
        return
    print(f"\nover {s['points']} points where Belady keeps at most {SATURATED:.0%} of the maximum "
          f"({s['saturated_points']} saturated points left out):")
    print(f"{'policy':>18} {'mean of max':>11} {'x LRU median':>12} {'x LRU worst':>11} "
          f"{'of Belady median':>16} {'of Belady worst':>15} {'losses to LRU':>13}")
    for policy in policies:
        row = s[policy]
        print(f"{policy:>18} {row['mean_of_max']:>11.1%} {row['median_to_lru']:>12.3f} {row['worst_to_lru']:>11.3f} "
              f"{row['median_to_belady']:>16.1%} {row['worst_to_belady']:>15.1%} "
              f"{row['losses_to_lru']:>5} (worst {row['worst_loss_to_lru']:.1%})")
    for policy in policies:
        row = s[policy]
        if row.get("mean_regret") is not None:
            print(f"{policy} below the best of its candidates ({', '.join(row['candidates'])}) at each point: "
                  f"mean {row['mean_regret']:.2%}, worst {row['worst_regret']:.1%} of the maximum")
    print(f"\n{result['seconds']:.0f} s on {result['jobs']} worker processes")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", type=int, default=6, help="variants per generator (default 6)")
    parser.add_argument("--seed", type=int, default=0, help="draws the variants' parameters and seeds")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="conversations or sessions per variant, times this (default 1; smaller is quicker)")
    parser.add_argument("--fractions", default="0.005,0.01,0.02,0.04",
                        help="capacities as fractions of each variant's distinct footprint")
    parser.add_argument("--policies", default=",".join(sorted(POLICIES)), help="comma-separated (default: all)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        parser.error(f"unknown policies {unknown}; valid: {', '.join(sorted(POLICIES))}")
    if "lru" not in policies:
        policies.insert(0, "lru")  # every ratio is to LRU
    try:
        fractions = sorted({float(f) for f in args.fractions.split(",")})
    except ValueError:
        parser.error(f"--fractions takes numbers like 0.005,0.01, got {args.fractions!r}")
    if not all(0 < f <= 1 for f in fractions):
        parser.error("--fractions must lie in (0, 1]")
    if args.variants < 1 or args.jobs < 1:
        parser.error("--variants and --jobs must be at least 1")
    if not 0 < args.scale <= 10:
        parser.error("--scale must lie in (0, 10]")
    result = measure(variants(args.variants, args.seed, args.scale), fractions, policies, args.jobs)
    result.update(summary=summarise(result["points"], policies), jobs=args.jobs, seed=args.seed, scale=args.scale)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print(result, policies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
