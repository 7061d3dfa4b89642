"""LMCache engine scenarios the plugin must survive, one per process, for ``test_faults.py``. Run
it with the LMCache environment's python (``conftest.run_engine(..., worker=FAULT_WORKER)`` does):

    python fault_worker.py '{"scenario": "cancelled_gets", "address": "127.0.0.1:PORT", "sidecar_pid": PID}'

A slow sidecar is the real one paused with SIGSTOP (``paused``): its calls wait, then succeed. A
hung disk (``hung_disk``) is one whose reads the test's sidecar holds while a file exists.
Engines have 16 layers (4.7 MB chunks) and ``blocking_timeout_secs`` 1 unless a scenario says
otherwise. Prints one line ``RESULT {json}`` and ends with ``os._exit`` (LMCache's threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import threading
import time

MODEL = "deepseek-ai/DeepSeek-V3"
LAYERS = 16
SLOTS = 4096


class Harness:
    """One engine over the sidecar at ``args["address"]``, its plugin connector and RemoteBackend;
    ``options``: our keys (``plugin_extra_config``), ``extra``: LMCache's own ``extra_config`` keys."""

    def __init__(self, args: dict, blocking_timeout_s: int = 1, cpu_buffer_gb: float = 0.05,
                 options: dict | None = None, **extra):
        import connectors.lmcache  # noqa: F401  (first: the sidecar client beside LMCache's older protobuf)
        from connectors.lmcache import cpu_engine as lmc
        from connectors.lmcache.config import plugin_extra_config

        self.lmc, self.pid = lmc, args["sidecar_pid"]
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

    def store(self, seed: int, tokens: int):
        prompt = self.lmc.make_prompt(seed, tokens, LAYERS)
        puts = self.lmc.PutTracker(self.engine)
        self.lmc.store_prompt(self.engine, prompt, self.lmc.paged_cache(LAYERS, SLOTS),
                              self.lmc.slot_mapping(seed, tokens, SLOTS))
        puts.wait()
        return prompt

    def retrieve(self, prompt) -> dict:
        cache, slots = self.lmc.paged_cache(LAYERS, SLOTS), self.lmc.slot_mapping(99, len(prompt.tokens), SLOTS)
        retrieved = self.lmc.retrieve_prompt(self.engine, prompt, cache, slots)
        return {"retrieved": retrieved, "exact": self.lmc.holds_prompt(cache, slots, prompt, retrieved)}

    def on_loop(self, coroutine, timeout_s: float = 60):
        return asyncio.run_coroutine_threadsafe(coroutine, self.backend.loop).result(timeout_s)

    @contextlib.contextmanager
    def paused(self, seconds: float):
        """The sidecar stopped now and resumed ``seconds`` later (at the latest when the block exits)."""
        os.kill(self.pid, signal.SIGSTOP)
        timer = threading.Timer(seconds, os.kill, (self.pid, signal.SIGCONT))
        timer.start()
        try:
            yield timer
        finally:
            timer.join()
            os.kill(self.pid, signal.SIGCONT)

    def allocate_chunk(self):
        """A full MLA chunk from LMCache's CPU backend, with one reference (the caller's)."""
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        return self.cpu.allocate(torch.Size([1, LAYERS, 256, 576]), torch.bfloat16, MemoryFormat.KV_MLA_FMT)

    def free_pages(self) -> int:
        """Free pages of the paged allocator (``rust_raw_block.use_uring``)."""
        return len(self.cpu.memory_allocator.pin_allocator.free_blocks)

    def active_objects(self) -> int:
        allocator = self.cpu.memory_allocator
        return getattr(allocator, "pin_allocator", allocator).num_active_allocations


def cancelled_gets(args: dict) -> dict:
    """Gets LMCache gives up on (its 1 s timeout against a sidecar paused 2.5 s), three times, with
    the paged allocator LMCache uses for io_uring (pages recycled; a lost one is lost for good);
    then a healthy retrieve that needs 4 of the 6 pages."""
    h = Harness(args, cpu_buffer_gb=6 * 4_718_592 / 1024**3, **{"rust_raw_block.use_uring": True})
    prompt = h.store(7, 1024)
    keys, total = h.keys(7, 1024), h.free_pages()
    calls = [lambda: h.backend.batched_get_blocking(keys),
             lambda: h.on_loop(h.backend.batched_get_non_blocking("lookup", keys)),
             lambda: h.backend.batched_get_blocking(keys)]
    answers, free_after = [], []
    for call in calls:
        with h.paused(2.5):
            answers.append(sum(obj is not None for obj in call()))
        time.sleep(1.0)  # the worker's call returned with the sidecar; what it does after takes ms
        free_after.append(h.free_pages())
    return {"total_pages": total, "answers": answers, "free_after": free_after, **h.retrieve(prompt),
            "free_at_end": h.free_pages(), "counts": h.connector.counts()}


