"""The store's lock is never held through disk I/O: a demotion copies its victim down between two
holdings of the lock, and a disk eviction only updates the tier's books (``DiskTier.discard``).
A lookup made while a disk write is stuck must therefore be answered, not refused as busy; and a
deletion the books took must still reach the disk (the store's ``Reclaimer``).

The stuck disk is a real disk tier whose record write waits on an event before it writes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvstore.keys import namespace_hashes
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from tests.kvstore.tiers.disk_helpers import REPO
from tests.kvstore.store_helpers import DISK_BLOCK, SLOTS4, host_resident, load_all, put_chain, tokens, until

WAIT_S = 2.0  # far longer than a lookup takes; a lookup that needs more is waiting for the stuck write


class StuckDisk:
    """Make ``disk``'s record writes wait until ``release()``; ``started`` is set by the first."""

    def __init__(self, disk, monkeypatch):
        self.started, self._go = threading.Event(), threading.Event()
        write = disk._write_record

        def stuck(*args):
            self.started.set()
            assert self._go.wait(30), "the stuck write was never released"
            write(*args)

        monkeypatch.setattr(disk, "_write_record", stuck)

    def release(self) -> None:
        self._go.set()


def in_thread(fn, *args) -> threading.Thread:
    thread = threading.Thread(target=fn, args=args, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def stored(make_store, namespace, spec):
    """A store whose 4 host slots hold chain A (on_eviction), so the next put demotes A's tail."""
    store = make_store(**SLOTS4, write_policy="on_eviction", background_writes=False)
    ns_id = store.register_namespace(namespace)
    chain_a = namespace_hashes(namespace, tokens(0, 4))
    put_chain(store, ns_id, spec, chain_a)
    assert host_resident(store, ns_id, chain_a) == [True] * 4
    return store, ns_id, chain_a


def test_a_lookup_is_answered_while_a_demotion_writes_its_victim_to_disk(stored, namespace, spec, monkeypatch):
    store, ns_id, chain_a = stored
    disk = StuckDisk(store.tiers[1], monkeypatch)
    chain_b = namespace_hashes(namespace, tokens(1000, 1))
    putter = in_thread(put_chain, store, ns_id, spec, chain_b)
    try:
        assert disk.started.wait(10), "the put did not demote"
        hit = store.lookup(ns_id, chain_a, wait_s=WAIT_S)
        assert not hit.busy, "the lookup waited for the demotion's disk write"
        assert hit.tiers == ("host",) * 4  # the victim is served from where it is until it has moved
        assert putter.is_alive()
    finally:
        disk.release()
        putter.join(30)
    assert store.lookup(ns_id, chain_a).tiers == ("host",) * 3 + ("disk",)
    assert store.lookup(ns_id, chain_b).tiers == ("host",)
    assert store.stats().tiers[1].demotions_in == 1
    result, _ = load_all(store, ns_id, spec, chain_a)
    assert result.loaded_blocks == 4
    store.check_integrity()


def test_a_victim_leased_while_it_is_demoted_stays_in_its_tier(stored, namespace, spec, monkeypatch):
    store, ns_id, chain_a = stored
    disk = StuckDisk(store.tiers[1], monkeypatch)
    chain_b = namespace_hashes(namespace, tokens(1000, 1))
    outcome = []
    putter = in_thread(lambda: outcome.append(put_chain(store, ns_id, spec, chain_b)[1]))
    try:
        assert disk.started.wait(10)
        lease = store.lookup(ns_id, chain_a, lease_ttl_s=60, wait_s=WAIT_S)
        assert lease.hit_blocks == 4 and lease.lease_id is not None
    finally:
        disk.release()
        putter.join(30)
    # A's tail was copied down but not dropped (a reader holds it); the only other host block
    # that could go is its parent, not a leaf, so B went to disk instead.
    assert outcome[0].stored == 1
    assert host_resident(store, ns_id, chain_a) == [True] * 4
    assert store.tiers[1].contains(ns_id + chain_a[3])
    assert store.lookup(ns_id, chain_b).tiers == ("disk",)
    result, dsts = load_all(store, ns_id, spec, chain_a, lease_id=lease.lease_id)
    assert result.loaded_blocks == 4 and result.tiers == ("host",) * 4
    store.flush()
    store.check_integrity()


def test_a_lookup_is_answered_while_a_full_disk_tier_evicts_behind_a_stuck_write(make_store, namespace, spec,
                                                                                  monkeypatch):
    store = make_store(host_bytes=None, disk_bytes=4 * DISK_BLOCK)
    ns_id = store.register_namespace(namespace)
    chain_a = namespace_hashes(namespace, tokens(0, 4))
    put_chain(store, ns_id, spec, chain_a)
    disk = StuckDisk(store.tiers[0], monkeypatch)
    first, second = (namespace_hashes(namespace, tokens(start, 1)) for start in (1000, 2000))
    stuck = in_thread(put_chain, store, ns_id, spec, first)  # evicts A's tail, then its write sticks
    try:
        assert disk.started.wait(10)
        waiting = in_thread(put_chain, store, ns_id, spec, second)  # evicts again, then waits for the disk
        until(lambda: not store.tiers[0].contains(ns_id + chain_a[2]), WAIT_S)  # (never, were it stuck)
        hit = store.lookup(ns_id, chain_a, wait_s=WAIT_S)
        assert not hit.busy, "the lookup waited for an eviction stuck behind a disk write"
        assert hit.hit_blocks == 2 and waiting.is_alive()
    finally:
        disk.release()
        stuck.join(30)
        waiting.join(30)
    assert store.lookup(ns_id, chain_a).hit_blocks == 2
    assert store.lookup(ns_id, first).hit_blocks == store.lookup(ns_id, second).hit_blocks == 1
    store.flush()
    store.check_integrity()


_DELETE_WHILE_LEASED = """
import sys, time
import numpy as np
from kvstore.keys import namespace_hashes
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from tests.conftest import payloads_for, tiny_namespace
from kvstore.layout import BlockSpec

namespace = tiny_namespace()
store = TieredStore([DiskTier(sys.argv[1], 4 << 20, durable=True)], policy="lru")
ns_id = store.register_namespace(namespace)
hashes = namespace_hashes(namespace, np.arange(16))
store.put(ns_id, hashes, payloads_for(BlockSpec.of(namespace), hashes))
store.flush()
lease = store.lookup(ns_id, hashes, lease_ttl_s=60).lease_id
store.delete_namespace(ns_id)  # leased: its blocks go when the lease ends
store.release(lease)
disk = store.tiers[0]
end = time.monotonic() + 10
while (disk._unindexed or disk._holes) and time.monotonic() < end:
    time.sleep(0.01)
print("pending" if disk._unindexed or disk._holes else "reclaimed", flush=True)
sys.stdin.read()  # killed here
"""


def test_a_namespace_deleted_while_leased_stays_deleted_after_a_crash(tmp_path, namespace):
    """The blocks go at the lease's end, with no write after it: the store's reclaimer must still
    take them out of the disk's index, or a crash would bring them back."""
    path = tmp_path / "disk"
    child = subprocess.Popen([sys.executable, "-c", _DELETE_WHILE_LEASED, str(path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": REPO})
    try:
        line = child.stdout.readline().strip()
        assert line == "reclaimed", f"{line!r}; {child.stderr.read() if not line else ''}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=30)
    store = TieredStore([DiskTier(str(path), 4 << 20)], policy="lru")
    try:
        ns_id = store.register_namespace(namespace)
        assert store.lookup(ns_id, namespace_hashes(namespace, np.arange(16))).hit_blocks == 0
        assert store.stats().tiers[0].blocks == 0
    finally:
        store.close()
