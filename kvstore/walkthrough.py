"""``kvstore run``'s workload until the engine and sidecar exist: multi-turn chats over the store.

Several conversations share a system prompt; every turn's prompt extends the previous turn. Each
request hashes its prompt, looks it up with a lease, loads the hit, "computes" the KV of the rest
(deterministic bytes derived from the token prefix, standing in for prefill) and puts the new
full blocks. Every loaded block is checked against what a cold computation would produce. Then
the store is closed and reopened on the same directory to show the disk tier surviving restart.

It knows nothing about models: the bytes are synthetic, at the real DeepSeek-V3.2 block geometry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import xxhash

from kvstore.config import StoreConfig
from kvstore.keys import Namespace, namespace_hashes
from kvstore.layout import DEEPSEEK_NUM_LAYERS, DEEPSEEK_V32_COMPONENTS, BlockSpec
from kvstore.store import TieredStore

NAMESPACE = Namespace("walkthrough/deepseek-v3.2-shaped", "synthetic", DEEPSEEK_NUM_LAYERS,
                      DEEPSEEK_V32_COMPONENTS, block_size=64)


@dataclass(frozen=True)
class RequestReport:
    conversation: int
    turn: int
    prompt_tokens: int
    reused_tokens: int
    tiers: str
    computed_tokens: int
    verified: bool


def synthetic_kv(spec: BlockSpec, block_hash: bytes) -> np.ndarray:
    """The bytes a cold prefill would produce for this block (a pure function of its hash)."""
    seed = xxhash.xxh3_64_intdigest(block_hash)
    return np.random.default_rng(seed).integers(0, 256, spec.block_bytes, dtype=np.uint8)


def conversations(count: int, turns: int, system_tokens: int, turn_tokens: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(42)
    system = rng.integers(0, 129280, system_tokens)
    out = []
    for _ in range(count):
        prompt, prompts = system, []
        for _ in range(turns):
            prompt = np.concatenate([prompt, rng.integers(0, 129280, turn_tokens)])
            prompts.append(prompt)
        out.append(prompts)
    return out


def serve_request(store: TieredStore, ns_id: bytes, tokens: np.ndarray) -> tuple[int, tuple[str, ...], bool]:
    """Lookup, load the hit, put the computed rest. Returns (reused blocks, tiers, bytes verified)."""
    spec = store.spec(ns_id)
    hashes = namespace_hashes(NAMESPACE, tokens)
    hit = store.lookup(ns_id, hashes, lease_ttl_s=30.0)
    dsts = [np.empty(spec.block_bytes, np.uint8) for _ in range(hit.hit_blocks)]
    loaded = store.load(ns_id, hashes[: hit.hit_blocks], dsts, lease_id=hit.lease_id)
    verified = all(np.array_equal(d, synthetic_kv(spec, h)) for d, h in zip(dsts[: loaded.loaded_blocks], hashes))
    new = hashes[loaded.loaded_blocks :]
    parent = hashes[loaded.loaded_blocks - 1] if loaded.loaded_blocks else None
    store.put(ns_id, new, [synthetic_kv(spec, h) for h in new], parent=parent)
    return loaded.loaded_blocks, loaded.tiers, verified


def run_walkthrough(config: StoreConfig, say: Callable[[str], None], conversations_count: int = 4, turns: int = 3) -> list[RequestReport]:
    reports = []
    chats = conversations(conversations_count, turns, system_tokens=1024, turn_tokens=384)
    store = config.open_store()
    try:
        ns_id = store.register_namespace(NAMESPACE)
        spec = store.spec(ns_id)
        say(f"namespace {NAMESPACE.model}: {spec.num_layers} layers, {'+'.join(spec.components)}, "
            f"{spec.block_bytes / 2**20:.2f} MiB per {spec.block_size}-token block")
        say(f"tiers: {', '.join(f'{t.name} {t.capacity_bytes / 2**30:.2f} GiB' for t in store.tiers)}")
        say(f"{'conv':>4} {'turn':>4} {'prompt':>7} {'reused':>7} {'computed':>8}  tiers of the hit            verified")
        for turn in range(turns):
            for conv, prompts in enumerate(chats):
                report = _serve(store, ns_id, conv, turn, prompts[turn])
                reports.append(report)
                say(f"{conv:>4} {turn:>4} {report.prompt_tokens:>7} {report.reused_tokens:>7} "
                    f"{report.computed_tokens:>8}  {report.tiers:<27} {report.verified}")
        store.flush()
        _say_stats(store, say)
    finally:
        store.close()
    if config.disk is not None:
        say("restart: reopening the store on the same disk directory")
        store = config.open_store()
        try:
            ns_id = store.register_namespace(NAMESPACE)
            report = _serve(store, ns_id, 0, turns - 1, chats[0][turns - 1])
            reports.append(report)
            say(f"after restart, conversation 0's last prompt: {report.reused_tokens} of {report.prompt_tokens} "
                f"tokens reused from {report.tiers}; verified {report.verified}")
            store.flush()
        finally:
            store.close()
    return reports


def _serve(store: TieredStore, ns_id: bytes, conv: int, turn: int, tokens: np.ndarray) -> RequestReport:
    block_size = store.spec(ns_id).block_size
    reused, tiers, verified = serve_request(store, ns_id, tokens)
    summary = ", ".join(f"{name} {tiers.count(name)}" for name in dict.fromkeys(tiers)) or "-"
    return RequestReport(conv, turn, len(tokens), reused * block_size, summary, len(tokens) - reused * block_size, verified)


def _say_stats(store: TieredStore, say: Callable[[str], None]) -> None:
    stats = store.stats()
    say(f"lookups {stats.lookups}, blocks looked up {stats.lookup_blocks}, hit {stats.hit_blocks} "
        f"({stats.hit_blocks / max(stats.lookup_blocks, 1):.0%}), stored {stats.stored_blocks}")
    for tier in stats.tiers:
        say(f"  {tier.name:5} used {tier.used_bytes / 2**20:8.1f} MiB of {tier.capacity_bytes / 2**20:9.1f} MiB, "
            f"{tier.blocks} blocks, hits served {tier.loaded_blocks}, evictions {tier.evictions}")
