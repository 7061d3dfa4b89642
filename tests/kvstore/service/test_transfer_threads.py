"""Get and Put streams make their store calls on threads of their own: a disk that hangs holds
those (at most one per transfer slot, each slot kept until its call returns), and every other
call still answers. Before, hung loads took the event loop's shared default executor (six
threads on two CPUs) and the whole sidecar stopped answering: Lookups of host-tier blocks and
Stats ran past their deadlines.

A real server over a real host + disk store; the disk's reads are made to hang."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest

from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits, TransferSlots
from kvstore.service.transfer_threads import DaemonThreadPool, TransferThreads
from kvstore.errors import KVStoreError
from tests.conftest import payloads_for
from tests.connectors.test_store_connector import stall_reads
from tests.kvstore.service.test_serve_process import REPO
from tests.kvstore.store_helpers import until

SLOTS = 3
CLIENTS = 8  # more than the default executor's threads here (min(32, CPUs + 4))


def test_gets_hung_on_the_disk_hold_their_slots_and_every_other_call_answers(make_store, start_server, namespace,
                                                                            spec, chain):
    store = make_store(host_bytes=1 << 20, disk_bytes=8 << 20)
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    store.flush()
    store.close()
    store = make_store(host_bytes=1 << 20, disk_bytes=8 << 20)  # those two on disk only now
    store.register_namespace(namespace)
    hot = payloads_for(spec, chain[2:4])
    store.put(ns_id, chain[2:4], hot)
    unstick = stall_reads(store.tiers[1])
    server = start_server(store, ServiceLimits(max_concurrent_transfers=SLOTS))
    try:
        codes = []
        for _ in range(CLIENTS):  # each engine gives up on its Get of a disk block
            with KVStoreClient(server.target, timeout_s=0.5) as engine:
                with pytest.raises(grpc.RpcError) as failed:
                    engine.load(ns_id, chain[:1], [np.empty(spec.block_bytes, np.uint8)])
                codes.append(failed.value.code())
        assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) == SLOTS
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == CLIENTS - SLOTS, "refused, not queued"
        with KVStoreClient(server.target, timeout_s=3) as other:
            assert other.lookup(ns_id, chain[2:4]).tiers == ("host", "host")
            assert other.stats().tier("host").blocks == 2
            dsts = [np.empty(spec.block_bytes, np.uint8) for _ in range(2)]
            assert other.get_slots(ns_id, chain[2:4]).hit_blocks == 2
        unstick.set()
        with KVStoreClient(server.target, timeout_s=10) as later:  # the slots come back as the reads return
            assert until(lambda: _loads(later, ns_id, chain[:1], spec), timeout_s=10)
            assert later.load(ns_id, chain[2:4], dsts).tiers == ("host", "host")
            assert all(np.array_equal(d, p) for d, p in zip(dsts, hot))
    finally:
        unstick.set()


def _loads(client, ns_id, hashes, spec) -> bool:
    try:
        return len(client.load(ns_id, hashes, [np.empty(spec.block_bytes, np.uint8)]).tiers) == 1  # (promoted on hit)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return False


def test_a_slot_is_released_once_and_only_once():
    slots = TransferSlots(limit=1, per_client=1)
    release = slots.take("a")
    with pytest.raises(KVStoreError, match="max_concurrent_transfers=1"):
        slots.take("b")
    release()
    release()  # again: nothing more
    assert slots.active == 0
    slots.take("b")
    assert slots.active == 1


def test_shutdown_waits_for_the_store_calls_of_ended_gets_then_refuses_new_ones(make_store, start_server, namespace,
                                                                                spec, chain, caplog):
    """A Get whose client gave up leaves its load running on a transfer thread. The server's shutdown
    waited for the event loop's threads only, so the store and the staging area closed under such
    loads. Now ``shutdown`` waits for them (bounded, logged when it gives up) and refuses new calls."""
    store = make_store(host_bytes=None, disk_bytes=8 << 20)
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    unstick = stall_reads(store.tiers[0])
    transfers = TransferThreads.of(ServiceLimits())
    server = start_server(store, transfers=transfers)
    try:
        for block in chain[:2]:  # two loads hang on the disk, their calls past their deadlines
            with KVStoreClient(server.target, timeout_s=0.3) as engine:
                with pytest.raises(grpc.RpcError) as failed:
                    engine.load(ns_id, [block], [np.empty(spec.block_bytes, np.uint8)])
                assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with caplog.at_level("WARNING", logger="kvstore.service.transfer_threads"):
            assert transfers.shutdown(0.2) is False, "gave up on the hung loads"
        assert "2 Get/Put/CommitSlots store calls still run 0.2 s into the shutdown" in caplog.text
        outcome = []
        waiting = threading.Thread(target=lambda: outcome.append(transfers.shutdown(10)))
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive() and not outcome, "waits while the loads still run"
        unstick.set()
        waiting.join(10)
        assert outcome == [True], "returned once the loads had"
        with KVStoreClient(server.target, timeout_s=10) as late:
            with pytest.raises(grpc.RpcError) as refused:
                late.load(ns_id, chain[:1], [np.empty(spec.block_bytes, np.uint8)])
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
    finally:
        unstick.set()


HUNG_AT_EXIT = """
import asyncio, threading
from kvstore.service.limits import ServiceLimits
from kvstore.service.transfer_threads import DaemonThreadPool, TransferThreads

threads = TransferThreads.of(ServiceLimits())
hung = threading.Event()  # never set: a read of a disk that never answers

async def main():
    with threads.stream("c") as stream:
        stream.run(hung.wait)
        done = await stream.run(sum, [1, 2])  # another call runs beside it, on a thread of its own
        print("other call", done, flush=True)

asyncio.run(main())
print("shut down:", threads.shutdown(0.2), flush=True)
"""


def test_a_call_still_hung_after_shutdown_does_not_keep_the_process_from_exiting():
    """Until session 34 the threads were a ThreadPoolExecutor's, which Python joins at exit: a
    sidecar stopped with a Get hung on its disk never exited."""
    done = subprocess.run([sys.executable, "-c", HUNG_AT_EXIT], capture_output=True, text=True, timeout=60,
                          cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 0, done.stderr
    assert "other call 3" in done.stdout and "shut down: False" in done.stdout
    assert "still run 0.2 s into the shutdown" in done.stderr


def test_the_pool_runs_calls_in_order_on_at_most_its_threads_and_carries_their_errors():
    pool = DaemonThreadPool(2, "test-pool")
    gate, names = threading.Event(), set()

    def held():
        names.add(threading.current_thread().name)
        gate.wait(10)
        return "held"

    first, second = pool.submit(held), pool.submit(held)
    third = pool.submit(lambda: 1 / 0)  # waits for a thread: only two
    assert not third.done()
    gate.set()
    assert (first.result(10), second.result(10)) == ("held", "held") and len(names) == 2
    with pytest.raises(ZeroDivisionError):
        third.result(10)
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("test-pool"))
    pool.shutdown()
    assert until(lambda: not any(t.name.startswith("test-pool") for t in threading.enumerate()))
