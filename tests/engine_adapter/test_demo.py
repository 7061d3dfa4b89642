"""kvstore demo (quick size): every request reuses what it should, from the tier it should, and its
output equals a cold run."""

import socket
import tempfile

import pytest

from engine_adapter.demo import DemoConfig, run_demo
from kvstore.errors import InvalidRequest


def test_quick_demo_reuses_from_every_tier_and_matches_cold_runs(tmp_path):
    lines = []
    result = run_demo(DemoConfig.quick(data_dir=str(tmp_path)), lines.append)
    rows = {r["request"]: r for r in result["requests"]}
    assert result["outputs_identical"] is True
    for row in result["requests"]:
        assert row["computed_tokens"] + row["reused_tokens"] == row["prompt_tokens"]
    assert rows["chat 0.0"]["reused_tokens"] == 0 and rows["chat 1.0"]["reused_tokens"] == 128  # the system prompt
    assert rows["chat 0.2"]["reused_tokens"] > rows["chat 0.1"]["reused_tokens"], "later turns reuse earlier ones"
    assert any("host" in r["reused_from"] for r in result["requests"] if r["request"].startswith("chat"))
    cached = 896  # 7/8 of 1024: a 2-block suffix, so a run that saved its suffix would show 960
    assert [rows[f"long {k}"]["reused_tokens"] for k in ("cold", "resident", "host", "disk")] == [0, cached, cached, cached]
    assert rows["long resident"]["reused_from"] == f"device {cached}"
    assert rows["long host"]["reused_from"] == f"host {cached}" and rows["long disk"]["reused_from"] == f"disk {cached}"
    for case in ("resident", "host", "disk"):  # every run of the TTFT median, not only the first
        runs = rows[f"long {case}"]["runs"]
        assert len(runs) == 2 and all(run["reused_from"] == f"{'device' if case == 'resident' else case} {cached}"
                                      for run in runs), runs
        assert rows[f"long {case}"]["ttft_median_s"] == pytest.approx(sum(run["ttft_s"] for run in runs) / 2)
    assert result["prefill_tokens_reused"] == sum(r["reused_tokens"] for r in result["requests"])
    assert 0 < result["ttft_hit_s"] and 0 < result["ttft_cold_s"]
    assert any("outputs identical to cold runs: True" in line for line in lines)


def test_v32_quick_demo_with_hits_longer_than_index_topk(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the demo's own store directory goes
    result = run_demo(DemoConfig.quick(v32=True), lambda s: None)
    topk = result["model_config"]["index_topk"]
    assert result["long_prompt"]["cached_tokens"] > topk  # the indexer keys came back with the latents
    assert result["outputs_identical"] is True
    assert list(tmp_path.iterdir()) == [], "the temporary store directory outlived the demo"


def test_quick_demo_against_a_sidecar_reuses_the_same_and_matches_cold_runs(make_store, monkeypatch):
    """The sidecar's limits are low: the demo reads them from the environment, as the sidecar does,
    and keeps its batches within them."""
    from kvstore.service.limits import ServiceLimits
    from tests.connectors.sidecar_server import Sidecar

    monkeypatch.setenv("KVSTORE_MAX_TRANSFER_BLOCKS", "2")
    monkeypatch.setenv("KVSTORE_MAX_LOOKUP_BLOCKS", "16")  # the long prompt's hit is 14 blocks
    sidecar = Sidecar(make_store(host_bytes=64 << 20, page_bytes=256 << 10, disk_bytes=64 << 20, segment_bytes=4 << 20),
                      limits=ServiceLimits.from_env())
    try:
        lines = []
        result = run_demo(DemoConfig.quick(sidecar=sidecar.target), lines.append)
    finally:
        sidecar.stop()
    rows = {r["request"]: r for r in result["requests"]}
    assert result["outputs_identical"] is True
    assert rows["chat 0.0"]["reused_tokens"] == 0 and rows["chat 1.0"]["reused_tokens"] == 128
    assert any("host" in r["reused_from"] for r in result["requests"] if r["request"].startswith("chat"))
    assert [rows[f"long {k}"]["reused_tokens"] for k in ("cold", "resident", "host")] == [0, 896, 896]
    assert rows["long host"]["reused_from"] == "host 896", "tier figures come from the sidecar's stats"
    assert [run["reused_from"] for run in rows["long host"]["runs"]] == ["host 896"] * 2
    assert [run["reused_from"] for run in rows["long resident"]["runs"]] == ["device 896"] * 2
    assert "long disk" not in rows and result["ttft_disk_hit_s"] is None
    assert any(f"the sidecar at {sidecar.target}" in line for line in lines)
    assert any("skipped" in line for line in lines)
    assert sidecar.store.stats().stored_blocks > 0, "the engine's blocks live in the sidecar's store"


def test_a_demo_pointed_at_no_sidecar_says_so_before_it_starts():
    with socket.socket() as s:  # a port nobody listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lines = []
    with pytest.raises(InvalidRequest, match=f"no kvstore sidecar answers at 127.0.0.1:{port} \\(UNAVAILABLE: .*\\): "
                                             "start one with `kvstore serve`.*needs KVSTORE_TLS_CA"):
        run_demo(DemoConfig.quick(sidecar=f"127.0.0.1:{port}"), lines.append)
    assert not any("chat" in line for line in lines), "no request ran"


def test_a_demo_without_the_sidecars_token_is_told_to_set_it(make_store, monkeypatch):
    """Before, it read 'no kvstore sidecar answers ... start one with kvstore serve'."""
    from tests.connectors.sidecar_server import Sidecar

    monkeypatch.delenv("KVSTORE_TOKEN", raising=False)
    monkeypatch.delenv("KVSTORE_TOKEN_FILE", raising=False)
    sidecar = Sidecar(make_store(host_bytes=8 << 20, page_bytes=256 << 10), token="s3cret")
    try:
        with pytest.raises(InvalidRequest, match=rf"the kvstore sidecar at {sidecar.target} refused the demo's calls "
                                                 r"\(UNAUTHENTICATED: .*\): set KVSTORE_TOKEN or KVSTORE_TOKEN_FILE"):
            run_demo(DemoConfig.quick(sidecar=sidecar.target), lambda s: None)
    finally:
        sidecar.stop()


def test_a_demo_whose_store_cannot_open_leaves_no_temporary_directory(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(InvalidRequest, match="host tier capacity"):
        run_demo(DemoConfig.quick(host_capacity=1), lambda s: None)  # a host tier of one byte
    assert list(tmp_path.iterdir()) == []
