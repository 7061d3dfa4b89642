"""``kvstore bench``: the store's bandwidths and lookup time, each next to its ceiling from the
same run, at real DeepSeek-V3.2 block sizes (61 layers x 64 tokens x (656 + 132) bytes).

Every figure is the median of ``repeats`` runs; each run measures the ceiling right before or
after the store (they take turns), so both see the same machine state; cold reads are sampled
``read_rounds`` times per run. Cold disk reads: the segment files are fdatasync'd
and their cached pages dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before the (default,
O_DIRECT, read-ahead) read; the same cold read with ``direct_io=False`` (buffered) is reported beside it.
The read ceiling uses O_DIRECT, which never touches the page cache.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvstore import ceilings
from kvstore.buffers import aligned_empty
from kvstore.keys import Namespace, namespace_hashes, native_hashing
from kvstore.layout import DEEPSEEK_NUM_LAYERS, DEEPSEEK_V32_COMPONENTS, BlockSpec
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.host import DEFAULT_PAGE_BYTES, HostTier

BLOCK_TOKENS = 64  # tokens per block of every namespace measured
TARGETS = {
    "host_load_vs_memcpy": (">=", 0.8),
    "disk_read_vs_ceiling": (">=", 0.8),
    "disk_write_vs_ceiling": (">=", 0.7),
    "lookup_speedup_vs_sha256": (">=", 5.0),
    "disk_bytes_per_payload_byte": ("<=", 1.02),
}


@dataclass
class BenchConfig:
    blocks: int = 96  # host tier: 96 x 2.93 MiB = 282 MiB per pass, larger than any CPU cache
    disk_blocks: int | None = None  # disk tier per pass; default 4 x blocks (1.1 GiB), see below
    repeats: int = 4  # even: the store's write goes first in half of them, the ceiling's in the other half
    read_rounds: int = 4  # cold-read samples per repeat, each next to a ceiling sample; even (see bench_disk)
    lookup_tokens: int = 131072
    lookup_repeats: int = 21
    directory: str | None = None


def _median_rate(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _rates(nbytes: int, seconds: list[float]) -> list[float]:
    return [round(nbytes / s / 1e9, 3) for s in seconds]


def _namespace(num_layers: int = DEEPSEEK_NUM_LAYERS) -> Namespace:
    return Namespace("bench/deepseek-v3.2-shaped", "bench", num_layers, DEEPSEEK_V32_COMPONENTS,
                     block_size=BLOCK_TOKENS)


def _payloads(spec: BlockSpec, count: int) -> list[np.ndarray]:
    """Distinct blocks, cheap to make, in page-aligned memory as engines' staging buffers and the
    host tier's slots are (``aligned_empty``): the disk tier writes those with no copy."""
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, spec.block_bytes, dtype=np.uint8)
    payloads = [aligned_empty(spec.block_bytes) for _ in range(count)]
    for i, payload in enumerate(payloads):
        payload[:] = np.roll(base, i * 4099)
    return payloads


