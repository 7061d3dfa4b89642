"""The plugin under the faults LMCache and the sidecar put it through: blocks whose description lies
about their bytes. Each scenario is a real LMCache engine in its own process (``fault_worker.py``)
over a real sidecar."""

from __future__ import annotations

from tests.lmcache.conftest import FAULT_WORKER, run_engine

CHUNK = (1, 16, 256, 576)  # a full chunk of the scenarios' 16-layer engines: [1, layers, tokens, 576]
CHUNK_BYTES = 16 * 256 * 1152


def scenario(lmcache_py, sidecar, name: str, **args) -> dict:
    return run_engine(lmcache_py, FAULT_WORKER, scenario=name, address=sidecar.address, **args)


WRONG_DESCRIPTIONS = {  # [shapes, dtypes, format, body bytes], every body checksummed right
    "transposed shape": [[[1, 16, 576, 256]], ["bfloat16"], "KV_MLA_FMT", CHUNK_BYTES],
    "another dtype": [[[1, 16, 256, 1152]], ["uint8"], "KV_MLA_FMT", CHUNK_BYTES],
    "binary buffer": [[[CHUNK_BYTES]], ["uint8"], "BINARY_BUFFER", CHUNK_BYTES],
    "undefined format": [[list(CHUNK)], ["bfloat16"], "UNDEFINED", CHUNK_BYTES],
    "negative dims": [[[-1, -16, 256, 576]], ["bfloat16"], "KV_MLA_FMT", CHUNK_BYTES],
    "more tokens than a chunk": [[[1, 16, 257, 576]], ["bfloat16"], "KV_MLA_FMT", 16 * 257 * 1152],
    "two groups": [[list(CHUNK), list(CHUNK)], ["bfloat16", "bfloat16"], "KV_MLA_FMT", CHUNK_BYTES],
}
SHORT_CHUNK = [[[1, 16, 100, 576]], ["bfloat16"], "KV_MLA_FMT", 16 * 100 * 1152]  # a prompt's last chunk


def test_a_description_this_lmcache_never_writes_is_a_corrupt_miss_after_the_chunk_before_it(lmcache_py, sidecar):
    cases = {**WRONG_DESCRIPTIONS, "short last chunk": SHORT_CHUNK}
    planted = scenario(lmcache_py, sidecar, "planted_descriptions", cases=cases)
    result = planted["results"]

    for name in WRONG_DESCRIPTIONS:
        assert result[name]["loaded"] == [True, False], name
        assert result[name]["moved"].get("corrupt") == 1 and "call_failures" not in result[name]["moved"], name
    assert result["short last chunk"]["loaded"] == [True, True]
    assert "corrupt" not in result["short last chunk"]["moved"]
    assert planted["active_objects"] == 0
