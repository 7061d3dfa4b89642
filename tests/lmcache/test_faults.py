"""The plugin under the faults LMCache and the sidecar put it through: gets and puts LMCache cancels,
calls during and after ``close``, blocks whose description lies about their bytes. Each scenario is
a real LMCache engine in its own process (``fault_worker.py``) over a real sidecar, which the
scenario pauses with SIGSTOP to make it slow."""

from __future__ import annotations

import grpc

from tests.lmcache.conftest import FAULT_WORKER, run_engine

CHUNK = (1, 16, 256, 576)  # a full chunk of the scenarios' 16-layer engines: [1, layers, tokens, 576]
CHUNK_BYTES = 16 * 256 * 1152


def scenario(lmcache_py, sidecar, name: str, **args) -> dict:
    return run_engine(lmcache_py, FAULT_WORKER, scenario=name, address=sidecar.address,
                      sidecar_pid=sidecar.process.pid, **args)


def test_gets_lmcache_gives_up_on_free_their_pages_and_a_later_retrieve_gets_everything(lmcache_py, sidecar):
    result = scenario(lmcache_py, sidecar, "cancelled_gets")

    assert result["total_pages"] == 6
    assert result["answers"] == [0, 0, 0], "LMCache stopped waiting after 1 s each time"
    assert result["free_after"] == [6, 6, 6], "no page held by an object nobody received"
    assert result["retrieved"] == 1024 and result["exact"]
    assert result["free_at_end"] == 6


def test_lookups_on_lmcaches_threads_after_close_are_misses_not_a_crash(lmcache_py, sidecar):
    result = scenario(lmcache_py, sidecar, "after_close", calls=["batched_contains", "exists_sync"])

    assert result["answers"] == {"batched_contains": 0, "exists_sync": False}


def test_every_async_call_after_close_answers_a_miss_and_raises_nothing(lmcache_py, sidecar):
    calls = ["batched_get", "batched_get_non_blocking", "exists", "batched_async_contains", "ping", "list",
             "batched_put"]
    result = scenario(lmcache_py, sidecar, "after_close", calls=calls)

    assert result["answers"] == {"batched_get": 0, "batched_get_non_blocking": 0, "exists": False,
                                 "batched_async_contains": 0, "ping": grpc.StatusCode.CANCELLED.value[0],
                                 "list": [], "batched_put": 0}, "batched_put: 0 objects left allocated"
    assert "call_failures" not in result["counts"]
    assert result["counts"]["put_failures"] == 1, "the put after close stored nothing, and says so"


def test_close_waits_for_the_calls_in_flight_without_holding_lmcaches_loop(lmcache_py, sidecar):
    result = scenario(lmcache_py, sidecar, "close_during_calls")

    assert result["loop_wait_s"] < 0.5, "other backends' coroutines run while close waits"
    assert result["close_s"] > 2.0, "close returned only once the paused sidecar answered the calls in flight"
    assert result["lookup"] == 4, "the lookup in flight was answered, not cut off by a closed channel"
    assert result["get_answer"] == 4 and result["active_objects"] == 0


def test_a_cancelled_put_never_stores_memory_lmcache_handed_out_again(lmcache_py, sidecar):
    result = scenario(lmcache_py, sidecar, "cancelled_put")

    assert result["served"] == [[1.0], None], "the object under way is stored; the next is not, nor -7.0"
    assert result["counts"]["put_failures"] == 1
    assert result["active_objects"] == 0, "the put's own references were dropped once its thread was done"


def test_close_writes_every_put_lmcache_handed_over_before_it_even_one_still_queued(lmcache_py, sidecar):
    result = scenario(lmcache_py, sidecar, "close_during_puts")

    assert result["held"] == [1, 1, 1, 1], "both puts whole: the one under way and the one queued behind it"
    assert result["counts"] == {"stored": 4, "duplicates": 0, "rejected": 0}
    assert result["active_objects"] == 0, "LMCache's references and the puts' own were all dropped"


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


def test_lmcache_settings_whose_objects_are_not_whole_chunks_are_refused_when_the_plugin_is_built(lmcache_py):
    """Layerwise LMCache stores one object per layer and cachegen compressed bytes: the description
    check would make every get of theirs a corrupt miss, so the plugin refuses them up front."""
    cases = {"naive": {}, "layerwise": {"use_layerwise": True}, "cachegen": {"remote_serde": "cachegen"}}
    result = run_engine(lmcache_py, FAULT_WORKER, scenario="built_with", address="127.0.0.1:1", sidecar_pid=0,
                        cases=cases)

    assert result["answers"] == {
        "naive": "built",
        "layerwise": "InvalidRequest: the kvstore plugin stores whole chunks, and LMCache's use_layerwise stores one "
                     "object per layer: set use_layerwise: false, or use another remote backend for layerwise caching",
        "cachegen": "InvalidRequest: the kvstore plugin serves LMCache's chunks as LMCache allocates them, and "
                    "remote_serde 'cachegen' encodes them otherwise: set remote_serde: naive"}
