"""``kvstore demo``: the bundled engine serving traffic through the store, checked against cold runs.

Two parts, one store (host shared-memory tier + disk tier) behind a ``StoreConnector``:

1. **Multi-turn chat.** Conversations share a system prompt; every turn's prompt is the previous
   prompt + the previous answer + a new user message. One serving engine with a small device
   pool runs them (evicted device pages are demoted to the store). Each request reports where
   its prompt tokens came from (device, host, disk) and how many were computed; its output is
   compared with a cold run on a fresh engine without the store.
2. **Long prompt** (the TTFT figures): a document of ``7/8`` of the prompt is cached, then the
   document + new text is served four ways: cold (nothing cached), resident (the document's
   pages still on the device), from the host tier (the same engine, its device prefix cache
   dropped), and from the disk tier (store reopened, host tier empty, the disk tier's page cache
   dropped).

With ``DemoConfig.sidecar`` set (``HOST:PORT`` or ``unix:PATH`` of a running ``kvstore serve``), the
same engine runs against that sidecar through a ``SidecarConnector`` instead of an in-process
store: configuration is the only difference. Tier figures then come from the sidecar's stats;
the disk-tier run of part 2 is skipped (the demo does not restart someone else's sidecar), so
its TTFT figures are None. A sidecar that already holds this demo's blocks (an earlier run) shows
more reuse in part 1; outputs still equal the cold runs.

Weights are seeded random (nothing is downloaded); token ids are random too, so outputs are
meaningless text but exact and comparable.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from connectors.base import KVConnector
from connectors.factory import load_timeout_from
from connectors.store_connector import StoreConnector
from engine_adapter.config import ModelConfig
from engine_adapter.engine import Engine
from engine_adapter.model import DeepseekForCausalLM
from engine_adapter.fingerprint import weights_fingerprint
from engine_adapter.namespace import namespace_for
from engine_adapter.paged_cache import PagePool
from engine_adapter.sequence import Request, RequestOutput
from kvstore.config import DiskConfig, HostConfig, StoreConfig
from kvstore.errors import InvalidRequest
from kvstore.store import TieredStore

PAGE = 64


@dataclass(frozen=True)
class DemoConfig:
    layers: int = 8
    hidden: int = 1024
    heads: int = 8
    vocab: int = 1024
    v32: bool = False
    long_prompt_tokens: int = 4096
    cached_fraction: float = 7 / 8
    ttft_repeats: int = 5  # warm long-prompt cases: median TTFT over this many fresh suffixes
    conversations: int = 3
    turns: int = 3
    system_tokens: int = 512
    user_tokens: int = 320
    new_tokens: int = 16
    chunk_size: int = 512
    data_dir: str | None = None  # None: a fresh temporary directory, removed at the end
    host_capacity: int = 512 << 20
    disk_capacity: int = 4 << 30
    seed: int = 0
    sidecar: str | None = None  # HOST:PORT or unix:PATH of a kvstore sidecar; None: an in-process store

    def __post_init__(self) -> None:
        if self.long_prompt_tokens < 2 * PAGE:  # a cached document of whole pages and a new suffix
            raise InvalidRequest(f"long_prompt_tokens (--long-prompt-tokens) must be at least {2 * PAGE}: a cached "
                                 f"document of whole {PAGE}-token pages and a new suffix; got {self.long_prompt_tokens}")

    @classmethod
    def quick(cls, **overrides) -> "DemoConfig":
        """A tiny model and short prompts: seconds instead of minutes (tests, smoke runs)."""
        return cls(**{**dict(layers=2, hidden=128, heads=4, vocab=256, long_prompt_tokens=1024, conversations=3,
                             turns=3, system_tokens=128, user_tokens=96, new_tokens=8, chunk_size=256, ttft_repeats=2),
                          **overrides})


def sidecar_refusal(target: str, exc) -> str:
    """What to do when the sidecar at ``target`` answered the demo's first call with ``exc`` (a
    ``grpc.RpcError``): the token or the TLS trust the sidecar asks for, or a sidecar to start."""
    code, details = exc.code().name, exc.details() or ""
    if code == "UNAUTHENTICATED":
        return (f"the kvstore sidecar at {target} refused the demo's calls (UNAUTHENTICATED: {details}): set "
                "KVSTORE_TOKEN or KVSTORE_TOKEN_FILE to the token it was started with")
    return (f"no kvstore sidecar answers at {target} ({code}: {details}): start one with `kvstore serve`, or leave "
            "out --sidecar for an in-process store; a sidecar that serves TLS needs KVSTORE_TLS_CA set to its "
            "certificate")


def model_config(cfg: DemoConfig) -> ModelConfig:
    """A DeepSeek-V3(.2)-shaped config with the real MLA widths (latent 512, rope 64)."""
    hf = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.hidden * 11 // 4,
              moe_intermediate_size=cfg.hidden // 4, num_hidden_layers=cfg.layers, first_k_dense_replace=1,
              num_attention_heads=cfg.heads, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=cfg.hidden * 3 // 8,
              qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=16, n_group=4, topk_group=2,
              num_experts_per_tok=4, n_shared_experts=1, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
              rope_theta=10000.0, max_position_embeddings=max(8192, 2 * cfg.long_prompt_tokens),
              norm_topk_prob=True, tie_word_embeddings=False)
    if cfg.v32:
        hf.update(model_type="deepseek_v32", index_n_heads=16, index_head_dim=128, index_topk=cfg.long_prompt_tokens // 8)
    return ModelConfig.from_hf(hf)


class _Demo:
    def __init__(self, cfg: DemoConfig, say: Callable[[str], None]):
        self.cfg, self.say = cfg, say
        self.model = DeepseekForCausalLM.random(model_config(cfg), seed=cfg.seed, dtype=torch.float32)
        self.weights = weights_fingerprint(self.model)  # another --seed is another model
        self.namespace = namespace_for(self.model.config, "demo/deepseek-random", PAGE, weights_hash=self.weights,
                                       compute_dtype=str(self.model.dtype))
        self._temporary_dir = cfg.data_dir is None and not cfg.sidecar  # made here, removed by ``close``
        self.data_dir = tempfile.mkdtemp(prefix="kvstore-demo-") if self._temporary_dir else cfg.data_dir
        self.rng = torch.Generator().manual_seed(cfg.seed + 1)
        self.store = None
        try:
            if not cfg.sidecar:
                self.store = self._open_store()
            self.connector = self._connect()
        except BaseException:  # no demo to close: undo what was set up here
            if self.store is not None:
                self.store.close()
            if self._temporary_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)
            raise

    def _connect(self) -> KVConnector:
        if self.cfg.sidecar:
            # grpc loads only for a sidecar
            import grpc

            from connectors.sidecar_connector import SidecarConnector

            from kvstore.service.limits import ServiceLimits

            # the sidecar's KVSTORE_MAX_* limits, read as the sidecar reads them: batches stay within them
            connector = SidecarConnector(self.cfg.sidecar, self.namespace, load_timeout_s=load_timeout_from(),
                                         limits=ServiceLimits.from_env())
            try:
                connector.stats()  # the demo reads the sidecar's tier counters after every request
            except grpc.RpcError as exc:
                connector.close()
                raise InvalidRequest(sidecar_refusal(self.cfg.sidecar, exc)) from None
            return connector
        return StoreConnector(self.store, self.namespace, load_timeout_s=load_timeout_from())

    def store_stats(self):
        return self.connector.stats() if self.store is None else self.store.stats()

    def _open_store(self) -> TieredStore:
        config = StoreConfig(host=HostConfig(capacity_bytes=self.cfg.host_capacity),
                             disk=DiskConfig(path=os.path.join(self.data_dir, "disk"), capacity_bytes=self.cfg.disk_capacity))
        return config.open_store()

    def tokens(self, n: int) -> list[int]:
        return torch.randint(0, self.cfg.vocab, (n,), generator=self.rng).tolist()

    def engine(self, pages: int, connected: bool = True) -> Engine:
        pool = PagePool(self.model.config, pages, page_size=PAGE)
        return Engine(self.model, pool, chunk_size=self.cfg.chunk_size, model_name="demo/deepseek-random",
                      weights_hash=self.weights,
                      connector=self.connector if connected else None)

    def cold_output(self, prompt: list[int]) -> tuple[int, ...]:
        pages = (len(prompt) + self.cfg.new_tokens) // PAGE + 2
        [out] = self.engine(pages, connected=False).run([Request(prompt, self.cfg.new_tokens)])
        return out.output_ids

    def serve(self, engine: Engine, prompt: list[int]) -> tuple[RequestOutput, dict[str, int]]:
        """Run one request; also return the blocks the store served from each tier."""
        before = {t.name: t.loaded_blocks for t in self.store_stats().tiers}
        [out] = engine.run([Request(prompt, self.cfg.new_tokens)])
        self.connector.flush()
        after = {t.name: t.loaded_blocks for t in self.store_stats().tiers}
        return out, {name: after[name] - before[name] for name in after if after[name] > before[name]}

    @staticmethod
    def reused_from(out: RequestOutput, tiers: dict[str, int]) -> str:
        """Where a run's reused tokens came from: "device 512, host 640", or "-"."""
        sources = [f"device {out.stats.device_hit_tokens}"] if out.stats.device_hit_tokens else []
        return ", ".join(sources + [f"{name} {blocks * PAGE}" for name, blocks in tiers.items()]) or "-"

    def report(self, label: str, out: RequestOutput, tiers: dict[str, int], identical: bool) -> dict:
        s = out.stats
        row = dict(request=label, prompt_tokens=s.prompt_tokens, reused_tokens=s.device_hit_tokens + s.connector_hit_tokens,
                   reused_from=self.reused_from(out, tiers), computed_tokens=s.computed_prompt_tokens, ttft_s=s.ttft_s,
                   identical_to_cold=identical)
        self.say(f"{label:>14} {row['prompt_tokens']:>7} {row['reused_tokens']:>7} {row['computed_tokens']:>8} "
                 f"{row['ttft_s']:>8.2f}s  {row['reused_from']:<28} {identical}")
        return row

    def chat(self) -> list[dict]:
        cfg, rows = self.cfg, []
        system = self.tokens(cfg.system_tokens)
        history = [list(system) for _ in range(cfg.conversations)]
        longest = cfg.system_tokens + cfg.turns * (cfg.user_tokens + cfg.new_tokens)
        # room for about one conversation: the others' pages are demoted to the store and come back from it
        serving = self.engine(pages=longest // PAGE + 3)
        for turn in range(cfg.turns):
            for conv in range(cfg.conversations):
                prompt = history[conv] + self.tokens(cfg.user_tokens)
                out, tiers = self.serve(serving, prompt)
                rows.append(self.report(f"chat {conv}.{turn}", out, tiers, out.output_ids == self.cold_output(prompt)))
                history[conv] = prompt + list(out.output_ids)
        return rows

    def long_prompt(self) -> tuple[list[dict], dict[str, float]]:
        """TTFT of one cached document + a new suffix, four ways. Warm cases take the median over
        ``ttft_repeats`` runs, each with a fresh suffix (so no run reuses another's suffix), the
        resident and host runs alternating; the first suffix's outputs are compared with its cold run."""
        cfg = self.cfg
        cached = int(cfg.long_prompt_tokens * cfg.cached_fraction) // PAGE * PAGE
        document = self.tokens(cached)
        prompts = [document + self.tokens(cfg.long_prompt_tokens - cached) for _ in range(cfg.ttft_repeats)]
        pages = cfg.long_prompt_tokens // PAGE * (cfg.ttft_repeats + 1) + 8
        engine = self.engine(pages)
        engine.run([Request(document, 1)])  # caches the document: device pages + store
        self.connector.flush()
        if self.store is not None:
            self.store.flush()
        # From here on nothing is saved, so every run below finds exactly the document cached.
        self.connector.read_only = True
        [cold] = self.engine(pages, connected=False).run([Request(prompts[0], cfg.new_tokens)])
        rows = [self.report("long cold", cold, {}, True)]
        ttft = {"ttft_cold_s": cold.stats.ttft_s}
        # One engine serves each prompt twice: with the document's pages on the device, then with
        # its device cache dropped (the document comes from the host tier and is resident again
        # after). The runs alternate, so a slow spell of a shared machine slows both alike.
        runs = {"resident": [], "host": []}
        for prompt in prompts:
            runs["resident"].append(self.serve(engine, prompt))
            engine.reset_prefix_cache()
            runs["host"].append(self.serve(engine, prompt))
        if self.store is not None:  # last: every run restarts the store
            runs["disk"] = [self.serve(self._engine_after_restart(), prompt) for prompt in prompts]
        for label, label_runs in runs.items():
            out, tiers = label_runs[0]
            row = self.report(f"long {label}", out, tiers, out.output_ids == cold.output_ids)
            ttft[f"ttft_{label}_s"] = row["ttft_median_s"] = statistics.median(o.stats.ttft_s for o, _ in label_runs)
            row["runs"] = [dict(ttft_s=o.stats.ttft_s, reused_from=self.reused_from(o, t)) for o, t in label_runs]
            rows.append(row)
        if self.store is None:
            self.say(f"{'long disk':>14} skipped: the demo does not restart the sidecar at {cfg.sidecar}")
            ttft["ttft_disk_s"] = None
        return rows, ttft

    def _engine_after_restart(self) -> Engine:
        """A fresh engine over a reopened store: empty host tier, disk page cache dropped."""
        self._restart_store()
        self.connector.read_only = True
        return self.engine(self.cfg.long_prompt_tokens // PAGE * 2 + 8)

    def _restart_store(self) -> None:
        """Close and reopen: the host tier starts empty; the disk tier's cached pages are dropped."""
        self.connector.close()
        self.store.close()
        self.store = self._open_store()
        disk = self.store.tiers[-1]
        disk.drop_page_cache()
        self.connector = StoreConnector(self.store, self.namespace, load_timeout_s=load_timeout_from())

    def close(self) -> None:
        """Close the connector and the store; remove the store's directory if it was a temporary one."""
        try:
            self.connector.close()
            if self.store is not None:
                self.store.close()
        finally:
            if self._temporary_dir:
                shutil.rmtree(self.data_dir, ignore_errors=True)


def run_demo(cfg: DemoConfig, say: Callable[[str], None] = print) -> dict:
    """Run both parts; returns the JSON-able summary (see the module docstring)."""
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    demo = _Demo(cfg, say)
    try:
        config = demo.model.config
        say(f"model: DeepSeek-{'V3.2' if cfg.v32 else 'V3'}-shaped, {config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads, MLA latent {config.kv_lora_rank} + rope "
            f"{config.qk_rope_head_dim}, random weights; "
            + (f"store: the sidecar at {cfg.sidecar}" if cfg.sidecar else f"store in {demo.data_dir}"))
        say(f"{'request':>14} {'prompt':>7} {'reused':>7} {'computed':>8} {'TTFT':>9}  {'reused from':<28} same as cold")
        rows = demo.chat()
        long_rows, ttft = demo.long_prompt()
    finally:
        demo.close()
    rows += long_rows
    result = {
        "prefill_tokens_computed": sum(r["computed_tokens"] for r in rows),
        "prefill_tokens_reused": sum(r["reused_tokens"] for r in rows),
        "outputs_identical": all(r["identical_to_cold"] for r in rows),
        "ttft_cold_s": ttft["ttft_cold_s"],
        "ttft_hit_s": ttft["ttft_host_s"],
        "ttft_disk_hit_s": ttft["ttft_disk_s"],
        "ttft_resident_s": ttft["ttft_resident_s"],
        "ratios": {"hit_vs_resident": ttft["ttft_host_s"] / ttft["ttft_resident_s"],
                   "disk_hit_vs_resident": (None if ttft["ttft_disk_s"] is None
                                            else ttft["ttft_disk_s"] / ttft["ttft_resident_s"]),
                   "hit_vs_cold": ttft["ttft_host_s"] / ttft["ttft_cold_s"]},
        "long_prompt": {"tokens": cfg.long_prompt_tokens, "cached_tokens": long_rows[1]["reused_tokens"]},
        "model_config": {k: v for k, v in asdict(demo.model.config).items() if not k.startswith("_")},
        "requests": rows,
        "elapsed_s": time.perf_counter() - started,
    }
    say(f"prefill tokens computed {result['prefill_tokens_computed']}, reused {result['prefill_tokens_reused']}; "
        f"outputs identical to cold runs: {result['outputs_identical']}")
    r = result["ratios"]
    say(f"long prompt TTFT: cold {result['ttft_cold_s']:.2f}s, resident {result['ttft_resident_s']:.2f}s, "
        f"host hit {result['ttft_hit_s']:.2f}s ({r['hit_vs_resident']:.2f}x resident, {r['hit_vs_cold']:.2f}x cold)"
        + (f", disk hit {result['ttft_disk_hit_s']:.2f}s ({r['disk_hit_vs_resident']:.2f}x resident)"
           if result["ttft_disk_hit_s"] is not None else ", disk hit skipped (sidecar)"))
    return result
