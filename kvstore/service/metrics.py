"""Prometheus metrics of the sidecar, and the recent-traffic record the dashboard reads.

Two sources, one registry (``ServiceMetrics.registry``, served at ``/metrics``):

- per call, recorded by the servicer: lookups, looked-up and hit tokens (by namespace and tier),
  tokens loaded (by tier and path: what Get sent, and at Release the GetSlots slots the client
  says it copied, kvstore.service.granted_slots; each block handed over counts once), prefill
  tokens saved or computed (reported by connectors),
  put outcomes, errors by method and gRPC status, and latency histograms;
- at scrape time, read from ``store.stats()`` by ``StoreCollector``: bytes read and written,
  evictions, demotions, promotions, checksum failures and I/O errors per tier, lease expiries,
  and the gauges (bytes used and capacity per tier, blocks, namespaces, active leases); and,
  where the sidecar runs its native data plane (``watch_data_plane``), its ReadSlots calls, bytes
  sent, refusals and live grants (``DataPlaneCollector``, ``DATA_PLANE_METRIC_NAMES``).

Everything is a counter or a gauge, never a ratio: PromQL computes rates, e.g. the token hit rate
``sum(rate(kvstore_hit_tokens_total[5m])) / sum(rate(kvstore_lookup_tokens_total[5m]))``.

Namespace labels have bounded cardinality (``NamespaceLabels``): the first ``max_namespaces``
namespaces get ``MODEL/ID8`` (model name, first 8 hex digits of the id), later ones share
``"other"``.
"""

from __future__ import annotations

import collections
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.service.v1 import kvstore_pb2 as pb
from kvstore.store import TieredStore

LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
OTHER_NAMESPACE = "other"
KVSTORE_SERVICE = pb.DESCRIPTOR.services_by_name["KVStore"].full_name  # the calls counted: "kvstore.v1.KVStore"
LOAD_PATHS = ("bytes", "shm")  # what Get sent; the slots of a GetSlots grant the client copied


@dataclass(frozen=True)
class TrafficRecord:
    """One Lookup, or one Put (``put``), as the dashboard's hit-rate curve needs it."""

    time_s: float
    namespace: str  # its label
    keys: tuple[bytes, ...]  # namespace id + block hash, 32 bytes each: the requested chain, or the blocks put
    block_bytes: int
    block_size: int
    hit_blocks: int  # of a Lookup: the contiguous hit the store answered; 0 for a Put
    put: bool = False


class NamespaceLabels:
    """Bounded label values for namespace ids: ``MODEL/ID8`` for the first ``limit``, then "other".

    A client names its model, and a label is repeated in every series of every scrape, so the
    model part is at most ``MODEL_LABEL_CHARS`` of letters, digits and ``_.-/:`` (others become
    ``_``): a 3 MB model name made one scrape of /metrics 30 MB."""

    MODEL_LABEL_CHARS = 64

    def __init__(self, limit: int):
        self.limit = limit
        self._labels: dict[bytes, str] = {}
        self._lock = threading.Lock()

    def label(self, ns_id: bytes, model_of: Callable[[bytes], str] = lambda ns_id: "") -> str:
        """``ns_id``'s label; ``model_of(ns_id)`` is asked only when a new label is made."""
        with self._lock:
            found = self._labels.get(ns_id)
            if found is None:
                if len(self._labels) >= self.limit:
                    return OTHER_NAMESPACE
                model = re.sub(r"[^\w.\-/:]", "_", model_of(ns_id), flags=re.ASCII)[: self.MODEL_LABEL_CHARS]
                found = self._labels[ns_id] = f"{model or 'ns'}/{ns_id.hex()[:8]}"
            return found

    def known(self) -> dict[bytes, str]:
        with self._lock:
            return dict(self._labels)


