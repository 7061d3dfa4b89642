"""How long a lookup takes while another thread fills the tiers, against the same lookup on an
idle store in the same run.

A host tier of ``--host-blocks`` and a disk tier of ``--disk-blocks`` DeepSeek-V3.2 blocks (61
layers x 64 tokens, 2.93 MiB each) in a temporary directory, both full before timing starts. A
writer thread then puts new 4-block chains as fast as it can, so every put evicts: from the host
(demoting to the disk under ``on_eviction``; copying down in the background under
``write_through``) and from the disk (punching holes, deleting segments). The main thread looks
up a 32-block prompt (leased, so it stays in the host tier) every millisecond and times each lookup, and how long it waited
for the store's lock. The same loop on the same store with the writer stopped is the idle
reference. Each write policy runs ``--repeats`` times, idle and loaded in turn; percentiles are
medians over the repeats.

    .venv/bin/python benchmarks/lookup_under_load.py [--json] [--seconds 6] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from kvstore.bench import _namespace, _payloads
from kvstore.keys import namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.store import WRITE_POLICIES, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import HostTier

PROMPT_BLOCKS = 32
CHAIN_BLOCKS = 4
PERCENTILES = (50, 99, 99.9)


def percentiles(samples_s: list[float]) -> dict[str, float]:
    """``{"p50_ms": ..., "p99_ms": ..., "p99.9_ms": ..., "max_ms": ...}`` of ``samples_s``."""
    ordered = sorted(samples_s)
    out = {f"p{p:g}_ms": ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * 1e3 for p in PERCENTILES}
    out["max_ms"] = ordered[-1] * 1e3
    return out


class TimedLock:
    """The store's lock, timing how long the main thread waits to acquire it."""

    def __init__(self, lock):
        self._lock, self.waits = lock, []
        self._main = threading.main_thread()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        start = time.perf_counter()
        got = self._lock.acquire(blocking, timeout)
        if threading.current_thread() is self._main:
            self.waits.append(time.perf_counter() - start)
        return got

    def release(self) -> None:
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self._lock.release()


