"""The sidecar's Prometheus metrics count exactly the traffic a real server saw, and /metrics serves them."""

from __future__ import annotations

import sys
import threading
import time

import grpc
import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvstore.keys import Namespace
from kvstore.layout import BlockSpec
from kvstore.service.client import KVStoreClient
from kvstore.service.http import create_http_app
from kvstore.service.metrics import METRIC_NAMES, NamespaceLabels, ServiceMetrics
from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.service.v1.kvstore_pb2_grpc import KVStoreStub
from kvstore.service.dashboard.history import point_between, take_sample
from tests.conftest import payloads_for, tiny_namespace


def scrape(registry) -> dict[tuple, float]:
    """{(sample name, sorted labels): value} parsed from the exposition text, as Prometheus reads it."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_the_traffic_of_a_real_server(server, store, client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    label = ("namespace", f"tiny-mla/{ns_id.hex()[:8]}")
    payloads = payloads_for(spec, chain[:3])
    client.put(ns_id, chain[:3], payloads)
    client.put(ns_id, chain[:3], payloads)  # all duplicates
    hit = client.lookup(ns_id, chain[:5], lease_ttl_s=30)  # 3 of 5 blocks hit, 4 tokens each
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
    client.load(ns_id, chain[:3], dsts, hit.lease_id)
    client.load_shm(ns_id, chain[:2], dsts[:2])
    client.report_prefill(ns_id, saved_tokens=12, computed_tokens=8)
    with pytest.raises(grpc.RpcError):
        client.lookup(b"\x01" * 16, chain[:1])  # unknown namespace: NOT_FOUND

    got = scrape(server.metrics.registry)
    assert got[("kvstore_lookups_total", (label,))] == 1
    assert got[("kvstore_lookup_tokens_total", (label,))] == 20
    stats = store.stats()  # the store's own count agrees: load_shm's GetSlots is no second lookup (it was)
    assert (stats.lookups, stats.lookup_blocks, stats.hit_blocks) == (1, 5, 3)
    assert got[("kvstore_hit_tokens_total", (label, ("tier", "host")))] == 12
    assert got[("kvstore_loaded_tokens_total", (("path", "bytes"), ("tier", "host")))] == 12
    assert got[("kvstore_loaded_tokens_total", (("path", "shm"), ("tier", "host")))] == 8
    assert got[("kvstore_loaded_bytes_total", (("path", "shm"), ("tier", "host")))] == 2 * spec.block_bytes
    assert got[("kvstore_put_blocks_total", (label, ("outcome", "stored")))] == 3
    assert got[("kvstore_put_blocks_total", (label, ("outcome", "duplicate")))] == 3
    assert got[("kvstore_put_bytes_total", ())] == 6 * spec.block_bytes
    assert got[("kvstore_prefill_tokens_saved_total", (label,))] == 12
    assert got[("kvstore_prefill_tokens_computed_total", (label,))] == 8
    assert got[("kvstore_grpc_errors_total", (("code", "NOT_FOUND"), ("method", "Lookup")))] == 1
    recent = server.metrics.recent_traffic()  # what the dashboard's curve replays: both puts, then the lookup
    assert [(r.put, len(r.keys), r.hit_blocks) for r in recent] == [(True, 3, 0), (True, 3, 0), (False, 5, 3)]
    assert recent[0].keys == tuple(ns_id + h for h in chain[:3])
    calls = {dict(labels)["method"]: value for (name, labels), value in got.items() if name == "kvstore_grpc_calls_total"}
    assert calls == {"RegisterNamespace": 1, "Put": 2, "Lookup": 2, "Get": 1, "GetSlots": 1, "Release": 1,
                     "ReportPrefill": 1}  # the failed Lookup too: the error ratio's denominator
    assert got[("kvstore_lookup_duration_seconds_count", ())] == 1
    assert got[("kvstore_load_duration_seconds_count", (("path", "shm"),))] == 1

    stats = client.stats()  # scrape-time gauges and counters mirror the store's own stats
    host, disk = stats.tier("host"), stats.tier("disk")
    assert got[("kvstore_tier_used_bytes", (("tier", "host"),))] == host.used_bytes > 0
    assert got[("kvstore_tier_capacity_bytes", (("tier", "disk"),))] == disk.capacity_bytes
    assert got[("kvstore_tier_blocks", (("tier", "host"),))] == 3
    assert got[("kvstore_tier_written_bytes_total", (("tier", "host"),))] == host.bytes_written == 3 * spec.block_bytes
    assert got[("kvstore_namespaces", ())] == 1
    assert host.extra["policy"] == "lru"  # the test store's policy
    assert got[("kvstore_tier_policy", (("policy", "lru"), ("tier", "host")))] == 1
    assert got[("kvstore_leases_active", ())] == 0

    exported = {name for name, _ in got}
    for name in METRIC_NAMES:
        assert any(e == name or e.startswith(name + "_") for e in exported), f"{name} is not exported"


def loaded_tokens(server) -> dict[str, float]:
    """``kvstore_loaded_tokens_total`` of the host tier by path ("bytes", "shm"; 0 where absent)."""
    got = scrape(server.metrics.registry)
    return {path: got.get(("kvstore_loaded_tokens_total", (("path", path), ("tier", "host"))), 0)
            for path in ("bytes", "shm")}


def test_a_client_that_can_neither_map_the_segment_nor_use_the_data_plane_counts_each_block_once(
        server, store, namespace, spec, chain):
    """GetSlots grants slots this client cannot read, so every block comes through Get: counted once, as bytes."""
    with KVStoreClient(server.target, timeout_s=30, shared_memory=False, data_plane=False) as remote:
        ns_id = remote.register_namespace(namespace)
        remote.put(ns_id, chain[:3], payloads_for(spec, chain[:3]))
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
        assert remote.load_shm(ns_id, chain[:3], dsts).tiers == ("host",) * 3  # 3 blocks of 4 tokens handed over
    assert loaded_tokens(server) == {"bytes": 12, "shm": 0}
    assert store.stats().tier("host").loaded_blocks == 3, "the store's own count, and its policy, saw each block once"


def test_a_client_that_maps_the_segment_counts_each_block_once_as_shm(server, store, client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:3], payloads_for(spec, chain[:3]))
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
    assert client.load_shm(ns_id, chain[:3], dsts).tiers == ("host",) * 3
    assert loaded_tokens(server) == {"bytes": 0, "shm": 12}
    assert store.stats().tier("host").loaded_blocks == 3
    assert scrape(server.metrics.registry)[("kvstore_load_duration_seconds_count", (("path", "shm"),))] == 1


def test_a_slot_that_fails_its_checksums_counts_only_through_the_get_that_fetches_it_again(
        server, client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:4], payloads_for(spec, chain[:4]))
    grant = client.get_slots(ns_id, chain[:4])
    assert client.release_grant(grant, copied_blocks=0)
    with open(grant.segment_path, "r+b") as arena:  # a same-uid process scribbles over block 2 in the host tier
        arena.seek(grant.slots[2].offset)
        arena.write(b"\x5a" * 64)

    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(4)]
    assert client.load_shm(ns_id, chain[:4], dsts, verify=True).tiers == ("host",) * 2
    # slots 0 and 1 were copied and kept; Get sent blocks 2 (still bad: the result ends before it) and 3
    assert loaded_tokens(server) == {"bytes": 8, "shm": 8}


def test_a_release_counts_the_slots_it_reports_at_most_the_granted_and_all_of_them_when_it_reports_none(
        server, stub, client, namespace, spec, chain):
    """A client older than ReleaseRequest.copied_blocks sends none: every granted slot counts, as before."""
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, chain[:3], payloads_for(spec, chain[:3]))

    def get_slots(blocks: int) -> int:
        request = pb.GetSlotsRequest(namespace_id=ns_id, block_hashes=chain[:blocks], lease_ttl_s=30)
        return stub.GetSlots(request).lease_id

    stub.Release(pb.ReleaseRequest(lease_id=get_slots(3)))  # an old client: 3 slots
    assert loaded_tokens(server) == {"bytes": 0, "shm": 12}
    stub.Release(pb.ReleaseRequest(lease_id=get_slots(3), copied_blocks=1))
    stub.Release(pb.ReleaseRequest(lease_id=get_slots(2), copied_blocks=7))  # capped at the 2 granted
    stub.Release(pb.ReleaseRequest(lease_id=get_slots(3), copied_blocks=0))
    assert loaded_tokens(server) == {"bytes": 0, "shm": 12 + 4 + 8}
    lookup = stub.Lookup(pb.LookupRequest(namespace_id=ns_id, block_hashes=chain[:3], lease_ttl_s=30))
    stub.Release(pb.ReleaseRequest(lease_id=lookup.lease_id, copied_blocks=3))  # a Lookup's lease grants no slot
    assert loaded_tokens(server) == {"bytes": 0, "shm": 24}


def test_slots_of_a_lease_that_expires_or_that_a_get_ends_count_for_nothing(server, client, namespace, spec, chain):
    ns_id = client.register_namespace(namespace)
    payloads = payloads_for(spec, chain[:2])
    client.put(ns_id, chain[:2], payloads)
    dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(2)]

    died = client.get_slots(ns_id, chain[:2], lease_ttl_s=0.2)  # a client that dies before its Release
    late = client.get_slots(ns_id, chain[:2], lease_ttl_s=0.2)
    time.sleep(0.4)
    assert not client.release_grant(late, copied_blocks=2), "expired: NOT_FOUND, the copies are void"
    assert died.lease_id is not None and loaded_tokens(server) == {"bytes": 0, "shm": 0}

    taken = client.get_slots(ns_id, chain[:2])
    assert client.load(ns_id, chain[:2], dsts, taken.lease_id).tiers == ("host",) * 2  # Get ends the lease
    assert not client.release_grant(taken, copied_blocks=2), "the Get ended it: NOT_FOUND"
    assert loaded_tokens(server) == {"bytes": 8, "shm": 0}
    assert client.stats().leases_active == 0


@pytest.mark.parametrize("stream_as_loaded", [False, True])
def test_a_get_the_client_abandons_counts_only_the_blocks_sent(server, client, stream_as_loaded):
    namespace = Namespace(model="deepseek-v3.2", model_config_hash="cfg", num_layers=61,
                          components=("mla_fp8_ds", "indexer_fp8"), block_size=64)
    spec = BlockSpec.of(namespace)  # 3 MiB blocks: flow control stops the server long before the fourth
    hashes = [bytes([i]) * 16 for i in range(1, 5)]
    ns_id = client.register_namespace(namespace)
    client.put(ns_id, hashes, payloads_for(spec, hashes))
    with grpc.insecure_channel(server.target) as channel:
        request = pb.GetRequest(namespace_id=ns_id, block_hashes=hashes, chunk_bytes=64 << 10,
                                stream_as_loaded=stream_as_loaded)
        stream = KVStoreStub(channel).Get(request, timeout=30)
        assert next(stream).HasField("header") and next(stream).HasField("chunk")
        stream.cancel()
    deadline = time.monotonic() + 10
    while not scrape(server.metrics.registry).get(("kvstore_load_duration_seconds_count", (("path", "bytes"),))):
        assert time.monotonic() < deadline, "the abandoned Get never ended"
        time.sleep(0.01)
    loaded_from_host = ("kvstore_loaded_tokens_total", (("path", "bytes"), ("tier", "host")))
    sent = scrape(server.metrics.registry).get(loaded_from_host, 0)
    assert sent < 4 * spec.block_size, "the blocks loaded but never sent do not count"
    full = client.load(ns_id, hashes, [np.zeros(spec.block_bytes, np.uint8) for _ in hashes])
    assert full.complete
    got = scrape(server.metrics.registry)
    assert got[loaded_from_host] == sent + 4 * spec.block_size


def test_namespace_labels_are_bounded():
    labels = NamespaceLabels(limit=2)
    model = lambda ns_id: "m"  # noqa: E731
    assert labels.label(b"\xaa" * 16, model) == "m/aaaaaaaa"
    assert labels.label(b"\xbb" * 16) == "ns/bbbbbbbb"
    assert labels.label(b"\xcc" * 16, model) == "other"
    assert labels.label(b"\xaa" * 16, model) == "m/aaaaaaaa", "known ids keep their label"


def test_a_namespace_label_keeps_64_plain_characters_of_a_client_chosen_model_name():
    labels, asked = NamespaceLabels(limit=4), []
    long_name = "deepseek-ai/DeepSeek-V3.2 \"quoted\"\n" + "x" * 3_000_000
    assert labels.label(b"\xaa" * 16, lambda ns_id: asked.append(ns_id) or long_name) == (
        "deepseek-ai/DeepSeek-V3.2__quoted__" + "x" * 29 + "/aaaaaaaa")
    labels.label(b"\xaa" * 16, lambda ns_id: asked.append(ns_id) or long_name)
    assert asked == [b"\xaa" * 16], "the model is looked up once, when the label is made"


def test_a_call_that_raises_unexpectedly_counts_as_an_unknown_error(server, client, store, monkeypatch):
    def broken():
        raise RuntimeError("a bug")
    with monkeypatch.context() as patch, pytest.raises(grpc.RpcError) as failed:
        patch.setattr(store, "stats", broken)
        client.stats()
    assert failed.value.code() == grpc.StatusCode.UNKNOWN
    got = scrape(server.metrics.registry)
    assert got[("kvstore_grpc_errors_total", (("code", "UNKNOWN"), ("method", "Stats")))] == 1
    assert got[("kvstore_grpc_calls_total", (("method", "Stats"),))] == 1


def test_http_app_serves_metrics_and_healthz_and_protects_what_it_must(store):
    metrics = ServiceMetrics(store)
    serving = [True]
    open_app = TestClient(create_http_app(metrics, token="t0k", serving=lambda: serving[0]))
    assert open_app.get("/metrics").status_code == 200
    assert "kvstore_tier_capacity_bytes" in open_app.get("/metrics").text
    assert open_app.get("/healthz").text == "ok"
    assert open_app.head("/healthz").status_code == 200 and open_app.head("/metrics").status_code == 200  # probes
    serving[0] = False
    assert open_app.get("/healthz").status_code == 503
    assert open_app.head("/healthz").status_code == 503

    protected = TestClient(create_http_app(metrics, token="t0k", protect_metrics=True))
    refused = protected.get("/metrics")
    assert refused.status_code == 401 and "Bearer" in refused.json()["detail"]
    assert protected.get("/metrics", headers={"Authorization": "Bearer t0k"}).status_code == 200
    assert protected.get("/metrics", headers={"Authorization": "Bearer nope"}).status_code == 401


def test_the_recent_lookup_record_is_capped_by_keys_as_well_as_lookups(store, namespace):
    """16,384-hash lookups from one client once grew the record to 2.8 GiB: 2,048 of them."""
    ns_id = store.register_namespace(namespace)
    metrics = ServiceMetrics(store, recent_records=8, recent_keys=1000)
    big = [i.to_bytes(16, "little") for i in range(400)]
    for _ in range(5):
        metrics.lookup(ns_id, big, (), 0.001)
    kept = metrics.recent_traffic()
    assert len(kept) == 2 and sum(len(r.keys) for r in kept) == 800  # 3 x 400 keys would pass 1000
    metrics.lookup(ns_id, [i.to_bytes(16, "little") for i in range(5000)], (), 0.001)
    assert [len(r.keys) for r in metrics.recent_traffic()] == [5000], "the newest stays, however large"
    for _ in range(20):
        metrics.lookup(ns_id, big[:1], (), 0.001)
    assert len(metrics.recent_traffic()) == 8


@pytest.fixture
def fast_switching():
    """Threads switch every 10 us instead of every 5 ms, so races show within a second."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def test_a_namespace_label_made_while_namespaces_register_does_not_fail(store, fast_switching):
    """Making a label scanned the store's namespaces without its lock while RegisterNamespace added
    to them on another thread: "dictionary changed size during iteration", and the call that was
    being counted (its lease already granted) answered UNKNOWN."""
    first = store.register_namespace(tiny_namespace(model="first"))
    for i in range(200):
        store.register_namespace(tiny_namespace(model=f"before{i}"))
    metrics, errors, stop = ServiceMetrics(store), [], threading.Event()

    def register():
        i = 0
        while not stop.is_set():
            store.register_namespace(tiny_namespace(model=f"during{i}"))
            i += 1

    def label():
        while not stop.is_set():
            metrics.namespaces = NamespaceLabels(32)  # a fresh label each time: the namespaces are scanned
            try:
                assert metrics.namespace_label(first).startswith("first/")
            except RuntimeError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=register), threading.Thread(target=label)]
    for thread in threads:
        thread.start()
    time.sleep(1.5)
    stop.set()
    for thread in threads:
        thread.join()
    assert errors == []


def test_totals_hold_each_lookups_tokens_and_hits_together(store, namespace, spec, chain, fast_switching):
    """``totals`` read the lookup counters one by one while lookups counted, so an interval could
    hold a lookup's hits but not its tokens: a hit rate above 1 on the dashboard."""
    ns_id = store.register_namespace(namespace)
    store.put(ns_id, chain[:2], payloads_for(spec, chain[:2]))
    metrics, stop = ServiceMetrics(store), threading.Event()
    hit_tiers = store.lookup(ns_id, chain[:2]).tiers

    def traffic():  # every lookup hits all its tokens: every interval's hit rate is exactly 1
        while not stop.is_set():
            metrics.lookup(ns_id, chain[:2], hit_tiers, 0.0)

    worker = threading.Thread(target=traffic)
    worker.start()
    rates = []
    try:
        before = take_sample(metrics.totals(), time.time(), [])
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            after = take_sample(metrics.totals(), time.time() + len(rates) * 1e-6, [])
            rates.append(point_between(before, after).hit_rate)
            before = after
    finally:
        stop.set()
        worker.join()
    measured = [rate for rate in rates if rate is not None]
    assert measured and all(rate == 1.0 for rate in measured), sorted(measured)[-3:]