CLOSED_CALLS = {
    "batched_contains": lambda h, keys: h.connector.batched_contains(keys),
    "exists_sync": lambda h, keys: h.connector.exists_sync(keys[0]),
    "batched_get": lambda h, keys: sum(o is not None for o in h.on_loop(h.connector.batched_get(keys))),
    "batched_get_non_blocking": lambda h, keys: len(h.on_loop(h.connector.batched_get_non_blocking("l", keys))),
    "exists": lambda h, keys: h.on_loop(h.connector.exists(keys[0])),
    "batched_async_contains": lambda h, keys: h.on_loop(h.connector.batched_async_contains("l", keys)),
    "ping": lambda h, keys: h.on_loop(h.connector.ping()),
    "list": lambda h, keys: h.on_loop(h.connector.list()),
    "batched_put": lambda h, keys: _put_fresh(h, keys),
}


def _put_fresh(h: Harness, keys: list) -> int:
    """Put one freshly allocated object the way LMCache's wrapper does (its reference dropped after);
    the objects still allocated afterwards."""
    obj = h.allocate_chunk()
    h.on_loop(h.backend.connection.batched_put(keys[:1], [obj]))
    return h.active_objects()


def after_close(args: dict) -> dict:
    """LMCache closes the backend, then makes ``args["calls"]`` (names of ``CLOSED_CALLS``) in order:
    what each answered, or what it raised."""
    h = Harness(args)
    h.store(5, 512)
    keys = h.keys(5, 512)
    h.backend.close()
    answers = {}
    for name in args["calls"]:
        try:
            answers[name] = CLOSED_CALLS[name](h, keys)
        except BaseException as exc:
            answers[name] = f"raised {type(exc).__name__}: {exc}"
    return {"answers": answers, "counts": h.connector.counts()}


def close_during_calls(args: dict) -> dict:
    """With the sidecar paused 3 s, a get in flight on LMCache's loop and a lookup in flight on a
    thread of LMCache's; then LMCache closes the backend from another thread. How long a no-op
    coroutine waited for the loop, how long close took, what the two calls answered (the lookup may
    wait 10 s: ``lookup_timeout_s``)."""
    h = Harness(args, blocking_timeout_s=30, options={"lookup_timeout_s": 10})
    h.store(6, 1024)
    keys, lookup = h.keys(6, 1024), {}
    with h.paused(3.0):
        get = asyncio.run_coroutine_threadsafe(h.connector.batched_get(keys), h.backend.loop)
        looker = threading.Thread(target=lambda: lookup.update(found=h.connector.batched_contains(keys)))
        looker.start()
        time.sleep(0.3)
        started = time.monotonic()
        closer = threading.Thread(target=h.backend.close)
        closer.start()
        time.sleep(0.3)
        tick = time.monotonic()
        h.on_loop(asyncio.sleep(0))
        loop_wait_s = time.monotonic() - tick
        closer.join(60)
        close_s = time.monotonic() - started
    objs = get.result(10)
    looker.join(10)
    got = [obj for obj in objs if obj is not None]
    for obj in got:
        obj.ref_count_down()
    return {"loop_wait_s": loop_wait_s, "close_s": close_s, "get_answer": len(objs), "lookup": lookup.get("found"),
            "active_objects": h.active_objects(), "counts": h.connector.counts()}


def cancelled_put(args: dict) -> dict:
    """A batched put of two objects (all 1.0, all 2.0) cancelled while its first sidecar call waits;
    LMCache's wrapper drops its references at once and LMCache hands the memory out again (all
    -7.0). What each key then serves, and the objects left allocated besides the two new ones."""
    import torch

    h = Harness(args)
    keys = h.keys(3, 512)
    objs = [h.allocate_chunk() for _ in keys]
    for value, obj in enumerate(objs, start=1):
        obj.tensor.fill_(float(value))
    h.connector.session.register()  # the put's first sidecar call is the put itself
    with h.paused(2.0):
        put = asyncio.run_coroutine_threadsafe(h.backend.connection.batched_put(keys, objs), h.backend.loop)
        time.sleep(0.5)
        put.cancel()
        time.sleep(0.2)
        others = [h.allocate_chunk() for _ in keys]  # another request's KV
        for other in others:
            other.tensor.fill_(-7.0)
    time.sleep(1.0)  # the worker's call returned with the sidecar
    served = []
    for obj in h.backend.batched_get_blocking(keys):
        served.append(None if obj is None else torch.unique(obj.tensor.float()).tolist())
        if obj is not None:
            obj.ref_count_down()
    return {"served": served, "active_objects": h.active_objects() - len(others), "counts": h.connector.counts()}


