"""benchmarks/save_copy.py runs end to end and reports consistent figures; its two ways of
copying agree byte for byte (the script refuses to time them otherwise)."""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "save_copy.py"


def test_the_save_copy_benchmark_reports_each_way_against_the_ceiling():
    result = subprocess.run([sys.executable, str(SCRIPT), "--blocks", "2", "--repeats", "2", "--json"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["blocks"] == 2 and all(figures[f"{way}_s"] > 0 for way in ("layer_pages", "page_by_page", "memcpy"))
    assert figures["layer_pages_fraction_of_memcpy"] == pytest.approx(figures["memcpy_s"] / figures["layer_pages_s"])
    assert figures["speedup_over_page_by_page"] == pytest.approx(figures["page_by_page_s"] / figures["layer_pages_s"])


def test_bad_arguments_are_refused_with_a_message():
    result = subprocess.run([sys.executable, str(SCRIPT), "--blocks", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--blocks and --repeats must be at least 1" in result.stderr
