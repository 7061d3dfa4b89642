"""The plugin inside a real LMCache engine (CPU, no vLLM), against a real sidecar process.

Each engine runs in its own LMCache process (``engine_worker.py``): engine A stores a 1,000-token
prompt with all 61 DeepSeek-V3 layers (3 full 256-token chunks and one of 232 tokens), engine B
retrieves it into its own paged cache at other slots.
"""

from __future__ import annotations

import json

import numpy as np

from connectors.lmcache import framing
from connectors.lmcache.framing import ObjectMeta, key_digest
from kvstore.keys import Namespace
from kvstore.service import dataplane
from kvstore.layout import BlockSpec
from kvstore.service.client import KVStoreClient
from tests.lmcache.conftest import SidecarProcess, run_engine

PROMPT_TOKENS = 1000
CHUNKS = 4  # 256 + 256 + 256 + 232 tokens


def metric(exposition: str, name: str, **labels: str) -> float:
    """The value of one sample of a Prometheus text exposition (0 when absent)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in exposition.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def test_engine_b_retrieves_what_engine_a_stored_byte_exact_across_a_sidecar_kill(lmcache_py, sidecar):
    stored = run_engine(lmcache_py, action="store", address=sidecar.address, seed=1, tokens=PROMPT_TOKENS)
    runtime = stored["runtime"]  # LMCache's pins (the lmcache extra): the generated stubs load as they are
    assert runtime["protobuf"].startswith("6.") and runtime["grpcio"].startswith("1.78."), runtime
    assert runtime["stub"] == "kvstore.service.v1.kvstore_pb2_grpc", runtime
    assert stored["counts"] == {"stored": CHUNKS, "duplicates": 0, "rejected": 0}, "every put acknowledged"
    assert len(stored["listed"]) == CHUNKS and stored["ping"] == 0

    namespace = Namespace.from_json(stored["namespace"])
    assert (namespace.model, namespace.block_size, namespace.num_layers) == ("deepseek-ai/DeepSeek-V3", 256, 62)
    assert BlockSpec.of(namespace).block_bytes == 18_284_544  # a 17,989,632-byte chunk plus the header row
    label = f"deepseek-ai/DeepSeek-V3/{namespace.id.hex()[:8]}"
    exposition = sidecar.get("metrics")
    assert metric(exposition, "kvstore_put_blocks_total", namespace=label, outcome="stored") == CHUNKS

    sidecar.kill()  # --durable-puts: every acknowledged put was fsynced before its answer
    sidecar.restart()
    retrieved = run_engine(lmcache_py, action="retrieve", address=sidecar.address, seed=1, tokens=PROMPT_TOKENS)

    assert retrieved["lookup"] == PROMPT_TOKENS
    assert retrieved["retrieved"] == PROMPT_TOKENS and retrieved["exact"], "all of it, bit for bit"
    assert retrieved["counts"]["hits"] == CHUNKS and not retrieved["counts"].get("corrupt")
    assert retrieved["counts"].get("hits_shared_memory", 0) == 0, "the kill emptied the host tier: Get from disk"
    exposition = sidecar.get("metrics")
    assert metric(exposition, "kvstore_hit_tokens_total", namespace=label, tier="disk") >= 3 * 256
    namespaces = json.loads(sidecar.get("api/namespaces"))
    row = next(r for r in namespaces["rows"] if r["namespace"] == label)
    assert row["hit_tokens"] >= 3 * 256 and row["lookups"] > 0


def test_a_sidecar_that_is_down_gives_lmcache_misses_and_never_an_exception(lmcache_py, tmp_path):
    sidecar = SidecarProcess(tmp_path)
    address = sidecar.address
    sidecar.kill()  # nothing listens on its port now

    result = run_engine(lmcache_py, action="store_retrieve", address=address, seed=2, tokens=PROMPT_TOKENS)

    assert result["lookup"] == 0 and result["retrieved"] == 0
    assert result["ping"] == 14, "UNAVAILABLE"
    assert result["listed"] == []
    assert result["counts"]["put_failures"] == CHUNKS and "stored" not in result["counts"]


def test_a_corrupt_object_is_a_miss_and_the_chunks_before_it_still_load(lmcache_py, sidecar):
    keys = run_engine(lmcache_py, action="keys", address=sidecar.address, seed=3, tokens=PROMPT_TOKENS)
    namespace = Namespace.from_json(keys["namespace"])
    spec = BlockSpec.of(namespace)
    # Plant chunk 1 first, framed right but with one flipped byte: the store's own checksums are
    # those of the corrupt bytes, so only the plugin's check can notice.
    body = np.random.default_rng(0).integers(0, 256, 61 * 256 * 1152, dtype=np.uint8)
    block = np.zeros(spec.block_bytes, np.uint8)
    meta = ObjectMeta(((1, 61, 256, 576),), ("bfloat16",), "KV_MLA_FMT")
    framing.frame(block, key_digest(keys["keys"][1]), body, meta)
    block[framing.HEADER_BYTES + 12345] ^= 0xFF
    with KVStoreClient(sidecar.address) as client:
        client.register_namespace(namespace)
        assert client.put(namespace.id, [key_digest(keys["keys"][1])], [block]).stored == 1

    stored = run_engine(lmcache_py, action="store", address=sidecar.address, seed=3, tokens=PROMPT_TOKENS)
    assert stored["counts"] == {"stored": CHUNKS - 1, "duplicates": 1, "rejected": 0}
    retrieved = run_engine(lmcache_py, action="retrieve", address=sidecar.address, seed=3, tokens=PROMPT_TOKENS)

    assert retrieved["lookup"] == PROMPT_TOKENS, "present is not the same as valid"
    assert retrieved["retrieved"] == 256 and retrieved["exact"], "chunk 0 only, and exactly"
    assert retrieved["counts"]["corrupt"] >= 1


def test_an_engine_that_cannot_map_the_sidecars_memory_gets_the_chunks_from_the_data_plane(lmcache_py, sidecar):
    """shared_memory: false stands for another host: the host-tier chunks stream from the native
    data plane (Get where it was not built), verified like every object."""
    options = {"shared_memory": False}
    stored = run_engine(lmcache_py, action="store", address=sidecar.address, seed=4, tokens=PROMPT_TOKENS,
                        options=options)
    assert stored["counts"] == {"stored": CHUNKS, "duplicates": 0, "rejected": 0}
    retrieved = run_engine(lmcache_py, action="retrieve", address=sidecar.address, seed=4, tokens=PROMPT_TOKENS,
                           options=options)
    assert retrieved["retrieved"] == PROMPT_TOKENS and retrieved["exact"], "all of it, bit for bit"
    assert retrieved["counts"].get("hits_shared_memory", 0) == 0
    assert retrieved["counts"].get("hits_data_plane", 0) == (CHUNKS if dataplane.available() else 0)
    if dataplane.available():
        assert metric(sidecar.get("metrics"), "kvstore_dataplane_sent_bytes_total") > 0


def test_the_plugin_keeps_within_the_limits_its_environment_gives_the_sidecar(lmcache_py, tmp_path, monkeypatch):
    """Before, the plugin kept the default limits: with KVSTORE_MAX_LOOKUP_BLOCKS=2 on the sidecar
    and the engine, every lookup of the 4-chunk prompt was refused, so LMCache never retrieved."""
    monkeypatch.setenv("KVSTORE_MAX_LOOKUP_BLOCKS", "2")  # for the sidecar and the engine alike
    monkeypatch.setenv("KVSTORE_MAX_TRANSFER_BLOCKS", "2")
    sidecar = SidecarProcess(tmp_path)
    try:
        result = run_engine(lmcache_py, action="store_retrieve", address=sidecar.address, seed=3,
                            tokens=PROMPT_TOKENS)
    finally:
        sidecar.stop()
    assert result["counts"]["stored"] == CHUNKS and not result["counts"].get("put_failures")
    assert result["lookup"] == PROMPT_TOKENS
    assert result["retrieved"] == PROMPT_TOKENS and result["exact"]