def close_during_puts(args: dict) -> dict:
    """One worker thread and the sidecar paused 2 s: two batched puts of two chunks each, the first
    waiting on the sidecar, the second queued behind it, then LMCache closes the backend (it does
    not wait for its puts). What close counted, which of the four keys the sidecar then holds (a
    client of our own: the plugin's is closed), and the objects left allocated."""
    from connectors.lmcache.framing import key_digest
    from kvstore.service.client import KVStoreClient

    h = Harness(args, options={"workers": 1})
    keys = h.keys(4, 1024)
    objs = [h.allocate_chunk() for _ in keys]
    h.connector.session.register()  # the puts' first sidecar calls are the puts themselves
    with h.paused(2.0):
        puts = [asyncio.run_coroutine_threadsafe(h.backend.connection.batched_put(keys[i : i + 2], objs[i : i + 2]),
                                                 h.backend.loop) for i in (0, 2)]
        time.sleep(0.5)
        h.backend.close()
    for put in puts:
        put.result(10)
    with KVStoreClient(args["address"]) as client:
        held = [client.lookup(h.connector.session.ns_id, [key_digest(key.to_string())]).hit_blocks for key in keys]
    return {"held": held, "active_objects": h.active_objects(), "counts": h.connector.counts()}


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


def built_with(args: dict) -> dict:
    """Per case of ``args["cases"]`` ({name: LMCache config keys}): what building our connector for
    that configuration (as LMCache does, through the adapter) raised, or "built". No engine, and no
    sidecar needed: the connector connects lazily."""
    from lmcache.v1.storage_backend.connector import ConnectorContext

    from connectors.lmcache import cpu_engine as lmc
    from connectors.lmcache.adapter import KVStoreConnectorAdapter
    from connectors.lmcache.config import plugin_extra_config

    loop, answers = asyncio.new_event_loop(), {}
    for name, keys in args["cases"].items():
        config = lmc.lmcache_config({**plugin_extra_config(args["address"]), **keys})
        context = ConnectorContext("plugin://kvstore", loop, None, config, lmc.mla_metadata(MODEL, LAYERS), "kvstore")
        try:
            connector = KVStoreConnectorAdapter().create_connector(context)
        except Exception as exc:
            answers[name] = f"{type(exc).__name__}: {exc}"
        else:
            loop.run_until_complete(connector.close())
            answers[name] = "built"
    return {"answers": answers}


def hung_disk(args: dict) -> dict:
    """A sidecar whose host tier holds two chunks, over a disk whose reads hang while the file
    ``args["hang_file"]`` exists; ``timeout_s`` 1 s (the deadline), ``lookup_timeout_s`` 0.5 s. A
    prompt of 4 chunks laid out host, host, disk, disk; then with the disk hung: a get of all four,
    at once a lookup, a get and a retrieve, and 1.5 s later (past the 1 s back-off the session gives
    a sidecar that stopped answering) a get and a lookup again; the disk back, and the back-off
    window (5 s from the hang at a 1 s deadline) over: a lookup and a retrieve (as a request goes
    through LMCache's scheduler, then its worker), then both again.
    What each answered and how long it took, the tiers before, the counts."""
    from connectors.lmcache.framing import key_digest

    h = Harness(args, blocking_timeout_s=10, options={"timeout_s": 1.0, "lookup_timeout_s": 0.5})
    prompt = h.store(8, 1024)  # the host tier keeps the last two chunks put (LRU); the disk all four
    keys = h.keys(8, 1024)

    def got(objs) -> int:
        for obj in objs:
            if obj is not None:
                obj.ref_count_down()
        return sum(obj is not None for obj in objs)

    def timed(fn) -> list:
        started = time.monotonic()
        answer = fn()
        return [answer, time.monotonic() - started]

    got(h.backend.batched_get_blocking(keys[:2]))  # read from disk into host memory, which drops chunks 2, 3
    digests = [key_digest(key.to_string()) for key in keys]
    tiers = list(h.connector.client.lookup(h.connector.session.ns_id, digests).tiers)
    get = lambda: got(h.backend.batched_get_blocking(keys))  # noqa: E731
    contains = lambda: h.backend.batched_contains(keys)  # noqa: E731
    open(args["hang_file"], "w").close()
    first = timed(get)
    hung_at = time.monotonic()
    window = {"contains": timed(contains), "get": timed(get), "retrieve": timed(lambda: h.retrieve(prompt))}
    time.sleep(1.5)
    window.update(later_get=timed(get), later_contains=timed(contains))
    window_counts = h.connector.counts()
    os.remove(args["hang_file"])
    time.sleep(max(0.0, hung_at + 5.3 - time.monotonic()))
    after = {"contains": timed(contains)}  # as LMCache's scheduler looks the prompt up
    after.update(retrieve=timed(lambda: h.retrieve(prompt)))  # which looks it up again, then gets it
    after.update(contains_again=timed(contains), retrieve_again=timed(lambda: h.retrieve(prompt)))
    return {"tiers": tiers, "first": first, "window": window, "window_counts": window_counts, "after": after,
            "counts": h.connector.counts(), "active_objects": h.active_objects()}


SCENARIOS = {f.__name__: f for f in (cancelled_gets, after_close, close_during_calls, cancelled_put,
                                      close_during_puts, planted_descriptions, built_with, hung_disk)}


if __name__ == "__main__":
    from engine_worker import report  # this script's directory is on sys.path

    args = json.loads(sys.argv[1])
    report(lambda: SCENARIOS[args["scenario"]](args))