class ServiceMetrics:
    """The sidecar's metrics: call ``lookup``/``load``/``put``/... from the servicer.

    Thread-safe (prometheus_client metrics are; the recent-traffic deques take a lock). Keeps the
    last ``recent_records`` lookups and puts (their keys), and of those no more than ``recent_keys``
    keys in all, and ``recent_latencies`` latencies per kind for the dashboard. The dashboard's
    curve replays 65,536 block events (``curve_report.MAX_ACCESSES``); a cap by lookups alone let a
    client sending 16,384-hash lookups grow the record to 2.8 GiB.
    """

    def __init__(self, store: TieredStore, max_namespaces: int = 32, recent_records: int = 2048,
                 recent_latencies: int = 4096, recent_keys: int = 2 * 65_536):
        self.store = store
        self.registry = CollectorRegistry()
        self.namespaces = NamespaceLabels(max_namespaces)
        self.started_s = time.time()
        r = self.registry
        self.lookups = Counter("kvstore_lookups", "Lookup calls", ["namespace"], registry=r)
        self.lookup_tokens = Counter("kvstore_lookup_tokens", "Tokens asked about by Lookup calls",
                                     ["namespace"], registry=r)
        self.hit_tokens = Counter("kvstore_hit_tokens", "Tokens of the contiguous hit of Lookup calls, by the "
                                  "tier serving them", ["namespace", "tier"], registry=r)
        self.loaded_tokens = Counter("kvstore_loaded_tokens", "Tokens handed to clients, by tier and path "
                                     "(bytes: sent by Get; shm: slots of a GetSlots grant the client copied, "
                                     "mapped or streamed by the data plane, counted at its Release)",
                                     ["tier", "path"], registry=r)
        self.loaded_bytes = Counter("kvstore_loaded_bytes", "Payload bytes handed to clients, by tier and path",
                                    ["tier", "path"], registry=r)
        self.prefill_saved = Counter("kvstore_prefill_tokens_saved", "Prefill tokens engines skipped thanks to "
                                     "loaded hits (reported by connectors)", ["namespace"], registry=r)
        self.prefill_computed = Counter("kvstore_prefill_tokens_computed", "Prefill tokens engines computed "
                                        "(reported by connectors)", ["namespace"], registry=r)
        self.put_blocks = Counter("kvstore_put_blocks", "Blocks offered by Put calls, by outcome "
                                  "(stored, duplicate, rejected)", ["namespace", "outcome"], registry=r)
        self.put_bytes = Counter("kvstore_put_bytes", "Payload bytes received by Put calls", registry=r)
        self.errors = Counter("kvstore_grpc_errors", "Calls that ended with a gRPC error status",
                              ["method", "code"], registry=r)
        self.calls = Counter("kvstore_grpc_calls", "Calls received, failed ones included", ["method"], registry=r)
        self.lookup_seconds = Histogram("kvstore_lookup_duration_seconds", "Lookup call latency",
                                        buckets=LATENCY_BUCKETS_S, registry=r)
        self.load_seconds = Histogram("kvstore_load_duration_seconds", "Get and GetSlots call latency",
                                      ["path"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.put_seconds = Histogram("kvstore_put_duration_seconds", "Put call latency",
                                     buckets=LATENCY_BUCKETS_S, registry=r)
        r.register(StoreCollector(store))
        self._recent: collections.deque[TrafficRecord] = collections.deque()
        self._max_recent_records, self._max_recent_keys, self._recent_keys = recent_records, recent_keys, 0
        self._recent_latencies = {kind: collections.deque(maxlen=recent_latencies) for kind in ("lookup", "load", "put")}
        self._lock = threading.Lock()
        self._traffic = threading.Lock()  # a lookup's counters change together, and ``totals`` reads them so

    def watch_data_plane(self, data_plane) -> None:
        """Export the counters of a ``DataPlaneServer`` (kvstore.service.dataplane) at scrape time."""
        self.registry.register(DataPlaneCollector(data_plane))

    def namespace_label(self, ns_id: bytes) -> str:
        return self.namespaces.label(ns_id, self._model_of)  # a scan of the namespaces only for a new label

    def lookup(self, ns_id: bytes, keys: Sequence[bytes], hit_tiers: Sequence[str], seconds: float) -> None:
        """A Lookup of ``keys`` (block hashes) whose contiguous hit was served by ``hit_tiers``."""
        spec = self.store.spec(ns_id)
        label = self.namespace_label(ns_id)
        with self._traffic:  # a lookup's tokens and hits in the same ``totals``: no hit rate above 1
            self.lookups.labels(label).inc()
            self.lookup_tokens.labels(label).inc(len(keys) * spec.block_size)
            for tier, blocks in collections.Counter(hit_tiers).items():
                self.hit_tokens.labels(label, tier).inc(blocks * spec.block_size)
        self.lookup_seconds.observe(seconds)
        record = TrafficRecord(time.time(), label, tuple(ns_id + h for h in keys), spec.block_bytes,
                               spec.block_size, len(hit_tiers))
        with self._lock:
            self._remember(record)
            self._recent_latencies["lookup"].append((record.time_s, seconds))

    def _remember(self, record: TrafficRecord) -> None:
        """Append ``record``, dropping the oldest past either cap (the newest always stays). Caller holds the lock."""
        recent = self._recent
        recent.append(record)
        self._recent_keys += len(record.keys)
        while len(recent) > 1 and (len(recent) > self._max_recent_records or self._recent_keys > self._max_recent_keys):
            self._recent_keys -= len(recent.popleft().keys)

    def load_took(self, path: str, seconds: float) -> None:
        """A Get's load (``path="bytes"``: the store's load, or a streamed Get's whole stream) or a
        GetSlots (``"shm"``) took ``seconds``. What they handed over counts through ``loaded``."""
        self.load_seconds.labels(path).observe(seconds)
        self._latency("load", seconds)

    def loaded(self, ns_id: bytes, tiers: Sequence[str], path: str) -> None:
        """Blocks from ``tiers`` handed to a client by ``path``: their tokens and bytes."""
        spec = self.store.spec(ns_id)
        for tier, blocks in collections.Counter(tiers).items():
            self.loaded_tokens.labels(tier, path).inc(blocks * spec.block_size)
            self.loaded_bytes.labels(tier, path).inc(blocks * spec.block_bytes)

    def put(self, ns_id: bytes, keys: Sequence[bytes], stored: int, duplicates: int, rejected: int, nbytes: int,
            seconds: float) -> None:
        """A Put (or CommitSlots) of ``keys`` (block hashes) and how the store took its blocks."""
        spec = self.store.spec(ns_id)
        label = self.namespace_label(ns_id)
        for outcome, count in (("stored", stored), ("duplicate", duplicates), ("rejected", rejected)):
            if count:
                self.put_blocks.labels(label, outcome).inc(count)
        self.put_bytes.inc(nbytes)
        self.put_seconds.observe(seconds)
        record = TrafficRecord(time.time(), label, tuple(ns_id + h for h in keys), spec.block_bytes,
                               spec.block_size, 0, put=True)
        with self._lock:
            self._remember(record)
            self._recent_latencies["put"].append((record.time_s, seconds))

    def prefill(self, ns_id: bytes, saved_tokens: int, computed_tokens: int) -> None:
        """What a connector reports after a prefill: tokens it loaded instead of computing, and computed."""
        label = self.namespace_label(ns_id)
        self.prefill_saved.labels(label).inc(saved_tokens)
        self.prefill_computed.labels(label).inc(computed_tokens)

    def error(self, method: str, code_name: str) -> None:
        self.errors.labels(method, code_name).inc()

    def call(self, method: str) -> None:
        """A call of ``method`` came, whatever its outcome (the error ratio's denominator)."""
        self.calls.labels(method).inc()

    def refused(self, full_method: str) -> None:
        """A call of ``full_method`` (``/kvstore.v1.KVStore/Lookup``) was refused for want of the
        token, before any handler ran: a call and an UNAUTHENTICATED error of the KVStore service's
        method; other services' calls (reflection) are not counted."""
        service, _, method = full_method.strip("/").partition("/")
        if service == KVSTORE_SERVICE:
            self.call(method)
            self.error(method, "UNAUTHENTICATED")

    def recent_traffic(self, since_s: float = 0.0) -> list[TrafficRecord]:
        """The recent lookups and puts recorded since ``since_s``, oldest first."""
        with self._lock:
            return [r for r in self._recent if r.time_s >= since_s]

    def recent_latencies(self, kind: str, since_s: float = 0.0, until_s: float = math.inf) -> list[float]:
        """Latencies in seconds of recent ``kind`` calls ("lookup", "load" or "put") recorded in
        ``[since_s, until_s)``: consecutive intervals count each call once."""
        with self._lock:
            return [s for t, s in self._recent_latencies[kind] if since_s <= t < until_s]

    def totals(self) -> dict:
        """Every counter of this registry summed per label set: {metric: {label tuple: value}}.

        Sample names keep Prometheus's ``_total``/``_sum``/``_count``/``_bucket`` suffixes. The
        lookup counters are read together, none of a lookup's increments in and others out.
        """
        traffic_metrics = (self.lookups, self.lookup_tokens, self.hit_tokens)
        with self._traffic:
            traffic = [family for metric in traffic_metrics for family in metric.collect()]
        names = {family.name for family in traffic}
        out: dict[str, dict[tuple, float]] = collections.defaultdict(dict)
        for family in [*traffic, *(f for f in self.registry.collect() if f.name not in names)]:
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                out[sample.name][tuple(sorted(sample.labels.items()))] = sample.value
        return dict(out)

    def _latency(self, kind: str, seconds: float) -> None:
        with self._lock:
            self._recent_latencies[kind].append((time.time(), seconds))

    def _model_of(self, ns_id: bytes) -> str:
        for namespace in self.store.namespaces():
            if namespace.id == ns_id:
                return namespace.model
        return ""


class StoreCollector:
    """Scrape-time metrics read from ``store.stats()``: counters and gauges per tier."""

    COUNTERS = (  # (metric name without _total, TierStats field, help)
        ("kvstore_tier_read_bytes", "bytes_read", "Bytes read from the tier"),
        ("kvstore_tier_written_bytes", "bytes_written", "Bytes written to the tier"),
        ("kvstore_tier_evictions", "evictions", "Blocks evicted from the tier by policy"),
        ("kvstore_tier_demotions", "demotions_in", "Blocks demoted into the tier from the one above"),
        ("kvstore_tier_promotions", "promotions_in", "Blocks promoted into the tier from the one below"),
        ("kvstore_checksum_failures", "checksum_failures", "Blocks dropped because their bytes failed verification"),
        ("kvstore_tier_io_errors", "io_errors", "I/O errors of the tier (each turned into a miss)"),
    )
    GAUGES = (
        ("kvstore_tier_used_bytes", "used_bytes", "Bytes the tier counts against its capacity"),
        ("kvstore_tier_capacity_bytes", "capacity_bytes", "Capacity of the tier in bytes"),
        ("kvstore_tier_blocks", "blocks", "Blocks resident in the tier"),
    )

    def __init__(self, store: TieredStore):
        self._store = store

    def describe(self) -> Iterable:
        return []  # no collection at registration time: the store may be busy

    def collect(self) -> Iterable:
        stats = self._store.stats()
        for name, field_name, help_text in self.COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=["tier"])
            for tier in stats.tiers:
                family.add_metric([tier.name], getattr(tier, field_name))
            yield family
        for name, field_name, help_text in self.GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=["tier"])
            for tier in stats.tiers:
                family.add_metric([tier.name], getattr(tier, field_name))
            yield family
        policy = GaugeMetricFamily("kvstore_tier_policy", "1 for the eviction policy in effect in the tier "
                                   "(adaptive: its leading candidate)", labels=["tier", "policy"])
        for tier in stats.tiers:
            policy.add_metric([tier.name, tier.extra.get("policy", "")], 1)
        yield policy
        yield CounterMetricFamily("kvstore_lease_expiries", "Leases that ended by TTL, never released",
                                  value=stats.lease_expiries)
        yield GaugeMetricFamily("kvstore_leases_active", "Leases held now", value=stats.leases_active)
        yield GaugeMetricFamily("kvstore_namespaces", "Registered namespaces", value=stats.namespaces)


