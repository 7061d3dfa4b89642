"""TieredStore under concurrent puts, leased lookups, loads and releases.

A small host tier (8 slots) and disk tier (48 blocks, 256 KiB segments) keep evictions,
demotions, promotions and segment deletions busy. Every loaded block is compared with the payload
its hash determines, so a block served from the wrong slot, torn by a concurrent eviction or read
after reuse would show up as a mismatch.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from kvstore.errors import UnknownLease
from kvstore.keys import namespace_hashes
from tests.conftest import payloads_for
from tests.kvstore.store_helpers import SLOTS4, host_resident, load_all, put_chain, tokens

THREADS = 5
OPS_PER_THREAD = 400
TIME_LIMIT_S = 1.2  # per run; the op count usually ends it first


def prompts(namespace, seed: int) -> list[list[bytes]]:
    """Overlapping chains: 3 trunks of 8 blocks, each with 4 branches diverging at random depths."""
    rng = random.Random(seed)
    out = []
    for trunk in range(3):
        base = np.arange(trunk * 10_000, trunk * 10_000 + 32)
        out.append(namespace_hashes(namespace, base))
        for branch in range(4):
            toks = base.copy()
            depth = rng.randrange(1, 8)
            toks[depth * 4 :] += 1_000 * (branch + 1)
            out.append(namespace_hashes(namespace, toks))
    return out


@pytest.mark.parametrize("write_policy", ["write_through", "on_eviction"])
def test_randomized_concurrent_traffic_keeps_bytes_and_books_right(make_store, namespace, spec, write_policy):
    store = make_store(host_bytes=128 << 10, page_bytes=16 << 10, disk_bytes=48 * (16 << 10),
                       segment_bytes=256 << 10, write_policy=write_policy)
    ns_id = store.register_namespace(namespace)
    chains = prompts(namespace, seed=7)
    expected = {h: p for c in chains for h, p in zip(c, payloads_for(spec, c))}
    errors: list[BaseException] = []
    checked = [0] * THREADS
    start = threading.Barrier(THREADS)
    deadline = time.monotonic() + TIME_LIMIT_S

    def verify(hashes, dsts, result, me):
        assert result.loaded_blocks <= len(hashes)
        for block_hash, dst in zip(hashes[: result.loaded_blocks], dsts):
            assert np.array_equal(dst, expected[block_hash]), "a load returned wrong bytes"
            checked[me] += 1

    def worker(me: int) -> None:
        rng = random.Random(1000 + me)
        leases: list[tuple[int, list[bytes], int]] = []  # (lease id, hashes, hit blocks)
        try:
            start.wait()
            for _ in range(OPS_PER_THREAD):
                if time.monotonic() > deadline:
                    break
                chain = rng.choice(chains)
                op = rng.random()
                if op < 0.35:  # put a run of the chain, sometimes continuing from a parent
                    first = rng.randrange(0, 4)
                    last = rng.randrange(first + 1, len(chain) + 1)
                    hashes = chain[first:last]
                    parent = chain[first - 1] if first else None
                    result = store.put(ns_id, hashes, [expected[h] for h in hashes], parent=parent)
                    assert result.stored + result.duplicates + result.rejected == len(hashes)
                elif op < 0.55:  # leased lookup, kept for a later load or release
                    hit = store.lookup(ns_id, chain, lease_ttl_s=30)
                    if hit.lease_id is not None:
                        leases.append((hit.lease_id, chain, hit.hit_blocks))
                elif op < 0.75 and leases:  # load under a lease: every leased block must load
                    lease_id, hashes, hits = leases.pop(rng.randrange(len(leases)))
                    dsts = [np.empty(spec.block_bytes, np.uint8) for _ in hashes[:hits]]
                    result = store.load(ns_id, hashes[:hits], dsts, lease_id=lease_id)
                    assert result.complete, f"a leased hit of {hits} loaded only {result.loaded_blocks}"
                    verify(hashes, dsts, result, me)
                elif op < 0.85:  # unleased load: may come up short, never wrong
                    dsts = [np.empty(spec.block_bytes, np.uint8) for _ in chain]
                    verify(chain, dsts, store.load(ns_id, chain, dsts), me)
                elif op < 0.92:  # one layer of one block
                    block_hash = rng.choice(chain)
                    layer = rng.randrange(spec.num_layers)
                    dst = np.empty(spec.layer_bytes, np.uint8)
                    if store.load_layer(ns_id, block_hash, layer, dst) is not None:
                        offset, length = spec.layer_range(layer)
                        assert np.array_equal(dst, expected[block_hash][offset : offset + length])
                        checked[me] += 1
                elif leases:
                    store.release(leases.pop(rng.randrange(len(leases)))[0])
            for lease_id, _, _ in leases:
                store.release(lease_id)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), name=f"stress-{i}") for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    if errors:
        raise errors[0]

    store.flush()
    store.check_integrity()
    stats = store.stats()
    assert stats.leases_active == 0
    with pytest.raises(UnknownLease):
        store.release(1)  # every lease was ended
    assert sum(checked) > 100, "too little traffic to mean anything"
    assert stats.tier("host").evictions > 0 and stats.tier("disk").evictions > 0
    assert stats.tier("disk").checksum_failures == 0 and stats.tier("disk").io_errors == 0

    # what survived is still byte-exact from whichever tier serves it
    for chain in chains:
        hit = store.lookup(ns_id, chain, lease_ttl_s=30)
        dsts = [np.empty(spec.block_bytes, np.uint8) for _ in chain]
        result = store.load(ns_id, chain, dsts, lease_id=hit.lease_id)
        assert result.loaded_blocks >= hit.hit_blocks
        for block_hash, dst in zip(chain[: result.loaded_blocks], dsts):
            assert np.array_equal(dst, expected[block_hash])
    store.flush()
    store.check_integrity()


def test_two_loads_promoting_the_same_block_at_once(make_store, namespace, spec):
    """Both loads read the disk copy before either promotes it; the host takes it once."""
    store = make_store(**SLOTS4, background_writes=False)
    ns_id = store.register_namespace(namespace)
    a = namespace_hashes(namespace, tokens(0, 4))
    payloads, _ = put_chain(store, ns_id, spec, a)
    put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(100, 1)))  # a3: disk only
    assert store.lookup(ns_id, a).tiers[3] == "disk"

    disk, host = store.tiers[1], store.tiers[0]
    both_read = threading.Barrier(2, timeout=10)
    real_read, real_write = disk.read, host.write

    def read_then_wait(*args, **kw):
        ok = real_read(*args, **kw)
        both_read.wait()
        return ok

    def slow_write(*args, **kw):
        time.sleep(0.05)  # widen the window between making room and publishing
        return real_write(*args, **kw)

    disk.read, host.write = read_then_wait, slow_write
    results, errors = [], []

    def load():
        try:
            dst = np.zeros(spec.block_bytes, np.uint8)
            results.append((store.load(ns_id, a[3:], [dst]), dst))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    disk.read, host.write = real_read, real_write
    if errors:
        raise errors[0]
    for result, dst in results:
        assert result.tiers == ("disk",)
        np.testing.assert_array_equal(dst, payloads[3])
    assert store.lookup(ns_id, a).tiers[3] == "host"
    assert store.stats().tier("host").promotions_in == 1
    store.check_integrity()


def own_ancestors(store) -> set[bytes]:
    """Resident blocks that are their own ancestors, walking parents through every tier's records."""
    parents = {key: meta.parent for tier in store.tiers for key, meta in tier.items()}

    def ancestors(key: bytes) -> set[bytes]:
        seen: set[bytes] = set()
        while (key := parents.get(key)) is not None and key not in seen:
            seen.add(key)
        return seen

    return {key for key in parents if key in ancestors(key)}


