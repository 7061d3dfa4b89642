"""SidecarConnector against a real sidecar (grpc.aio server over a real host + disk store).

Each connector has its own client, as each engine process would: what one saves, another loads.
"""

import logging
import shutil
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

from connectors.base import ConnectorHit, LoadFailed
from connectors.factory import OwningStoreConnector, connector_from_config
from connectors.sidecar_connector import SidecarConnector
from connectors.store_connector import StoreConnector
from kvstore.errors import InvalidRequest
from kvstore.keys import namespace_hashes
from kvstore.service import dataplane, wire
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.service.v1 import kvstore_pb2 as pb
from tests.connectors.sidecar_server import unused_address
from tests.connectors.test_store_connector import NS, SPEC, BytePool, stall_reads


def test_what_one_engine_saves_another_loads_layer_by_layer_byte_exact(make_store, sidecars, connectors, hashes):
    store = make_store()
    sidecar = sidecars(store)
    producer, consumer = connectors(sidecar.target, NS), connectors(sidecar.target, NS)
    assert producer.client is not consumer.client
    source = BytePool(8, seed=1)
    producer.save("a", hashes, [2, 3, 4, 5, 6, 7], source, parent=None)
    producer.flush()
    assert store.stats().stored_blocks == 6

    hit = consumer.lookup("b", hashes)
    assert hit.blocks == 6 and hit.tokens == 24 and set(hit.tiers) == {"host"}
    assert store.stats().leases_active == 1
    target = BytePool(8)
    handle = consumer.start_load(hit, hashes, [7, 6, 5, 4, 3, 2], target)
    for layer in range(SPEC.num_layers):
        handle.wait_layer(layer)
        for src_page, dst_page in zip([2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2]):
            assert torch.equal(target.layer_page_bytes(layer, dst_page), source.layer_page_bytes(layer, src_page))
    assert handle.wait() == 6
    assert store.stats().leases_active == 0, "the load ends the lookup's lease"
    assert store.stats().tier("host").loaded_blocks >= 6


def test_same_host_saves_and_loads_go_through_shared_memory_and_prefills_reach_the_metrics(make_store, sidecars,
                                                                                          connectors, hashes):
    sidecar = sidecars(make_store())
    producer, consumer = connectors(sidecar.target, NS), connectors(sidecar.target, NS)
    source = BytePool(8, seed=3)
    producer.save("a", hashes, [1, 2, 3, 4, 5, 6], source, parent=None)
    producer.flush()
    assert sidecar.staging.active() == 0 and sidecar.store.stats().stored_blocks == 6

    hit = consumer.lookup("b", hashes)
    target = BytePool(8)
    assert consumer.start_load(hit, hashes, [6, 5, 4, 3, 2, 1], target).wait() == 6
    for layer in range(SPEC.num_layers):
        for src_page, dst_page in zip([1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1]):
            assert torch.equal(target.layer_page_bytes(layer, dst_page), source.layer_page_bytes(layer, src_page))
    consumer.report_prefill("b", saved_tokens=24, computed_tokens=5)
    consumer.close()  # waits for the report

    totals = sidecar.metrics.totals()
    label = ("namespace", f"{NS.model}/{NS.id.hex()[:8]}")
    assert totals["kvstore_loaded_tokens_total"][(("path", "shm"), ("tier", "host"))] == 24
    assert (("path", "bytes"), ("tier", "host")) not in totals["kvstore_loaded_tokens_total"], "no bytes over gRPC"
    assert totals["kvstore_prefill_tokens_saved_total"][(label,)] == 24
    assert totals["kvstore_prefill_tokens_computed_total"][(label,)] == 5
    assert sidecar.store.stats().leases_active == 0


