"""A real LMCacheEngine on the CPU: for the tests, the benchmark and trying the plugin without a GPU.

LMCache ships no connector that moves KV on the CPU (its vLLM connector needs CUDA streams, its
mock copies nothing), so ``PagedCPUConnector`` is a small ``GPUConnectorInterface`` over a paged
CPU cache laid out as vLLM's MLA cache is: one ``[slots, 576]`` tensor per layer, token ``i`` of a
request in slot ``slot_mapping[i]``.

    config = lmcache_config(plugin_extra_config("127.0.0.1:50551"))   # config.py; or {"remote_url": ...}
    engine = build_engine("a", config, mla_metadata("deepseek-ai/DeepSeek-V3", layers=61))
    prompt = make_prompt(seed=0, num_tokens=1000, layers=61)
    puts = PutTracker(engine)
    store_prompt(engine, prompt, cache, slots); puts.wait()          # puts are asynchronous
    retrieved = retrieve_prompt(engine, prompt, fresh_cache, other_slots)   # then holds_prompt(...)

``local_cpu`` is off, so every hit comes from the remote storage; ``save_unfull_chunk`` is on, so
the last partial chunk is stored too. LMCache hashes tokens with Python's ``hash`` when vLLM is not
installed: set ``PYTHONHASHSEED`` the same in every process that shares a cache. LMCache leaves
non-daemon threads running: a process that built an engine must end with ``os._exit``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.metadata import LMCacheMetadata

MLA_WIDTH = 576  # 512 latent + 64 rope values per token and layer (bf16: 1,152 bytes)
CHUNK_TOKENS = 256


def lmcache_config(remote: dict[str, Any], cpu_buffer_gb: float = 0.5) -> LMCacheEngineConfig:
    """The engine config over ``remote`` (``plugin_extra_config(...)`` or ``{"remote_url": ...}``);
    ``cpu_buffer_gb`` bounds the objects in flight (a 61-layer chunk is 18 MB)."""
    return LMCacheEngineConfig.from_dict({
        "chunk_size": CHUNK_TOKENS, "local_cpu": False, "max_local_cpu_size": cpu_buffer_gb,
        "remote_serde": "naive", "save_unfull_chunk": True, **remote})


def mla_metadata(model: str, layers: int) -> LMCacheMetadata:
    return LMCacheMetadata(model_name=model, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(layers, 1, CHUNK_TOKENS, 1, MLA_WIDTH), use_mla=True,
                           role="worker", chunk_size=CHUNK_TOKENS)


class PagedCPUConnector(GPUConnectorInterface):
    """Copies between MLA objects ``[1, layers, tokens, 576]`` and ``kvcaches``: one ``[slots, 576]``
    tensor per layer, token ``start + i`` in slot ``slot_mapping[start + i]``."""

    def __init__(self, layers: int):
        self.layers = layers

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([1, self.layers, num_tokens, MLA_WIDTH])

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        slots = kwargs["slot_mapping"][start:end]
        chunk = memory_obj.tensor[0]  # [layers, end - start, 576]
        for layer, cache in enumerate(kwargs["kvcaches"]):
            torch.index_select(cache, 0, slots, out=chunk[layer])

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs) -> None:
        slots = kwargs["slot_mapping"][start:end]
        chunk = memory_obj.tensor[0]  # [layers, end - start, 576]
        for layer, cache in enumerate(kwargs["kvcaches"]):
            cache.index_copy_(0, slots, chunk[layer])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(memory_obj, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(memory_obj, start, end, **kwargs)


def build_engine(instance_id: str, config: LMCacheEngineConfig, metadata: LMCacheMetadata) -> LMCacheEngine:
    """A single-rank engine (no-op broadcasts) with its storage backends started."""
    layers = metadata.kv_shape[0]
    engine = LMCacheEngineBuilder.get_or_create(instance_id, config, metadata, PagedCPUConnector(layers),
                                                lambda tensor, rank: None, lambda obj, rank: obj)
    engine.post_init()
    return engine


def remote_backends(engine: LMCacheEngine) -> list:
    """The engine's RemoteBackend objects (one per plugin, or the one of ``remote_url``)."""
    return [b for name, b in engine.storage_manager.storage_backends.items() if name.startswith("RemoteBackend")]