@pytest.mark.parametrize("disk_bytes", [None, 4 << 20], ids=["host", "host_and_disk"])
def test_two_racing_puts_that_would_make_a_loop_store_one_block(make_store, namespace, spec, disk_bytes):
    """``put([A], parent=B)`` and ``put([B], parent=A)`` both start while neither block is resident,
    so both pass the check at the start of a put, and both write at once. The second to publish is
    rejected in every tier, so no block is its own ancestor and filling the host evicts both."""
    store = make_store(**SLOTS4, disk_bytes=disk_bytes, background_writes=False)
    ns_id = store.register_namespace(namespace)
    a, b = namespace_hashes(namespace, tokens(0, 2))
    host = store.tiers[0]
    both_writing = threading.Barrier(2, timeout=10)
    real_write = host.write

    def write_when_both_are_writing(*args, **kw):
        both_writing.wait()  # both puts are past every check made before the bytes are written
        return real_write(*args, **kw)

    host.write = write_when_both_are_writing
    results, errors = {}, []

    def put(block: bytes, parent: bytes) -> None:
        try:
            results[block] = put_chain(store, ns_id, spec, [block], parent=parent)[1]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=put, args=pair) for pair in ((a, b), (b, a))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    host.write = real_write
    if errors:
        raise errors[0]

    assert own_ancestors(store) == set()
    assert sorted((r.stored, r.rejected) for r in results.values()) == [(0, 1), (1, 0)]
    assert store.stats().rejected_blocks == 1
    loser = a if results[a].rejected else b
    assert not any(tier.contains(ns_id + loser) for tier in store.tiers), "a rejected block left bytes behind"
    for i in range(1, 6):  # five one-block prompts through four slots
        assert put_chain(store, ns_id, spec, namespace_hashes(namespace, tokens(1000 * i, 1)))[1].stored == 1
    assert host_resident(store, ns_id, [a, b]) == [False, False]
    store.check_integrity()