@pytest.mark.parametrize("data_plane", [
    pytest.param(True, marks=pytest.mark.skipif(not dataplane.available(), reason="the data plane was not built")),
    False,
])
def test_an_engine_on_another_host_loads_through_the_data_plane_or_get(make_store, sidecars, connectors, data_plane):
    """A client that cannot map the sidecar's segment (shared_memory=False stands for another host):
    the host-tier blocks stream from the native data plane in batches of max_transfer_blocks, or
    come through Get where the sidecar runs none; the pages are the same either way."""
    limits = ServiceLimits(max_transfer_blocks=4)
    sidecar = sidecars(make_store(), limits=limits, data_plane=data_plane)
    hashes = namespace_hashes(NS, np.arange(4 * 10))  # 10 blocks: streams of 4 + 4 + 2
    producer = connectors(sidecar.target, NS, limits=limits)
    source = BytePool(10, seed=4)
    producer.save("a", hashes, range(10), source, parent=None)
    producer.flush()
    with KVStoreClient(sidecar.target, limits=limits, shared_memory=False) as remote:
        consumer = connectors(remote, NS, limits=limits)
        hit = consumer.lookup("b", hashes)
        target = BytePool(10)
        assert consumer.start_load(hit, hashes, list(reversed(range(10))), target).wait() == 10
        for layer in range(SPEC.num_layers):
            for page in range(10):
                assert torch.equal(target.layer_page_bytes(layer, 9 - page), source.layer_page_bytes(layer, page))
        consumer.close()
    loaded = sidecar.metrics.totals()["kvstore_loaded_tokens_total"]
    if data_plane:
        assert sidecar.data_plane.counters().bytes_sent == 10 * SPEC.block_bytes
        assert sidecar.data_plane.counters().calls == 3 and sidecar.data_plane.counters().live_grants == 0
        assert (("path", "bytes"), ("tier", "host")) not in loaded, "no payload bytes through Python's Get"
        exported = sidecar.metrics.registry.get_sample_value
        assert exported("kvstore_dataplane_sent_bytes_total") == 10 * SPEC.block_bytes
        assert exported("kvstore_dataplane_calls_total") == 3 and exported("kvstore_dataplane_grants") == 0
    else:
        assert loaded[(("path", "bytes"), ("tier", "host"))] == 40
    assert sidecar.store.stats().leases_active == 0


@pytest.mark.parametrize("limits", [ServiceLimits(max_transfer_blocks=4, max_lookup_blocks=8),
                                    ServiceLimits(max_transfer_bytes=4 * SPEC.block_bytes + 1, max_lookup_blocks=8)],
                         ids=["blocks", "bytes"])
def test_long_saves_and_loads_are_split_at_the_transfer_limit(make_store, sidecars, connectors, limits):
    store = make_store()
    sidecar = sidecars(store, limits=limits)
    hashes = namespace_hashes(NS, np.arange(4 * 10))  # 10 blocks: Put and Get calls of 4 + 4 + 2
    producer, consumer = connectors(sidecar.target, NS, limits=limits), connectors(sidecar.target, NS, limits=limits)
    source = BytePool(10, seed=2)
    producer.save("a", hashes, range(10), source, parent=None)
    producer.flush()
    assert store.stats().stored_blocks == 10 and store.stats().puts == 3

    hit = consumer.lookup("b", hashes)
    assert hit.blocks == 8, "a lookup past max_lookup_blocks is cut to a prefix, not refused"
    target = BytePool(10)
    handle = consumer.start_load(hit, hashes, range(8), target)
    handle.wait_layer(SPEC.num_layers - 1)
    assert handle.wait() == 8
    for layer in range(SPEC.num_layers):
        assert torch.equal(target.layers[layer][:8], source.layers[layer][:8])
        assert not target.layers[layer][8:].any()
    assert store.stats().leases_active == 0


def test_a_save_stops_at_the_first_batch_the_store_rejects(make_store, sidecars, connectors):
    """Rejected blocks are not stored: before, the next batches were sent under them, stored
    (room made meanwhile) below a missing parent, where no lookup reaches them."""
    limits = ServiceLimits(max_transfer_blocks=4)
    store = make_store(host_bytes=2 * (64 << 10), disk_bytes=None)  # room for 6 blocks (3 a page)
    sidecar = sidecars(store, limits=limits)
    producer = connectors(sidecar.target, NS, limits=limits)
    pinned = namespace_hashes(NS, np.arange(100, 108))  # 2 blocks, leased below
    producer.save("p", pinned, [0, 1], BytePool(2, seed=1), parent=None)
    producer.flush()
    assert producer.lookup("pin", pinned).blocks == 2
    puts = store.stats().puts
    producer.save("a", namespace_hashes(NS, np.arange(4 * 10)), range(10), BytePool(10, seed=2), parent=None)
    producer.flush()
    # the first batch of 4 fills the room; the second is rejected (a parent is never evicted to
    # make room for its child); the third is not sent
    assert store.stats().rejected_blocks == 4
    assert store.stats().puts == puts + 2, "the batches after a rejected one are not sent"
    producer.release("pin")


