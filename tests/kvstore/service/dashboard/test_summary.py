"""``/api/summary`` and ``/api/namespaces`` against traffic recorded on a real store."""

from __future__ import annotations

import pytest

from tests.kvstore.service.dashboard.conftest import BLOCK_TOKENS


def test_summary_reports_the_recorded_traffic_and_the_store_state(traffic, client):
    ns = traffic.namespace()
    prompt = traffic.hashes(ns, 0, 17)
    traffic.put(ns, prompt[:15])  # the host keeps the last 10 (evicting 5); the disk all 15
    leased = traffic.lookup(ns, prompt[:15], lease_ttl_s=60)
    assert sorted(leased.tiers) == ["disk"] * 5 + ["host"] * 10
    traffic.lookup(ns, prompt)  # 15 of 17 hit
    traffic.lookup(ns, traffic.hashes(ns, 100, 5))  # none
    on_host = [h for h, tier in zip(prompt, leased.tiers) if tier == "host"]
    assert traffic.load(ns, on_host) == ("host",) * 10
    traffic.metrics.prefill(ns, saved_tokens=120, computed_tokens=28)

    s = client.get("/api/summary").json()

    assert (s["lookups"], s["lookup_tokens"], s["hit_tokens"]) == (3, (15 + 17 + 5) * BLOCK_TOKENS, 30 * BLOCK_TOKENS)
    assert s["hit_tokens_by_tier"] == {"host": 80, "disk": 40}
    assert s["hit_rate"] == pytest.approx(120 / 148)
    assert s["hit_rate_by_tier"] == {"host": pytest.approx(80 / 148), "disk": pytest.approx(40 / 148)}
    assert (s["prefill_tokens_saved"], s["prefill_tokens_computed"]) == (120, 28)
    assert s["prefill_saved_fraction"] == pytest.approx(120 / 148)
    assert s["loaded_tokens_by_tier"] == {"host": 40, "disk": 0}
    assert s["tiers"] == [
        dict(name="host", used_bytes=10 * 12288, capacity_bytes=128 << 10, blocks=10, evictions=5, demotions=0),
        dict(name="disk", used_bytes=15 * 16384, capacity_bytes=1 << 20, blocks=15, evictions=0, demotions=0),
    ]
    assert (s["namespaces"], s["leases_active"]) == (1, 1)
    assert 0 <= s["uptime_s"] < 60


def test_summary_before_any_traffic_has_no_rates(client):
    s = client.get("/api/summary").json()
    assert (s["lookup_tokens"], s["hit_rate"], s["prefill_saved_fraction"]) == (0, None, None)
    assert s["hit_rate_by_tier"] == {"host": None, "disk": None}
    assert [t["name"] for t in s["tiers"]] == ["host", "disk"]


def test_namespaces_rank_by_looked_up_tokens(traffic, client):
    alpha, beta, gamma, delta = (traffic.namespace(model) for model in ("alpha", "beta", "gamma", "delta"))
    traffic.put(beta, traffic.hashes(beta, 0, 4))
    traffic.lookup(alpha, traffic.hashes(alpha, 0, 3))
    traffic.lookup(beta, traffic.hashes(beta, 0, 8))  # its first 4 blocks hit
    traffic.lookup(gamma, traffic.hashes(gamma, 0, 5))
    traffic.metrics.prefill(gamma, saved_tokens=0, computed_tokens=20)
    traffic.metrics.prefill(delta, saved_tokens=12, computed_tokens=4)  # reported, never looked up

    body = client.get("/api/namespaces", params={"limit": 10}).json()

    assert body["total"] == 4
    label = {ns: f"{model}/{ns.hex()[:8]}" for ns, model in
             ((alpha, "alpha"), (beta, "beta"), (gamma, "gamma"), (delta, "delta"))}
    assert [r["namespace"] for r in body["rows"]] == [label[beta], label[gamma], label[alpha], label[delta]]
    top = body["rows"][0]
    assert (top["lookups"], top["lookup_tokens"], top["hit_tokens"], top["hit_rate"]) == (1, 32, 16, 0.5)
    assert body["rows"][1]["prefill_tokens_computed"] == 20
    last = body["rows"][3]
    assert (last["lookup_tokens"], last["hit_rate"], last["prefill_tokens_saved"]) == (0, None, 12)
    assert [r["namespace"] for r in client.get("/api/namespaces", params={"limit": 2}).json()["rows"]] == \
        [label[beta], label[gamma]]


def test_namespaces_limit_is_validated(client):
    assert client.get("/api/namespaces", params={"limit": 0}).status_code == 422