class DataPlaneCollector:
    """Scrape-time metrics of the native data plane, read from its counters."""

    COUNTERS = (  # (metric name without _total, DataPlaneCounters field, help)
        ("kvstore_dataplane_calls", "calls", "ReadSlots calls the native data plane received"),
        ("kvstore_dataplane_sent_bytes", "bytes_sent", "Payload bytes the native data plane streamed"),
        ("kvstore_dataplane_refused", "refused", "ReadSlots calls refused (unknown or expired grant, bad "
         "request or none within stream_idle_timeout_s, no token, over a stream limit)"),
        ("kvstore_dataplane_cut_short", "cut_short", "ReadSlots streams ended early: the client cancelled or "
         "dropped them, their grant ended, or they stalled past stream_idle_timeout_s"),
        ("kvstore_dataplane_restarts", "restarts", "Restarts of the data plane whose listener stopped answering "
         "(DataPlaneWatchdog)"),
    )

    def __init__(self, data_plane):
        self._data_plane = data_plane

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        counters = self._data_plane.counters()
        for name, field_name, help_text in self.COUNTERS:
            yield CounterMetricFamily(name, help_text, value=getattr(counters, field_name))
        yield GaugeMetricFamily("kvstore_dataplane_grants", "Grants of live leases the data plane holds",
                                value=counters.live_grants)
        yield GaugeMetricFamily("kvstore_dataplane_up", "1 while the native data plane serves, 0 while a restart "
                                "of it has failed (DataPlaneWatchdog retries) or it has stopped",
                                value=int(self._data_plane.serving))


DATA_PLANE_METRIC_NAMES = (*(name + "_total" for name, _, _ in DataPlaneCollector.COUNTERS), "kvstore_dataplane_grants",
                           "kvstore_dataplane_up")
METRIC_NAMES = (  # every sample family /metrics exports (counters with their _total suffix)
    "kvstore_lookups_total", "kvstore_lookup_tokens_total", "kvstore_hit_tokens_total",
    "kvstore_loaded_tokens_total", "kvstore_loaded_bytes_total", "kvstore_prefill_tokens_saved_total",
    "kvstore_prefill_tokens_computed_total", "kvstore_put_blocks_total", "kvstore_put_bytes_total",
    "kvstore_grpc_errors_total", "kvstore_grpc_calls_total", "kvstore_lookup_duration_seconds", "kvstore_load_duration_seconds",
    "kvstore_put_duration_seconds",
    *(name + "_total" for name, _, _ in StoreCollector.COUNTERS),
    *(name for name, _, _ in StoreCollector.GAUGES),
    "kvstore_tier_policy", "kvstore_lease_expiries_total", "kvstore_leases_active", "kvstore_namespaces",
)