def test_a_sidecar_that_is_down_is_a_miss_and_a_failed_load_never_an_exception(connectors, hashes, caplog):
    with caplog.at_level(logging.WARNING):
        connector = connectors(unused_address(), NS, timeout_s=5)
        assert connector.lookup("a", hashes).blocks == 0
        assert connector.lookup("a", hashes).blocks == 0
        connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=3), parent=None)
        connector.flush()  # logged and dropped
        assert connector._saves.failed_saves == 1, "a save the sidecar never got is a failed save, not a success"
        handle = connector.start_load(ConnectorHit("a", 2, NS.block_size, ("host", "host")), hashes, [0, 1],
                                      BytePool(2))
        with pytest.raises(LoadFailed):
            handle.wait_layer(0)
        assert handle.wait() == 0
        connector.release("a")
    assert sum("serves without it" in r.getMessage() for r in caplog.records) == 1, "one warning, not one per call"


def test_a_sidecar_laying_out_blocks_otherwise_is_never_registered_and_every_call_a_miss(make_store, sidecars,
                                                                                        connectors, hashes, caplog,
                                                                                        monkeypatch):
    """A sidecar of another version gives the namespace's blocks another layout (here 64 bytes more
    a layer). Registration compared the namespace id alone, so the connector moved blocks it
    would cut at the wrong offsets. Now registration fails naming both layouts, and every call
    that needs the namespace is a miss: nothing is leased, loaded or stored."""
    def skewed(ns_id, spec):
        return pb.RegisterNamespaceResponse(namespace_id=ns_id, block_bytes=spec.block_bytes + 64 * spec.num_layers,
                                            layer_bytes=spec.layer_bytes + 64, num_layers=spec.num_layers,
                                            block_size=spec.block_size)

    monkeypatch.setattr(wire, "registered", skewed)
    store = make_store()
    ns_id = store.register_namespace(NS)
    store.put(ns_id, hashes[:2], [np.full(SPEC.block_bytes, 7, np.uint8)] * 2)
    with caplog.at_level(logging.WARNING):
        connector = connectors(sidecars(store).target, NS, timeout_s=5)
        assert connector.lookup("a", hashes).blocks == 0
        connector.save("a", hashes[2:4], [0, 1], BytePool(2, seed=3), parent=hashes[1])
        connector.flush()
    assert store.stats().leases_active == 0 and store.stats().stored_blocks == 2
    assert f"{SPEC.num_layers} layers of {SPEC.layer_bytes + 64} bytes" in caplog.text
    assert f"this side as {SPEC.num_layers} layers of {SPEC.layer_bytes} bytes" in caplog.text
    assert "different versions" in caplog.text


def test_a_sidecar_that_dies_after_the_lookup_fails_the_load(make_store, sidecars, connectors, hashes):
    sidecar = sidecars(make_store())
    connector = connectors(sidecar.target, NS, timeout_s=5)
    connector.save("a", hashes[:3], [0, 1, 2], BytePool(3, seed=4), parent=None)
    connector.flush()
    hit = connector.lookup("b", hashes)
    assert hit.blocks == 3
    sidecar.stop()
    handle = connector.start_load(hit, hashes, [0, 1, 2], BytePool(3))
    with pytest.raises(LoadFailed):
        handle.wait_layer(SPEC.num_layers - 1)
    assert handle.wait() == 0
    assert connector.lookup("c", hashes).blocks == 0


def test_a_load_from_a_hung_sidecar_is_given_up_at_its_deadline_and_never_writes_late(make_store, sidecars,
                                                                                      connectors, hashes):
    store = make_store()
    sidecar = sidecars(store)
    connector = connectors(sidecar.target, NS, timeout_s=20, load_timeout_s=0.5)
    connector.save("a", hashes[:3], [0, 1, 2], BytePool(3, seed=9), parent=None)
    connector.flush()
    hit = connector.lookup("b", hashes)
    assert hit.blocks == 3
    unstick = threading.Event()
    sidecar.loop.call_soon_threadsafe(unstick.wait, 30)  # the sidecar stops answering
    target = BytePool(3)
    started = time.monotonic()
    handle = connector.start_load(hit, hashes, [0, 1, 2], target)
    with pytest.raises(LoadFailed, match="deadline"):
        handle.wait_layer(0)
    assert 0.45 <= time.monotonic() - started < 10, "the engine waited for the sidecar, not the deadline"
    assert handle.wait() == 0
    for layer in target.layers:  # the engine recomputes into the same pages
        layer.fill_(0xAB)
    unstick.set()
    deadline = time.monotonic() + 10
    while store.stats().leases_active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.stats().leases_active == 0, "the load gives back its slots and lease once the sidecar answers"
    assert all(bool((layer == 0xAB).all()) for layer in target.layers), "a late load overwrote recomputed pages"


