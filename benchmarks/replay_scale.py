"""How fast `kvstore replay` runs at scale: 12,000 requests over 180,000 distinct blocks.

The workload is built to those exact sizes with the structure of the Mooncake trace: shared
documents (Zipf-popular) re-read by several requests, each request adding a unique suffix.

    1,200 documents x 50 blocks  = 60,000 shared blocks
    12,000 requests x 10 blocks  = 120,000 unique suffix blocks   (180,000 distinct in all)

Each policy is replayed through the real store code (accounting tiers) at 10% of the distinct
footprint; Belady's bound is timed apart (it is computed outside the store). Prints a table,
or one JSON object with --json. Fixed seed, medians over --repeats runs.

    .venv/bin/python benchmarks/replay_scale.py [--json] [--repeats 3] [--policies lru,adaptive]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

from kvstore.belady import optimal_hit_tokens
from kvstore.policies import POLICIES
from kvstore.policies.hit_density import native_sampling
from kvstore.replay import replay
from kvstore.trace import TraceRequest

REQUESTS, DOCUMENTS, DOC_BLOCKS, SUFFIX_BLOCKS, BLOCK = 12_000, 1_200, 50, 10, 512


def scale_trace(seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    weights = [1 / (d + 1) ** 0.8 for d in range(DOCUMENTS)]
    next_id = DOCUMENTS * DOC_BLOCKS
    trace = []
    first_reads = list(range(DOCUMENTS))
    rng.shuffle(first_reads)  # every document is read at least once: exactly 180,000 distinct blocks
    for i in range(REQUESTS):
        doc = first_reads[i] if i < DOCUMENTS else rng.choices(range(DOCUMENTS), weights)[0]
        suffix = range(next_id, next_id + SUFFIX_BLOCKS)
        next_id += SUFFIX_BLOCKS
        ids = tuple(range(doc * DOC_BLOCKS, (doc + 1) * DOC_BLOCKS)) + tuple(suffix)
        trace.append(TraceRequest(float(i * 100), len(ids) * BLOCK - rng.randint(0, BLOCK - 1), 0, ids))
    return trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default=",".join(sorted(POLICIES)), help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:  # before any replay runs, not after the ones named first
        parser.error(f"--policies: unknown {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(POLICIES))}")
    trace = scale_trace()
    distinct = len({h for r in trace for h in r.hash_ids})
    capacity = distinct * BLOCK // 10
    rows = {}
    for policy in policies:
        runs = [replay(trace, capacity, policy, with_optimal=False) for _ in range(args.repeats)]
        rows[policy] = {"seconds": statistics.median(r.elapsed_s for r in runs),
                        "fraction_of_max": runs[0].fraction_of_max, "hit_rate": runs[0].hit_rate}
    start = time.perf_counter()
    optimal = optimal_hit_tokens(trace, capacity // BLOCK, BLOCK)
    belady_s = time.perf_counter() - start
    result = {"requests": len(trace), "distinct_blocks": distinct, "block_refs": sum(len(r.hash_ids) for r in trace),
              "capacity_tokens": capacity, "policies": rows, "belady_seconds": belady_s,
              "belady_hit_rate": optimal / sum(r.input_length for r in trace), "target_seconds": 60,
              "native_sampling": native_sampling()}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['requests']} requests, {distinct} distinct blocks, {result['block_refs']} block references, "
          f"capacity {capacity / 1e6:.1f}M tokens (10% of the footprint); HitDensity's sampling loop in "
          f"{'C' if result['native_sampling'] else 'Python (kvstore.policies._sampling not built)'}")
    print(f"{'policy':>18} {'replay time':>12} {'hit rate':>9} {'of max':>7}   target: < 60 s")
    for policy, row in rows.items():
        print(f"{policy:>18} {row['seconds']:>10.1f} s {row['hit_rate']:>8.1%} {row['fraction_of_max']:>7.1%}")
    print(f"{'belady':>18} {belady_s:>10.1f} s {result['belady_hit_rate']:>8.1%}   (offline bound, outside the store)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
