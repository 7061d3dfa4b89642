"""benchmarks/lookup_under_load.py runs end to end and reports consistent figures."""

import json
import pathlib
import subprocess
import sys

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "lookup_under_load.py"


def test_the_lookup_under_load_benchmark_measures_both_states_of_each_write_policy():
    result = subprocess.run([sys.executable, str(SCRIPT), "--seconds", "0.5", "--repeats", "1", "--host-blocks", "40",
                             "--disk-blocks", "8", "--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert set(figures["write_policies"]) == {"write_through", "on_eviction"}
    for summary in figures["write_policies"].values():
        assert summary["puts"][0] > 0 and summary["evictions"][0] > 0  # the writer really evicted
        for state in ("idle", "loaded"):
            lat = summary[state]
            assert 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["p99.9_ms"] <= lat["max_ms"]
            assert summary[f"{state}_lock_wait"]["p50_ms"] <= lat["p50_ms"]  # the wait is part of the lookup
        assert summary["p99_loaded_over_idle"] == summary["loaded"]["p99_ms"] / summary["idle"]["p99_ms"]


def test_the_benchmark_refuses_a_host_tier_too_small_for_its_prompt():
    result = subprocess.run([sys.executable, str(SCRIPT), "--host-blocks", "8"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "--host-blocks must be at least 36" in result.stderr
