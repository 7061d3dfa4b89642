"""LMCache engine scenarios the plugin must survive, one per process, for ``test_faults.py``. Run
it with the LMCache environment's python (``conftest.run_engine(..., worker=FAULT_WORKER)`` does):

    python fault_worker.py '{"scenario": "planted_descriptions", "address": "127.0.0.1:PORT", "cases": {...}}'

Engines have 16 layers (4.7 MB chunks) and ``blocking_timeout_secs`` 1 unless a scenario says
otherwise. Prints one line ``RESULT {json}`` and ends with ``os._exit`` (LMCache's threads).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

MODEL = "deepseek-ai/DeepSeek-V3"
LAYERS = 16


class Harness:
    """One engine over the sidecar at ``args["address"]``, its plugin connector and RemoteBackend;
    ``options``: our keys (``plugin_extra_config``), ``extra``: LMCache's own ``extra_config`` keys."""

    def __init__(self, args: dict, blocking_timeout_s: int = 1, cpu_buffer_gb: float = 0.05,
                 options: dict | None = None, **extra):
        import connectors.lmcache  # noqa: F401  (first: the sidecar client beside LMCache's older protobuf)
        from connectors.lmcache import cpu_engine as lmc
        from connectors.lmcache.config import plugin_extra_config

        self.lmc = lmc
        remote = plugin_extra_config(args["address"], **(options or {}))
        remote["extra_config"].update(extra)
        remote["blocking_timeout_secs"] = blocking_timeout_s
        config = lmc.lmcache_config(remote, cpu_buffer_gb=cpu_buffer_gb)
        self.engine = lmc.build_engine(args["scenario"], config, lmc.mla_metadata(MODEL, LAYERS))
        self.connector = lmc.plugin_connector(self.engine)
        self.backend = lmc.remote_backends(self.engine)[0]
        self.cpu = self.backend.local_cpu_backend

    def keys(self, seed: int, tokens: int) -> list:
        prompt = self.lmc.make_prompt(seed, tokens, LAYERS)
        return [key for _, _, key in self.engine.token_database.process_tokens(prompt.tokens)]

    def active_objects(self) -> int:
        allocator = self.cpu.memory_allocator
        return getattr(allocator, "pin_allocator", allocator).num_active_allocations


def planted_descriptions(args: dict) -> dict:
    """Per case of ``args["cases"]`` ({name: [shapes, dtypes, fmt, body_bytes]}): chunk 0 of a fresh
    prompt planted right, chunk 1 with that description over right-sized, checksummed bytes. What a
    get of both loaded, and how the counts moved."""
    import numpy as np

    from connectors.lmcache import framing
    from connectors.lmcache.framing import ObjectMeta, key_digest

    h = Harness(args)
    h.connector.session.register()
    rng = np.random.default_rng(0)
    full = ObjectMeta(((1, LAYERS, 256, 576),), ("bfloat16",), "KV_MLA_FMT")
    results = {}
    for seed, (name, (shapes, dtypes, fmt, body_bytes)) in enumerate(sorted(args["cases"].items()), start=100):
        keys = h.keys(seed, 512)
        described = ObjectMeta(tuple(tuple(s) for s in shapes), tuple(dtypes), fmt)
        for key, meta, size in ((keys[0], full, LAYERS * 256 * 1152), (keys[1], described, body_bytes)):
            block = np.zeros(h.connector.spec.block_bytes, np.uint8)
            framing.frame(block, key_digest(key.to_string()), rng.integers(0, 256, size, dtype=np.uint8), meta)
            assert h.connector.client.put(h.connector.session.ns_id, [key_digest(key.to_string())], [block]).stored
        before = h.connector.counts()
        objs = h.backend.batched_get_blocking(keys)
        after = h.connector.counts()
        results[name] = {"loaded": [obj is not None for obj in objs],
                         "moved": {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}}
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()
    return {"results": results, "active_objects": h.active_objects()}


SCENARIOS = {f.__name__: f for f in (planted_descriptions,)}


if __name__ == "__main__":
    code = 0
    try:
        args = json.loads(sys.argv[1])
        print("RESULT " + json.dumps(SCENARIOS[args["scenario"]](args)), flush=True)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