def test_a_disk_hung_in_the_sidecar_costs_one_load_a_deadline_then_hits_stop_at_memory(make_store, sidecars,
                                                                                      connectors, hashes):
    """The sidecar answers but its disk reads hang. Before, every load of a disk hit waited out
    its whole deadline (the engine's step with it): the connector had no back-off below memory."""
    store = make_store()
    saver = connectors(sidecars(store).target, NS)
    saver.save("a", hashes, range(6), BytePool(6, seed=8), parent=None)
    saver.flush()
    store.flush()
    store.close()
    store = make_store()  # the blocks are on disk only, as after a restart
    sidecar = sidecars(store)
    connector = connectors(sidecar.target, NS, load_timeout_s=0.3)
    hit = connector.lookup("b", hashes)
    assert hit.blocks == 6 and set(hit.tiers) == {"disk"}
    unstick = stall_reads(store.tiers[1])
    started = time.monotonic()
    with pytest.raises(LoadFailed, match="deadline"):
        connector.start_load(hit, hashes, range(6), BytePool(6)).wait_layer(0)
    assert 0.27 <= time.monotonic() - started < 5
    assert connector.lookup("c", hashes).blocks == 0, "right after a disk read hung, hits stop at memory"
    unstick.set()
    fresh = connectors(sidecar.target, NS)  # this connector skips the disk for its window; the sidecar serves
    again = fresh.lookup("d", hashes)
    assert fresh.start_load(again, hashes, range(6), BytePool(6)).wait() == 6, "the sidecar serves again"


def test_a_hung_sidecar_costs_one_short_lookup_then_misses_at_once_until_it_answers(make_store, sidecars, connectors,
                                                                                     hashes, caplog):
    """Lookups are on the engine's scheduling path: a sidecar that stops answering (its event loop
    blocked here) must not stall every request for the call timeout. The first lookup ends at
    ``lookup_timeout_s``; later ones are misses without a call until a probe finds it back."""
    sidecar = sidecars(make_store())
    connector = connectors(sidecar.target, NS, timeout_s=20, lookup_timeout_s=0.3)
    connector.save("a", hashes[:3], [0, 1, 2], BytePool(3, seed=12), parent=None)
    connector.flush()
    assert connector.lookup("warm", hashes).blocks == 3
    unstick = threading.Event()
    sidecar.loop.call_soon_threadsafe(unstick.wait, 30)
    started = time.monotonic()
    assert connector.lookup("r0", hashes).blocks == 0
    assert 0.27 <= time.monotonic() - started < 5
    started = time.monotonic()
    for i in range(20):
        assert connector.lookup(f"r{i + 1}", hashes).blocks == 0
    assert time.monotonic() - started < 0.5, "lookups kept waiting on the hung sidecar"
    started = time.monotonic()
    connector.release("warm")  # its lease ends at its TTL instead
    assert time.monotonic() - started < 0.5, "a release waited on the hung sidecar"
    with caplog.at_level(logging.ERROR):
        connector.save("b", hashes[3:5], [0, 1], BytePool(2, seed=13), parent=hashes[2])
        connector.flush()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a skipped save logged an error"
    unstick.set()
    deadline = time.monotonic() + 20
    while connector.lookup("back", hashes).blocks != 3:
        assert time.monotonic() < deadline, "the sidecar answers again but lookups still miss"
        time.sleep(0.1)


