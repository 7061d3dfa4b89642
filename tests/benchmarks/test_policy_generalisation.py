"""benchmarks/policy_generalisation.py runs end to end and reports consistent figures."""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "policy_generalisation.py"


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


def test_every_point_is_measured_and_no_policy_passes_belady():
    result = run("--variants", "1", "--scale", "0.05", "--fractions", "0.02,0.05", "--policies", "reuse_arc",
                 "--jobs", "2", "--json")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert [v["generator"] for v in figures["variants"]] == ["chat", "agent"]
    assert {(p["variant"], p["fraction"]) for p in figures["points"]} == {
        (v, f) for v in ("chat-0", "agent-0") for f in (0.02, 0.05)}
    for point in figures["points"]:
        shares = point["of_max"]
        assert set(shares) == {"lru", "reuse_arc", "belady"}  # LRU is always measured: ratios are to it
        assert all(0 <= shares[p] <= shares["belady"] <= 1 for p in ("lru", "reuse_arc"))
    summary = figures["summary"]
    assert summary["points"] + summary["saturated_points"] == 4
    if summary["points"]:
        assert summary["lru"]["median_to_lru"] == summary["lru"]["worst_to_lru"] == 1.0
        assert summary["lru"]["losses_to_lru"] == 0


def test_the_table_names_each_variant_and_policy():
    result = run("--variants", "1", "--scale", "0.05", "--fractions", "0.05", "--policies", "lru", "--jobs", "1")
    assert result.returncode == 0, result.stderr
    assert "chat-0" in result.stdout and "agent-0" in result.stdout and "belady" in result.stdout


def test_bad_arguments_are_refused_with_the_rule():
    for args, message in ((("--fractions", "2"),  "--fractions must lie in (0, 1]"),
                          (("--fractions", "x"), "--fractions takes numbers"),
                          (("--policies", "fifo"), "unknown policies ['fifo']"),
                          (("--scale", "0"), "--scale must lie in (0, 10]")):
        result = run(*args, timeout=60)
        assert result.returncode == 2 and message in result.stderr, (args, result.stderr)


def test_a_selector_s_regret_is_its_distance_below_the_best_of_its_candidates():
    import importlib.util

    spec = importlib.util.spec_from_file_location("policy_generalisation", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(bench)
    finally:
        del sys.modules[spec.name]
    names = ["lru", "hit_density", "hit_density_pooled", "reuse_arc", "adaptive"]

    def point(belady, **shares):
        return {"of_max": {"belady": belady, **shares}}

    points = [point(0.8, lru=0.9, hit_density=0.5, hit_density_pooled=0.6, reuse_arc=0.55, adaptive=0.58),  # 0.02 below
              point(0.8, lru=0.3, hit_density=0.5, hit_density_pooled=0.4, reuse_arc=0.45, adaptive=0.53),  # 0.03 above
              point(1.0, lru=0.3, hit_density=0.9, hit_density_pooled=0.4, reuse_arc=0.45, adaptive=0.4)]  # saturated
    summary = bench.summarise(points, names)
    row = summary["adaptive"]
    assert row["candidates"] == ["hit_density", "hit_density_pooled", "reuse_arc"]  # LRU above it is no regret
    assert row["mean_regret"] == pytest.approx(-0.005) and row["worst_regret"] == pytest.approx(0.02)
    assert "mean_regret" not in summary["hit_density"]  # no candidates: no regret
    assert "mean_regret" not in bench.summarise(points, ["lru", "hit_density", "adaptive"])["adaptive"]
