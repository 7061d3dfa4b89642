"""One LMCache engine in its own process, for the plugin's tests. Run it with the LMCache
environment's python (``conftest.run_engine`` does):

    python engine_worker.py '{"action": "store", "address": "127.0.0.1:PORT", "seed": 1}'

Actions: ``keys`` (the prompt's LMCache keys, nothing stored), ``store``, ``retrieve`` (into a
fresh paged cache at other slots) or ``store_retrieve``. Every action reports the plugin's counts,
``ping`` and ``list`` too. Prints one line ``RESULT {json}`` and ends with ``os._exit``: LMCache
leaves non-daemon threads running.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback

MODEL = "deepseek-ai/DeepSeek-V3"
SLOTS = 4096  # the paged cache's size in tokens


def run(args: dict) -> dict:
    import connectors.lmcache  # noqa: F401  (first: the sidecar client beside LMCache's older protobuf)
    from connectors.lmcache import cpu_engine as lmc
    from connectors.lmcache.config import plugin_extra_config

    layers, tokens, seed = args.get("layers", 61), args.get("tokens", 1000), args["seed"]
    config = lmc.lmcache_config(plugin_extra_config(args["address"], **args.get("options", {})),
                                cpu_buffer_gb=0.25)
    engine = lmc.build_engine(args["action"], config, lmc.mla_metadata(MODEL, layers))
    connector = lmc.plugin_connector(engine)
    prompt = lmc.make_prompt(seed, tokens, layers)
    result: dict = {"namespace": connector.namespace.canonical_json(), "runtime": runtime()}
    if args["action"] == "keys":
        result["keys"] = [key.to_string() for _, _, key in engine.token_database.process_tokens(prompt.tokens)]
    if args["action"] in ("store", "store_retrieve"):
        puts = lmc.PutTracker(engine)
        lmc.store_prompt(engine, prompt, lmc.paged_cache(layers, SLOTS), lmc.slot_mapping(seed, tokens, SLOTS))
        puts.wait()
    if args["action"] in ("retrieve", "store_retrieve"):
        result["lookup"] = engine.lookup(prompt.tokens)
        slots = lmc.slot_mapping(seed + 1, tokens, SLOTS)  # not where the storing engine had them
        cache = lmc.paged_cache(layers, SLOTS)
        result["retrieved"] = lmc.retrieve_prompt(engine, prompt, cache, slots)
        result["exact"] = lmc.holds_prompt(cache, slots, prompt, result["retrieved"])
    loop = lmc.remote_backends(engine)[0].loop
    result["ping"] = asyncio.run_coroutine_threadsafe(connector.ping(), loop).result(30)
    result["listed"] = asyncio.run_coroutine_threadsafe(connector.list(), loop).result(30)
    result["counts"] = connector.counts()
    return result


def runtime() -> dict:
    """The protobuf and grpcio this process runs, and whose KVStoreStub the sidecar client got."""
    import google.protobuf
    import grpc
    from kvstore.service.v1 import kvstore_pb2_grpc

    return {"protobuf": google.protobuf.__version__, "grpcio": grpc.__version__,
            "stub": kvstore_pb2_grpc.KVStoreStub.__module__}


def report(compute) -> None:
    """Print ``RESULT`` and the JSON of ``compute()`` and exit 0, or print the traceback and exit 1;
    ``os._exit``, so no thread LMCache left running holds the process."""
    code = 0
    try:
        print("RESULT " + json.dumps(compute()), flush=True)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    report(lambda: run(json.loads(sys.argv[1])))