def plugin_connector(engine: LMCacheEngine):
    """Our ``KVStoreConnector`` inside the engine (None if LMCache could not create it)."""
    for backend in remote_backends(engine):
        connection = backend.connection
        if connection is not None:
            return connection.getWrappedConnector()
    return None


class PutTracker:
    """Counts the engine's remote puts in (when LMCache creates the put's coroutine, inside
    ``engine.store``) and out (when it finishes), so a caller can wait for them: LMCache runs puts
    in the background and keeps no handle on a batched one."""

    def __init__(self, engine: LMCacheEngine):
        self.pending = 0
        self._lock = threading.Lock()
        for backend in remote_backends(engine):
            connection = backend.connection
            for name in ("put", "batched_put"):
                setattr(connection, name, self._counted(getattr(connection, name)))

    def _counted(self, put):
        def counted(*args, **kwargs):
            with self._lock:
                self.pending += 1
            return self._finish(put(*args, **kwargs))

        return counted

    async def _finish(self, put) -> None:
        try:
            await put
        finally:
            with self._lock:
                self.pending -= 1

    def wait(self, timeout_s: float = 60.0) -> None:
        """Block until every put started so far has finished."""
        deadline = time.monotonic() + timeout_s
        while self.pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.pending} remote puts still running after {timeout_s} s")
            time.sleep(0.001)


@dataclass(frozen=True)
class Prompt:
    tokens: torch.Tensor  # [n] int64
    kv: torch.Tensor  # [layers, n, 576] bf16: what the model computed for each token


def make_prompt(seed: int, num_tokens: int, layers: int) -> Prompt:
    """Reproducible tokens and KV values: the same ``seed`` gives the same prompt in every process."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128_000, (num_tokens,), generator=generator)
    kv = torch.randn(layers, num_tokens, MLA_WIDTH, generator=generator).to(torch.bfloat16)
    return Prompt(tokens, kv)


def paged_cache(layers: int, num_slots: int) -> list[torch.Tensor]:
    return [torch.zeros(num_slots, MLA_WIDTH, dtype=torch.bfloat16) for _ in range(layers)]


def slot_mapping(seed: int, num_tokens: int, num_slots: int) -> torch.Tensor:
    """Scattered slots, as a paged cache hands them out."""
    return torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:num_tokens]


def store_prompt(engine: LMCacheEngine, prompt: Prompt, cache: list[torch.Tensor], slots: torch.Tensor) -> None:
    """Write the prompt's KV into ``cache`` at ``slots`` (the model's prefill) and store it."""
    for layer, values in zip(cache, prompt.kv):
        layer[slots] = values
    engine.store(prompt.tokens, kvcaches=cache, slot_mapping=slots)


def retrieve_prompt(engine: LMCacheEngine, prompt: Prompt, cache: list[torch.Tensor], slots: torch.Tensor) -> int:
    """Retrieve the prompt into ``cache`` at ``slots``; how many tokens (a prefix) were retrieved."""
    return int(engine.retrieve(prompt.tokens, kvcaches=cache, slot_mapping=slots).sum())


def holds_prompt(cache: list[torch.Tensor], slots: torch.Tensor, prompt: Prompt, num_tokens: int) -> bool:
    """Whether ``cache`` holds the prompt's first ``num_tokens`` tokens at ``slots``, bit for bit."""
    got = torch.stack([layer[slots[:num_tokens]] for layer in cache])  # [layers, num_tokens, 576]
    return torch.equal(got.view(torch.int16), prompt.kv[:, :num_tokens].view(torch.int16))