def gate_writes_of(store, key: bytes, result: bool | None = None, thread_name: str | None = None):
    """Make the host tier's writes of ``key`` (by the thread named ``thread_name``, if given) wait
    until the returned ``release`` event is set (``entered`` is set once one waits); then the write
    runs, or returns ``result`` if given (a medium refusing it)."""
    host, entered, release = store.tiers[0], threading.Event(), threading.Event()
    write = host.write

    def gated(k, payload, meta):
        if k == key and thread_name in (None, threading.current_thread().name):
            entered.set()
            assert release.wait(10)
            if result is not None:
                return result
        return write(k, payload, meta)

    host.write = gated
    return entered, release


def test_a_put_begun_before_delete_namespace_stores_none_of_its_later_blocks(make_store, namespace, spec):
    """delete_namespace ran while a put was writing its first block: that block was buried, but
    the put went on to store the rest, resident (and hit) in a namespace just deleted."""
    store = make_store(disk_bytes=None)
    ns_id = store.register_namespace(namespace)
    hashes = namespace_hashes(namespace, tokens(0, 4))
    entered, release = gate_writes_of(store, ns_id + hashes[0])
    results = []
    putting = threading.Thread(target=lambda: results.append(put_chain(store, ns_id, spec, hashes)[1]))
    putting.start()
    assert entered.wait(10)
    assert store.delete_namespace(ns_id) == 0  # nothing was resident yet
    release.set()
    putting.join(10)
    assert results[0].rejected == 3, "the blocks the put had not begun"
    assert not any(store.holds(ns_id, h) for h in hashes) and store.tiers[0].stats().blocks == 0
    assert store.lookup(ns_id, hashes[1:]).hit_blocks == 0
    assert put_chain(store, ns_id, spec, hashes)[1].stored == 4, "a put begun after the deletion stores"
    store.check_integrity()


def test_a_block_another_put_is_writing_is_waited_for_not_called_a_duplicate(make_store, namespace, spec):
    """Put B of [X, Y] came while put A was writing X: B counted X a duplicate and stored Y below it.
    A's write of X then failed, so B's answer was wrong and Y hung below a block no tier held, where
    no lookup reaches it. Now B waits for A's outcome, and stores X itself when A could not."""
    store = make_store(disk_bytes=None)
    ns_id = store.register_namespace(namespace)
    x_and_y = namespace_hashes(namespace, tokens(0, 2))
    entered, release = gate_writes_of(store, ns_id + x_and_y[0], result=False, thread_name="A")
    results = {}
    a = threading.Thread(target=lambda: results.update(a=put_chain(store, ns_id, spec, x_and_y[:1])[1]), name="A")
    a.start()
    assert entered.wait(10)
    b = threading.Thread(target=lambda: results.update(b=put_chain(store, ns_id, spec, x_and_y)[1]))
    b.start()
    time.sleep(0.2)
    assert "b" not in results, "B waits while A writes X"
    release.set()
    a.join(10)
    b.join(10)
    assert results["a"].rejected == 1
    assert (results["b"].stored, results["b"].duplicates) == (2, 0)
    assert store.lookup(ns_id, x_and_y).hit_blocks == 2
    store.check_integrity()


@pytest.mark.parametrize("write_policy", ["on_eviction", "write_through"])
def test_every_policy_call_is_made_under_the_store_lock(make_store, namespace, spec, write_policy):
    """Policies are not thread-safe; ``admit`` was called without the lock, and HitDensity's changes
    state (its insertion run, its leaf arrays) that another thread's eviction could change beneath it."""
    store = make_store(**SLOTS4, disk_bytes=8 * 16 << 10, policy="adaptive", write_policy=write_policy,
                       background_writes=False)
    ns_id = store.register_namespace(namespace)
    unlocked = []
    calls = ("on_insert", "on_access", "on_remove", "victims", "admit", "on_bypass", "on_stored_elsewhere",
             "on_move_in", "admits_demotion", "on_hit_elsewhere")
    for policy in store._policies:
        for name in calls:
            def checked(*args, _call=getattr(policy, name), _name=name, **kwargs):
                if not store._lock._is_owned():
                    unlocked.append(_name)
                return _call(*args, **kwargs)
            setattr(policy, name, checked)
    for i in range(12):  # more blocks than both tiers hold: evictions, demotions and promotions
        hashes = namespace_hashes(namespace, tokens(100 * (i % 6), 2))
        put_chain(store, ns_id, spec, hashes)
        load_all(store, ns_id, spec, hashes[:store.lookup(ns_id, hashes).hit_blocks])
    assert store.stats().tier("host").evictions > 0
    assert unlocked == []