def _unaligned(payloads: list[np.ndarray]) -> list[np.ndarray]:
    """The same blocks 16 bytes past a page boundary, where ``malloc`` puts large numpy arrays."""
    copies = [aligned_empty(p.nbytes + 16)[16:] for p in payloads]
    for copy, payload in zip(copies, payloads):
        copy[:] = payload
    return copies


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def whole_pages(nbytes: int, page_bytes: int = DEFAULT_PAGE_BYTES) -> int:
    """``nbytes`` rounded up to whole host-tier pages (a capacity with a part page left over is
    warned of, and the part is unused)."""
    return -(-nbytes // page_bytes) * page_bytes


def bench_host(cfg: BenchConfig, payloads: list[np.ndarray], ns: Namespace, shm_dir: str) -> dict:
    spec = BlockSpec.of(ns)
    hashes = namespace_hashes(ns, np.arange(cfg.blocks * spec.block_size) % 129280)
    dsts = [np.empty(spec.block_bytes, np.uint8) for _ in payloads]
    total = spec.block_bytes * cfg.blocks
    memcpy, put, load = [], [], []
    for _ in range(cfg.repeats):
        store = TieredStore([HostTier(whole_pages(int(total * 1.1) + (64 << 20)), shm_dir=shm_dir)])
        try:
            ns_id = store.register_namespace(ns)
            memcpy.append(ceilings.memcpy_seconds(payloads, dsts))
            put.append(_timed(lambda: store.put(ns_id, hashes, payloads)))
            for dst in dsts:
                dst.fill(0)
            load.append(_timed(lambda: store.load(ns_id, hashes, dsts)))
            assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads)), "host load returned wrong bytes"
        finally:
            store.close()
    return {"memcpy_gbps": _median_rate(total, memcpy), "host_put_gbps": _median_rate(total, put),
            "host_load_gbps": _median_rate(total, load)}


def _settle() -> None:
    """Let earlier phases' writeback (hundreds of MB) drain, so no timed disk phase is charged for
    the one before it. Called alike before the ceilings and the store's phases."""
    os.sync()
    time.sleep(0.5)


def read_order(repeat: int, rounds: int) -> list[str]:
    """The cold reads of one repeat: ``rounds`` pairs of "ceiling" and "store", taking turns going
    first (C S, S C, C S, S C; odd repeats start with the store).

    This disk alternates fast and slow reads (README, Benchmark). With an even number of rounds
    each side gets as many even slots as odd ones, so as many fast reads as the other whatever the
    phase; three rounds (C S, S C, C S) gave one side two fast slots of three in every repeat that
    started in the same phase, which is how earlier runs charged the disk's rhythm to the store.
    """
    order: list[str] = []
    for round_ in range(rounds):
        order += ["ceiling", "store"] if (repeat + round_) % 2 == 0 else ["store", "ceiling"]
    return order


def _warm_up(payloads: list[np.ndarray], hashes: list[bytes], ns: Namespace, path: str) -> None:
    """Put and load a few blocks untimed. A process's first disk put and load page-fault the
    write bounce buffer and the read-ahead buffers, which a running store has long since done
    (and the ceilings fill their buffers before their timers start)."""
    store = TieredStore([DiskTier(path, 2 * sum(p.nbytes for p in payloads) + (64 << 20), durable=False)])
    try:
        ns_id = store.register_namespace(ns)
        store.put(ns_id, hashes, payloads)
        store.load(ns_id, hashes, [np.empty_like(p) for p in payloads])
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)


