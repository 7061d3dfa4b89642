"""One client process of the sidecar load test: mixed traffic for a bounded time, every byte checked.

    python -m tests.kvstore.service.load_worker TARGET SEED SECONDS

Prints one JSON line: operations done, errors by status code, and payload mismatches (which must
be zero: a load that returns wrong bytes is the one thing a store may never do).
"""

from __future__ import annotations

import collections
import json
import random
import sys
import time

import grpc
import numpy as np

from kvstore.keys import namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.service.client import KVStoreClient
from tests.conftest import payloads_for, tiny_namespace

PROMPTS = 6  # shared by every worker: what one puts, another hits
BLOCKS_PER_PROMPT = 24


def run(target: str, seed: int, seconds: float) -> dict:
    rng = random.Random(seed)
    namespace = tiny_namespace()
    spec = BlockSpec.of(namespace)
    chains = [namespace_hashes(namespace, np.arange(p * 1000, p * 1000 + BLOCKS_PER_PROMPT * namespace.block_size))
              for p in range(PROMPTS)]
    ops: collections.Counter[str] = collections.Counter()
    errors: collections.Counter[str] = collections.Counter()
    mismatches = 0
    deadline = time.monotonic() + seconds
    with KVStoreClient(target, timeout_s=30) as client:
        ns_id = client.register_namespace(namespace)
        while time.monotonic() < deadline:
            chain = rng.choice(chains)
            length = rng.randint(1, len(chain))
            op = rng.choice(["put", "put_shm", "lookup_load", "load_shm", "lookup_release"])
            try:
                if op in ("put", "put_shm"):
                    start = rng.randint(0, length - 1)
                    hashes = chain[start:length][:16]
                    put = client.put if op == "put" else client.put_shm
                    put(ns_id, hashes, payloads_for(spec, hashes), parent=chain[start - 1] if start else None)
                elif op == "lookup_load":
                    hit = client.lookup(ns_id, chain[:length], lease_ttl_s=10)
                    hashes = chain[: min(hit.hit_blocks, 16)]
                    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in hashes]
                    result = client.load(ns_id, hashes, dsts, hit.lease_id)  # ends the lease
                    mismatches += _wrong(dsts[: result.loaded_blocks], payloads_for(spec, hashes))
                elif op == "load_shm":
                    hashes = chain[:length]
                    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in hashes]
                    result = client.load_shm(ns_id, hashes, dsts, verify=rng.random() < 0.5)
                    mismatches += _wrong(dsts[: result.loaded_blocks], payloads_for(spec, hashes))
                else:
                    hit = client.lookup(ns_id, chain[:length], lease_ttl_s=10)
                    if hit.lease_id is not None:
                        client.release(hit.lease_id)
                ops[op] += 1
            except grpc.RpcError as exc:
                errors[exc.code().name] += 1
    return {"ops": dict(ops), "errors": dict(errors), "mismatches": mismatches}


def _wrong(got: list[np.ndarray], expected: list[np.ndarray]) -> int:
    return sum(not np.array_equal(g, e) for g, e in zip(got, expected))


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))), flush=True)
