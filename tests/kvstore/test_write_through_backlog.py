"""Background write-through copies pin their blocks until they are done. ``WRITE_THROUGH_BACKLOG``
bounds how much of a tier such copies may pin, so a slow lower tier slows the puts (their copies
run in the putting thread) instead of leaving the policy only the unpinned blocks, the hot ones,
to evict. The slow tier is a real disk tier whose record writes wait on an event (``StuckDisk``)."""

from __future__ import annotations

from kvstore.keys import namespace_hashes
from kvstore.placement import WRITE_THROUGH_BACKLOG
from tests.kvstore.store_helpers import SLOTS4, host_resident, load_all, put_chain, tokens, until
from tests.kvstore.test_store_lock_io import StuckDisk, in_thread


def second_put_waits_for_the_disk(disk: StuckDisk, put_each, count: int) -> None:
    """Run ``put_each(i)`` for i in range(count) on another thread while ``disk`` is stuck: the
    first put returns (its copy is queued), the second waits for the disk until it is released.
    Then every put has returned."""
    done: list[int] = []

    def serve():
        for i in range(count):
            put_each(i)
            done.append(i)

    putter = in_thread(serve)
    try:
        assert disk.started.wait(10), "the first copy never reached the disk"
        assert until(lambda: len(done) >= 1), "the first put waited for its queued copy"
        putter.join(0.5)
        assert putter.is_alive() and done == [0]  # the second copy runs in the putter, which waits
    finally:
        disk.release()
        putter.join(30)
    assert done == list(range(count))


def test_a_stuck_lower_tier_slows_puts_instead_of_costing_the_hot_block_its_host_slot(
        make_store, namespace, spec, monkeypatch):
    store = make_store(**SLOTS4, write_policy="write_through")  # 4 host slots, copies in the background
    assert WRITE_THROUGH_BACKLOG * 4 < 2  # so queued copies may pin one host block, not two
    ns_id = store.register_namespace(namespace)
    hot = namespace_hashes(namespace, tokens(0, 1))
    put_chain(store, ns_id, spec, hot)
    store.flush()  # the hot block is on disk too, and nothing is pinned
    disk = StuckDisk(store.tiers[1], monkeypatch)
    one_offs = [namespace_hashes(namespace, tokens(1000 * (i + 1), 1)) for i in range(4)]

    def put_one_off(i):
        if i == 2:  # the hot block is read after two one-offs: LRU's victims come in the order 0, 1, hot, 2
            load_all(store, ns_id, spec, hot)
        put_chain(store, ns_id, spec, one_offs[i])

    # the second copy would pin a second block of four: it runs in the putter
    second_put_waits_for_the_disk(disk, put_one_off, len(one_offs))
    store.flush()
    # room for the fourth one-off came from a one-off whose copy had finished, not from the hot block
    assert host_resident(store, ns_id, hot) == [True]
    assert store.lookup(ns_id, hot).tiers == ("host",)
    assert sum(host_resident(store, ns_id, chain)[0] for chain in one_offs) == 3
    assert store._copy_backlog == [0, 0] and store.stats().counters["writes_run_inline"] >= 1
    result, dsts = load_all(store, ns_id, spec, one_offs[3])
    assert result.tiers == ("host",)
    store.check_integrity()


def test_a_copy_that_fails_is_logged_and_lost_not_the_putters_error(make_store, namespace, spec, monkeypatch, caplog):
    store = make_store(**SLOTS4, write_policy="write_through", background_writes=False)  # every copy inline
    ns_id = store.register_namespace(namespace)

    def broken(*args):
        raise RuntimeError("the disk tier broke")

    monkeypatch.setattr(store.tiers[1], "write", broken)
    chain = namespace_hashes(namespace, tokens(0, 2))
    _, result = put_chain(store, ns_id, spec, chain)
    assert result.stored == 2  # stored in the host tier; only the lower copies were lost
    assert store.lookup(ns_id, chain).tiers == ("host", "host")
    assert caplog.text.count("write-through copy to the disk tier failed") == 2
    assert store._copy_backlog == [0, 0] and not any(store._leases.is_pinned(ns_id + h) for h in chain)
    store.check_integrity()


def test_a_tier_whose_blocks_are_each_above_the_share_still_queues_one_copy(make_store, namespace, spec, monkeypatch):
    store = make_store(host_bytes=32 << 10, page_bytes=16 << 10, write_policy="write_through")  # 2 host slots
    assert WRITE_THROUGH_BACKLOG * 2 < 1  # one block alone is above the share
    ns_id = store.register_namespace(namespace)
    disk = StuckDisk(store.tiers[1], monkeypatch)
    chains = [namespace_hashes(namespace, tokens(1000 * i, 1)) for i in range(2)]
    second_put_waits_for_the_disk(disk, lambda i: put_chain(store, ns_id, spec, chains[i]), len(chains))
    store.flush()
    assert store._copy_backlog == [0, 0]
    assert all(store.tiers[1].contains(ns_id + chain[0]) for chain in chains)  # both copies reached the disk