def bench_disk(cfg: BenchConfig, payloads: list[np.ndarray], ns: Namespace, root: str) -> dict:
    """Disk passes of ``len(payloads)`` blocks, larger than the host passes: on the virtual disk
    measured here, back-to-back reads alternate fast and slow (the same bytes at 0.8 and then 1.9
    GB/s, whoever reads them). 1.1 GiB passes, several read samples per run and a balanced order
    (``read_order``; an even number of repeats for the writes) keep that rhythm out of the ratios."""
    spec = BlockSpec.of(ns)
    hashes = namespace_hashes(ns, np.arange(len(payloads) * spec.block_size) % 129280 + 7)
    # resident, as an engine's buffers are: a first touch of 1.1 GiB inside a timed read cost its
    # first sample two thirds of its rate
    dsts = [np.full(spec.block_bytes, 1, np.uint8) for _ in payloads]
    total = spec.block_bytes * len(payloads)
    write_ceiling, read_ceiling, write, read, warm, buffered, overhead = [], [], [], [], [], [], []
    unaligned, unaligned_payloads = [], _unaligned(payloads)
    _warm_up(payloads[:24], hashes[:24], ns, os.path.join(root, "warm-up"))
    _warm_up(unaligned_payloads[:24], hashes[:24], ns, os.path.join(root, "warm-up"))
    for i in range(cfg.repeats):
        path = os.path.join(root, f"disk-{i}")
        # a fresh ceiling file per repeat, as the store writes fresh segments: both sides read
        # bytes with the same history (one file reused by every repeat was read far more often)
        ceiling_file = os.path.join(root, f"ceiling-{i}.bin")
        store = TieredStore([DiskTier(path, 4 * total, durable=False)])
        try:
            ns_id = store.register_namespace(ns)
            disk: DiskTier = store.tiers[0]  # type: ignore[assignment]
            # On a virtual disk a write phase pays for the writeback of the one before it, so the
            # ceiling and the store take turns going first (even repeats: ceiling first).
            phases = [lambda: write_ceiling.append(ceilings.direct_write_seconds(ceiling_file, total)),
                      lambda: write.append(_timed(lambda: (store.put(ns_id, hashes, payloads), store.flush())))]
            for phase in phases if i % 2 == 0 else phases[::-1]:
                _settle()
                phase()
            overhead.append((disk.allocated_bytes() + _tree_bytes(os.path.join(path, "index"))) / total)
            disk.drop_page_cache()
            reads = {"ceiling": lambda: read_ceiling.append(ceilings.direct_read_seconds(ceiling_file, total)),
                     "store": lambda: read.append(_timed(lambda: store.load(ns_id, hashes, dsts)))}
            for side in read_order(i, cfg.read_rounds):
                _settle()
                reads[side]()
            assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads)), "disk load returned wrong bytes"
            warm.append(_timed(lambda: store.load(ns_id, hashes, dsts)))
            store.close()
            store = TieredStore([DiskTier(path, 4 * total, direct_io=False)])  # the other read path
            store.register_namespace(ns)
            store.tiers[0].drop_page_cache()
            buffered.append(_timed(lambda: store.load(ns_id, hashes, dsts)))
            assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads)), "buffered load returned wrong bytes"
            store.close()
            shutil.rmtree(path, ignore_errors=True)
            store = TieredStore([DiskTier(path, 4 * total, durable=False)])
            ns_id = store.register_namespace(ns)
            _settle()
            unaligned.append(_timed(lambda: (store.put(ns_id, hashes, unaligned_payloads), store.flush())))
        finally:
            store.close()
            shutil.rmtree(path, ignore_errors=True)
            if os.path.exists(ceiling_file):
                os.unlink(ceiling_file)
    return {
        "disk_write_gbps": _median_rate(total, write),
        "disk_write_ceiling_gbps": _median_rate(ceilings.direct_bytes(total), write_ceiling),
        "disk_write_unaligned_gbps": _median_rate(total, unaligned),
        "disk_read_cold_gbps": _median_rate(total, read),
        "disk_read_ceiling_gbps": _median_rate(ceilings.direct_bytes(total), read_ceiling),
        "disk_read_warm_gbps": _median_rate(total, warm),
        "disk_read_cold_buffered_gbps": _median_rate(total, buffered),
        "disk_bytes_per_payload_byte": statistics.median(overhead),
        "disk_samples_gbps": {  # every sample in the order taken, for a reader who doubts a median
            "write": _rates(total, write), "write_ceiling": _rates(ceilings.direct_bytes(total), write_ceiling),
            "write_unaligned": _rates(total, unaligned),
            "read_cold": _rates(total, read), "read_ceiling": _rates(ceilings.direct_bytes(total), read_ceiling),
        },
    }


