"""benchmarks/connector_load.py runs end to end in both modes and reports consistent figures."""

import json
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "connector_load.py"


@pytest.mark.parametrize("mode, connector", [((), "StoreConnector"), (("--sidecar",), "SidecarConnector")])
def test_the_connector_load_benchmark_reports_layer_zero_before_the_whole_load(mode, connector):
    result = subprocess.run([sys.executable, str(SCRIPT), "--blocks", "4", "--repeats", "2", "--json", *mode],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)
    assert figures["connector"] == connector and figures["blocks"] == 4
    assert 0 < figures["first_layer_s"] <= figures["load_s"] and figures["memcpy_s"] > 0
    assert figures["first_layer_fraction_of_load"] == pytest.approx(figures["first_layer_s"] / figures["load_s"])
    assert figures["fraction_of_memcpy"] == pytest.approx(figures["memcpy_s"] / figures["load_s"])