def _store(root: str, spec: BlockSpec, write_policy: str, host_blocks: int, disk_blocks: int) -> TieredStore:
    page = -(-spec.block_bytes // 4096) * 4096  # one block a page
    host = HostTier(host_blocks * page, page_bytes=page, shm_dir=root)
    disk = DiskTier(os.path.join(root, "disk"), disk_blocks * (spec.block_bytes + 8192), segment_bytes=64 << 20)
    return TieredStore([host, disk], policy="lru", write_policy=write_policy)


def _lookups(store, ns_id, prompt, seconds: float) -> list[float]:
    latencies = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.perf_counter()
        hit = store.lookup(ns_id, prompt)
        latencies.append(time.perf_counter() - start)
        assert hit.hit_blocks == len(prompt), "the timed prompt, leased, was evicted (store bug)"
        time.sleep(0.001)
    return latencies


def run_once(write_policy: str, seconds: float, host_blocks: int, disk_blocks: int) -> dict:
    """One idle and one loaded measurement on one store."""
    ns = _namespace()
    spec = BlockSpec.of(ns)
    root = tempfile.mkdtemp(prefix="kvstore-lookup-load-")
    store = _store(root, spec, write_policy, host_blocks, disk_blocks)
    try:
        ns_id = store.register_namespace(ns)
        payloads = _payloads(spec, CHAIN_BLOCKS)
        rng = np.random.default_rng(0)
        chain = lambda blocks: namespace_hashes(ns, rng.integers(0, 129280, blocks * spec.block_size))  # noqa: E731
        prompt = chain(PROMPT_BLOCKS)
        store.put(ns_id, prompt, _payloads(spec, PROMPT_BLOCKS))
        store.lookup(ns_id, prompt, lease_ttl_s=3600)  # the timed prompt stays resident
        for _ in range((host_blocks + disk_blocks) // CHAIN_BLOCKS + 1):  # fill both tiers
            store.put(ns_id, chain(CHAIN_BLOCKS), payloads)
        store.flush()
        timed = store._lock = TimedLock(store._lock)
        stop, puts = threading.Event(), [0]

        def writer():
            while not stop.is_set():
                store.put(ns_id, chain(CHAIN_BLOCKS), payloads)
                puts[0] += 1

        idle = _lookups(store, ns_id, prompt, seconds)
        idle_waits, timed.waits = timed.waits, []
        thread = threading.Thread(target=writer, name="bench-writer")
        thread.start()
        try:
            loaded = _lookups(store, ns_id, prompt, seconds)
        finally:
            stop.set()
            thread.join()
        return {"idle": percentiles(idle), "loaded": percentiles(loaded), "idle_lock_wait": percentiles(idle_waits),
                "loaded_lock_wait": percentiles(timed.waits), "lookups": len(loaded), "puts": puts[0],
                "evictions": sum(t.evictions for t in store.stats().tiers)}
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def _median_of(runs: list[dict], part: str) -> dict[str, float]:
    return {k: statistics.median(run[part][k] for run in runs) for k in runs[0][part]}


def run(seconds: float, repeats: int, host_blocks: int, disk_blocks: int, policies=WRITE_POLICIES) -> dict:
    result = {"seconds": seconds, "repeats": repeats, "host_blocks": host_blocks, "disk_blocks": disk_blocks,
              "block_bytes": BlockSpec.of(_namespace()).block_bytes, "write_policies": {}}
    for policy in policies:
        runs = [run_once(policy, seconds, host_blocks, disk_blocks) for _ in range(repeats)]
        summary = {part: _median_of(runs, part) for part in ("idle", "loaded", "idle_lock_wait", "loaded_lock_wait")}
        summary.update(puts=[r["puts"] for r in runs], evictions=[r["evictions"] for r in runs],
                       lookups=[r["lookups"] for r in runs],
                       p99_loaded_over_idle=summary["loaded"]["p99_ms"] / summary["idle"]["p99_ms"])
        result["write_policies"][policy] = summary
    return result


def format_table(result: dict) -> str:
    head = f"{'write policy':<14} {'store':<7} {'p50 ms':>8} {'p99 ms':>8} {'p99.9 ms':>9} {'max ms':>8} " \
           f"{'lock wait p99 ms':>17} {'puts/run':>9}"
    lines = [head, "-" * len(head)]
    for policy, s in result["write_policies"].items():
        for state in ("idle", "loaded"):
            lat, wait = s[state], s[f"{state}_lock_wait"]
            puts = statistics.median(s["puts"]) if state == "loaded" else 0
            lines.append(f"{policy:<14} {state:<7} {lat['p50_ms']:8.3f} {lat['p99_ms']:8.3f} {lat['p99.9_ms']:9.3f} "
                         f"{lat['max_ms']:8.2f} {wait['p99_ms']:17.3f} {puts:9.0f}")
        lines.append(f"{'':<14} p99 loaded / idle: {s['p99_loaded_over_idle']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="timed seconds per state and run (default 6)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per write policy; medians reported (default 3)")
    parser.add_argument("--host-blocks", type=int, default=48, help="host tier size in blocks (default 48)")
    parser.add_argument("--disk-blocks", type=int, default=96, help="disk tier size in blocks (default 96)")
    parser.add_argument("--write-policy", choices=WRITE_POLICIES, action="append",
                        help="measure only this write policy (repeatable; default both)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    if args.host_blocks < PROMPT_BLOCKS + CHAIN_BLOCKS or args.disk_blocks < CHAIN_BLOCKS or args.repeats < 1:
        parser.error(f"--host-blocks must be at least {PROMPT_BLOCKS + CHAIN_BLOCKS}, --disk-blocks at least "
                     f"{CHAIN_BLOCKS}, --repeats at least 1")
    result = run(args.seconds, args.repeats, args.host_blocks, args.disk_blocks,
                 tuple(args.write_policy or WRITE_POLICIES))
    print(json.dumps(result) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