def bench_lookup(cfg: BenchConfig, root: str) -> dict:
    """Hashing + directory probe of a `cfg.lookup_tokens`-token prompt (128K by default) whose
    every block is on disk.

    The lookup cost does not depend on the block's byte size, so this namespace keeps 64-token
    blocks but one layer of MLA fp8 (41 KiB blocks), which keeps the setup small.
    """
    ns = _namespace(num_layers=1)
    spec = BlockSpec.of(ns)
    tokens = np.random.default_rng(1).integers(0, 129280, cfg.lookup_tokens)
    hashes = namespace_hashes(ns, tokens)
    path = os.path.join(root, "lookup")
    store = TieredStore([DiskTier(path, 2 * len(hashes) * (spec.block_bytes + 8192))])
    try:
        ns_id = store.register_namespace(ns)
        payload = np.zeros(spec.block_bytes, np.uint8)
        store.put(ns_id, hashes, [payload] * len(hashes))
        ours, sha = [], []
        token_list = tokens.tolist()
        for _ in range(cfg.lookup_repeats):
            sha.append(ceilings.sha256_pickle_seconds(token_list, spec.block_size))
            start = time.perf_counter()
            result = store.lookup(ns_id, namespace_hashes(ns, tokens))
            ours.append(time.perf_counter() - start)
            assert result.hit_blocks == len(hashes) and set(result.tiers) == {"disk"}
    finally:
        store.close()
        shutil.rmtree(path, ignore_errors=True)
    return {"lookup_128k_s": statistics.median(ours), "sha256_pickle_128k_s": statistics.median(sha),
            "lookup_blocks": len(hashes), "lookup_tokens": cfg.lookup_tokens}