@pytest.fixture
def socket_dir():
    """A directory for a unix socket, short enough for its path limit (pytest's tmp_path is not)."""
    directory = tempfile.mkdtemp(prefix="kvs-")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_a_restarted_sidecar_is_used_again_and_gets_the_namespace_again(make_store, sidecars, connectors, hashes,
                                                                       socket_dir):
    address = f"unix:{socket_dir}/sidecar.sock"
    first = sidecars(make_store(), address=address)
    connector = connectors(address, NS, timeout_s=5)
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=5), parent=None)
    connector.flush()
    assert connector.lookup("b", hashes).blocks == 2
    connector.release("b")
    first.stop()
    assert connector.lookup("c", hashes).blocks == 0
    fresh_store = make_store(disk_bytes=None)  # a new store that never heard of the namespace
    sidecars(fresh_store, address=address)
    source = BytePool(3, seed=6)
    deadline = time.monotonic() + 20
    while fresh_store.stats().stored_blocks < 3 and time.monotonic() < deadline:  # the channel reconnects
        connector.save("d", hashes[:3], [0, 1, 2], source, parent=None)
        connector.flush()
        time.sleep(0.2)
    assert fresh_store.stats().stored_blocks == 3 and len(fresh_store.namespaces()) == 1
    hit = connector.lookup("e", hashes)
    target = BytePool(3)
    assert hit.blocks == 3 and connector.start_load(hit, hashes, [0, 1, 2], target).wait() == 3
    assert all(torch.equal(target.layers[l], source.layers[l]) for l in range(SPEC.num_layers))


def test_lookup_replaces_the_previous_lease_and_release_is_idempotent(make_store, sidecars, connectors, hashes):
    store = make_store()
    connector = connectors(sidecars(store).target, NS)
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=7), parent=None)
    connector.flush()
    connector.lookup("r", hashes)
    connector.lookup("r", hashes)
    assert store.stats().leases_active == 1
    connector.release("r")
    connector.release("r")
    assert store.stats().leases_active == 0
    connector.lookup("s", hashes)
    connector.close()
    assert store.stats().leases_active == 0, "close ends the leases still held"


def test_a_read_only_connector_loads_but_never_saves_or_demotes(make_store, sidecars, connectors, hashes):
    store = make_store()
    target = sidecars(store).target
    writer = connectors(target, NS)
    writer.save("a", hashes[:2], [0, 1], BytePool(2, seed=8), parent=None)
    writer.flush()
    reader = connectors(target, NS, read_only=True)
    reader.save("b", hashes[2:4], [0, 1], BytePool(2, seed=9), parent=hashes[1])
    reader.demote(hashes[4], 0, BytePool(1, seed=10), parent=hashes[3])
    reader.flush()
    assert store.stats().stored_blocks == 2
    hit = reader.lookup("c", hashes)
    assert hit.blocks == 2 and reader.start_load(hit, hashes, [0, 1], BytePool(2)).wait() == 2
    writer.demote(hashes[2], 1, BytePool(2, seed=11), parent=hashes[1])
    writer.flush()
    assert store.stats().stored_blocks == 3, "a demoted page becomes a block in the sidecar"


def test_demoting_a_block_the_sidecar_holds_sends_nothing_and_one_it_lacks_is_saved(make_store, sidecars,
                                                                                    connectors, hashes):
    """Until session 35 every device eviction copied the page out and sent it, a duplicate the
    sidecar dropped in the usual case (the engine saved the block when it was computed)."""
    store = make_store()
    connector = connectors(sidecars(store).target, NS)
    source = BytePool(3, seed=8)
    connector.save("a", hashes[:2], [0, 1], source, parent=None)
    connector.flush()
    before = store.stats()
    connector.demote(hashes[1], 1, source, parent=hashes[0])
    connector.flush()
    after = store.stats()
    assert (after.puts, after.duplicate_blocks) == (before.puts, before.duplicate_blocks), "nothing was sent"
    assert after.lookups == before.lookups, "the probe is not a lookup: the hit rate is not skewed"
    assert after.leases_active == 0, "the probe takes no lease"
    connector.demote(hashes[2], 2, source, parent=hashes[1])
    connector.flush()
    assert store.stats().stored_blocks == 3 and store.stats().puts == after.puts + 1
    hit = connector.lookup("b", hashes)
    target = BytePool(3)
    assert hit.blocks == 3 and connector.start_load(hit, hashes, [0, 1, 2], target).wait() == 3
    assert torch.equal(target.layer_page_bytes(2, 2), source.layer_page_bytes(2, 2))