def _tree_bytes(path: str) -> int:
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(path) for f in files)


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    ns = _namespace()
    spec = BlockSpec.of(ns)
    root = tempfile.mkdtemp(prefix="kvstore-bench-", dir=cfg.directory)
    try:
        disk_blocks = cfg.disk_blocks or 4 * cfg.blocks
        payloads = _payloads(spec, max(cfg.blocks, disk_blocks))
        log(f"host tier: {cfg.blocks} blocks of {spec.block_bytes} bytes x {cfg.repeats} runs")
        figures = bench_host(cfg, payloads[: cfg.blocks], ns, shm_dir=None if cfg.directory is None else root)
        log(f"disk tier: {disk_blocks} blocks, write + fdatasync, then {cfg.read_rounds} cold reads per run")
        figures.update(bench_disk(cfg, payloads[:disk_blocks], ns, root))
        log(f"lookup: {cfg.lookup_tokens}-token prompt x {cfg.lookup_repeats} runs")
        figures.update(bench_lookup(cfg, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ratios = {
        "host_load_vs_memcpy": figures["host_load_gbps"] / figures["memcpy_gbps"],
        "host_put_vs_memcpy": figures["host_put_gbps"] / figures["memcpy_gbps"],
        "disk_read_vs_ceiling": figures["disk_read_cold_gbps"] / figures["disk_read_ceiling_gbps"],
        "disk_write_vs_ceiling": figures["disk_write_gbps"] / figures["disk_write_ceiling_gbps"],
        "lookup_speedup_vs_sha256": figures["sha256_pickle_128k_s"] / figures["lookup_128k_s"],
        "disk_bytes_per_payload_byte": figures["disk_bytes_per_payload_byte"],
    }
    met = {name: (ratios[name] >= bound if op == ">=" else ratios[name] <= bound) for name, (op, bound) in TARGETS.items()}
    return {
        "block": {"layers": spec.num_layers, "block_size": spec.block_size, "components": list(spec.components),
                  "block_bytes": spec.block_bytes},
        "blocks_per_pass": cfg.blocks,
        "disk_blocks_per_pass": disk_blocks,
        "repeats": cfg.repeats,
        "read_rounds": cfg.read_rounds,
        "method": {
            "statistic": "median over repeats (cold reads: over repeats x read_rounds); ceiling measured in the same repeat, right before or after",
            "cold_read": "default O_DIRECT reads with read-ahead (adjacent records read together, up to 16 MiB per request, 3 buffers) after fdatasync + posix_fadvise(DONTNEED) of the segments; also reported: the same cold read with direct_io=False (buffered, POSIX_FADV_WILLNEED); ceiling: O_DIRECT 4 MiB sequential reads",
            "write": "store.put of every block from page-aligned payloads (written in place) + flush (fdatasync); ceiling: O_DIRECT 4 MiB sequential writes + fsync; the two alternate which goes first; also reported: the same put from payloads 16 bytes off a page (through the bounce buffer), one sample per repeat after the reads",
            "lookup": "chained xxh3-128 hashing + directory probe, every block on disk; baseline: sha256(pickle(parent, tokens, None)) hashing alone",
            "hash_loop": "native (kvstore/_chain.c)" if native_hashing() else "python (kvstore._chain not built)",
        },
        "figures": figures,
        "ratios": ratios,
        "targets": {name: f"{op} {bound}" for name, (op, bound) in TARGETS.items()},
        "targets_met": met,
    }


def _tokens_label(tokens: int) -> str:
    """131072 -> '128K', 1000 -> '1,000': the lookup row names the prompt length measured."""
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else f"{tokens:,}"


def format_table(result: dict) -> str:
    f, r, met = result["figures"], result["ratios"], result["targets_met"]
    rows = [
        ("host load", f"{f['host_load_gbps']:.2f} GB/s", f"memcpy {f['memcpy_gbps']:.2f} GB/s", "host_load_vs_memcpy"),
        ("host put (incl. checksums)", f"{f['host_put_gbps']:.2f} GB/s", f"memcpy {f['memcpy_gbps']:.2f} GB/s", "host_put_vs_memcpy"),
        ("disk read, cold", f"{f['disk_read_cold_gbps']:.2f} GB/s", f"O_DIRECT {f['disk_read_ceiling_gbps']:.2f} GB/s", "disk_read_vs_ceiling"),
        ("disk write + fdatasync", f"{f['disk_write_gbps']:.2f} GB/s", f"O_DIRECT {f['disk_write_ceiling_gbps']:.2f} GB/s", "disk_write_vs_ceiling"),
        (f"lookup {_tokens_label(f['lookup_tokens'])} tokens", f"{f['lookup_128k_s'] * 1e3:.2f} ms", f"sha256 {f['sha256_pickle_128k_s'] * 1e3:.2f} ms", "lookup_speedup_vs_sha256"),
        ("disk bytes / payload byte", f"{f['disk_bytes_per_payload_byte']:.4f}", "payload 1.0", "disk_bytes_per_payload_byte"),
    ]
    b = result["block"]
    lines = [f"block: {b['layers']} layers x {b['block_size']} tokens {'+'.join(b['components'])} = {b['block_bytes']} bytes; "
             f"{result['blocks_per_pass']} blocks per host pass, {result['disk_blocks_per_pass']} per disk pass; "
             f"median of {result['repeats']} (cold reads: {result['repeats'] * result['read_rounds']})",
             f"{'measure':28} {'store':>12} {'ceiling / peer':>24} {'ratio':>8}  target"]
    for name, ours, ceiling, key in rows:
        target = result["targets"].get(key, "")
        mark = "" if key not in met else ("  ok" if met[key] else "  MISSED")
        lines.append(f"{name:28} {ours:>12} {ceiling:>24} {r[key]:>8.3f}  {target}{mark}")
    lines.append(f"hash loop: {result['method']['hash_loop']}")
    lines.append(f"disk write from unaligned payloads (bounce copy): {f['disk_write_unaligned_gbps']:.2f} GB/s "
                 f"({f['disk_write_unaligned_gbps'] / f['disk_write_ceiling_gbps']:.2f}x ceiling)")
    lines.append(f"disk read again at once: {f['disk_read_warm_gbps']:.2f} GB/s (O_DIRECT: no page cache); cold with "
                 f"direct_io=False (buffered): {f['disk_read_cold_buffered_gbps']:.2f} GB/s "
                 f"({f['disk_read_cold_buffered_gbps'] / f['disk_read_ceiling_gbps']:.2f}x ceiling)")
    return "\n".join(lines)