def test_a_slow_probe_saves_the_page_within_its_wait_and_trips_no_back_off(make_store, sidecars, connectors, hashes,
                                                                          monkeypatch):
    """The probe is on the engine's thread: a sidecar slow to answer it costs the eviction at most
    DEMOTE_PROBE_TIMEOUT_S (then the page is saved as before), and does not make the connector
    skip the sidecar's lookups for a back-off window."""
    store = make_store()
    connector = connectors(sidecars(store).target, NS)
    source = BytePool(2, seed=8)
    connector.save("a", hashes[:1], [0], source, parent=None)
    connector.flush()
    real_lookup = store.lookup

    def slow_probe(*args, counted=True, **kw):
        if not counted:
            time.sleep(0.5)
        return real_lookup(*args, counted=counted, **kw)

    monkeypatch.setattr(store, "lookup", slow_probe)
    started = time.monotonic()
    connector.demote(hashes[0], 0, source, parent=None)
    assert time.monotonic() - started < 0.4
    connector.flush()
    assert store.stats().duplicate_blocks == 1, "saved as if missing"
    assert connector.session.backoff.retry_in_s() == 0 and connector.lookup("b", hashes).blocks == 1


@pytest.mark.parametrize("ttl", [0, 7200.0])
def test_a_lease_ttl_the_sidecar_would_refuse_is_refused_at_construction(make_store, sidecars, connectors, hashes, ttl):
    """(Accepted, the sidecar refused every lookup: only ever misses, under a warning about the sidecar.)"""
    with pytest.raises(ValueError, match=r"lease_ttl_s must be in \(0, 3600\] seconds \(the store's longest lease\)"):
        SidecarConnector(unused_address(), NS, lease_ttl_s=ttl)
    connector = connectors(sidecars(make_store()).target, NS, lease_ttl_s=3600.0)  # the longest lease it grants
    connector.save("a", hashes[:2], [0, 1], BytePool(2, seed=3), parent=None)
    connector.flush()
    assert connector.lookup("b", hashes[:2]).blocks == 2


def test_configuration_alone_picks_the_connector(make_store, sidecars, tmp_path):
    store = make_store()
    sidecar = sidecars(store)
    chosen = connector_from_config(NS, store=store, environ={"KVSTORE_SIDECAR": sidecar.target})
    assert isinstance(chosen, SidecarConnector) and chosen.target == sidecar.target
    chosen.close()
    explicit = connector_from_config(NS, sidecar=sidecar.target, environ={})
    assert isinstance(explicit, SidecarConnector)
    explicit.close()
    in_process = connector_from_config(NS, store=store, environ={"KVSTORE_SIDECAR": ""})
    assert type(in_process) is StoreConnector and in_process.store is store
    in_process.close()
    owning = connector_from_config(NS, environ={"KVSTORE_HOST_CAPACITY": "0", "KVSTORE_DISK_PATH": str(tmp_path / "d"),
                                                "KVSTORE_DISK_CAPACITY": "8MiB"})
    assert isinstance(owning, OwningStoreConnector)
    owning.close()


def test_a_prefill_report_after_close_is_dropped_not_raised(make_store, sidecars, caplog):
    sidecar = sidecars(make_store())
    connector = SidecarConnector(sidecar.target, NS)
    connector.close()
    with caplog.at_level(logging.DEBUG, logger="connectors.sidecar_connector"):
        connector.report_prefill("late", 64, 0)  # an engine finishing a request during shutdown
    assert "prefill report after close dropped" in caplog.text


@pytest.mark.parametrize("value, expected", [("", 30.0), ("2.5", 2.5), ("off", None), (" OFF ", None)])
def test_the_load_timeout_comes_from_the_environment(make_store, value, expected):
    store = make_store()
    connector = connector_from_config(NS, store=store, environ={"KVSTORE_LOAD_TIMEOUT_S": value})
    assert connector.load_timeout_s == expected
    connector.close()


@pytest.mark.parametrize("value", ["0", "-1", "soon", "nan"])
def test_a_bad_load_timeout_in_the_environment_says_what_to_give(value):
    with pytest.raises(InvalidRequest, match="KVSTORE_LOAD_TIMEOUT_S.*positive seconds .* or 'off'"):
        connector_from_config(NS, store=None, environ={"KVSTORE_LOAD_TIMEOUT_S": value})
