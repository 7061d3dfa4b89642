"""The compose stack run for real, without Docker: its sidecar and its Prometheus, as configured.

The sidecar runs as ``python -m kvstore.service`` with compose.yaml's environment (addresses,
sizes and paths moved into a temp dir, secrets from make-secrets.sh); Prometheus runs with
prometheus.yml and rules.yml, its target pointed at that sidecar. Real traffic then checks the
security model the deploy relies on, the scrape over TLS, the recorded hit ratio, and that every
dashboard query returns series.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import grpc
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.keys import namespace_hashes
from kvstore.layout import BlockSpec
from kvstore.service.client import KVStoreClient
from tests.conftest import payloads_for, tiny_namespace
from tests.deploy.helpers import COMPOSE, RULES, dashboard, yaml_document

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")]
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$__interval": "1s", '"$instance"': '".*"'}


@dataclass
class Sidecar:
    grpc_port: int
    http_port: int
    token: str
    ca: Path  # the self-signed certificate, its own CA

    def client(self, token: str | None = None) -> KVStoreClient:
        return KVStoreClient(f"localhost:{self.grpc_port}", timeout_s=30, token=token or self.token,
                             root_certificates=self.ca.read_bytes())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, process: subprocess.Popen, timeout_s: float = 60.0):
    """Poll ``check()`` until it returns a truthy value; fail early if ``process`` died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"{what}: the process exited with {process.returncode}"
        try:
            if result := check():
                return result
        except (OSError, grpc.RpcError, urllib.error.URLError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def log_on_failure(log: Path):
    """Re-raise a failed start with the tail of the process's log."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{log.read_text(errors='replace')[-4000:]}") from None


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)


def sidecar_environment(tmp: Path, secrets: Path, grpc_port: int, http_port: int) -> dict[str, str]:
    """compose.yaml's sidecar environment, made to run here (small tiers, temp paths, free ports)."""
    compose = yaml_document(COMPOSE / "compose.yaml")
    env = {k: str(v) for k, v in compose["services"]["kvstore"]["environment"].items()}
    for key, value in env.items():  # /run/secrets/NAME -> the file compose mounts there
        if value.startswith("/run/secrets/"):
            env[key] = str(secrets / Path(compose["secrets"][PurePosixPath(value).name]["file"]).name)
    env.update(KVSTORE_ADDRESS=f"0.0.0.0:{grpc_port}", KVSTORE_HTTP_ADDRESS=f"0.0.0.0:{http_port}",
               KVSTORE_HOST_CAPACITY="16MiB", KVSTORE_STAGING_BYTES="4MiB", KVSTORE_DISK_CAPACITY="64MiB",
               KVSTORE_DISK_PATH=str(tmp / "disk"), KVSTORE_SHM_DIR=str(tmp))
    return env


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sidecar")
    secrets = tmp / "secrets"
    subprocess.run(["sh", str(COMPOSE / "make-secrets.sh"), str(secrets)], check=True, capture_output=True, timeout=60)
    grpc_port, http_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(sidecar_environment(tmp, secrets, grpc_port, http_port))
    log = open(tmp / "sidecar.log", "wb")
    process = subprocess.Popen([sys.executable, "-m", "kvstore.service"], cwd=tmp, env=env, stdout=log, stderr=log)
    found = Sidecar(grpc_port, http_port, (secrets / "token").read_text().strip(), secrets / "tls.crt")
    try:
        with log_on_failure(tmp / "sidecar.log"):
            wait_for("the sidecar's health service",
                     lambda: health(found, "") == health_pb2.HealthCheckResponse.SERVING, process)
        yield found
    finally:
        stop(process)
        log.close()


def health(sidecar: Sidecar, service: str) -> int:
    """The health status of ``service``, asked over TLS with no token."""
    credentials = grpc.ssl_channel_credentials(sidecar.ca.read_bytes())
    with grpc.secure_channel(f"localhost:{sidecar.grpc_port}", credentials) as channel:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


def https_get(sidecar: Sidecar, path: str, token: str | None = None) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(sidecar.ca))
    request = urllib.request.Request(f"https://localhost:{sidecar.http_port}{path}",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


@dataclass
class Prometheus:
    port: int
    process: subprocess.Popen

    def query(self, expr: str) -> list[dict]:
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict]:
        return wait_for(f"Prometheus to answer {expr}", lambda: self.query(expr), self.process, timeout_s)


@pytest.fixture(scope="module")
def prometheus(sidecar, tmp_path_factory):
    """prometheus.yml as compose runs it, scraping and evaluating every second."""
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml_document(COMPOSE / "prometheus.yml")
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["rule_files"] = [str(RULES)]
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvstore"]
    job["static_configs"] = [{"targets": [f"localhost:{sidecar.http_port}"]}]
    job["tls_config"]["ca_file"] = str(sidecar.ca)
    config["scrape_configs"] = [job]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")
    process = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                               cwd=tmp, stdout=log, stderr=log)
    try:
        server = Prometheus(port, process)
        with log_on_failure(tmp / "prometheus.log"):
            server.wait_for('up{job="kvstore"} == 1')
        yield server
    finally:
        stop(process)
        log.close()


def traffic(sidecar: Sidecar) -> None:
    """Puts, lookups, loads, a prefill report and one NOT_FOUND, so every panel has series."""
    namespace = tiny_namespace()
    spec, hashes = BlockSpec.of(namespace), namespace_hashes(namespace, np.arange(32))  # 8 blocks
    with sidecar.client() as client:
        ns_id = client.register_namespace(namespace)
        client.put(ns_id, hashes, payloads_for(spec, hashes))
        assert client.lookup(ns_id, hashes).hit_blocks == len(hashes)
        client.load(ns_id, hashes, [np.empty(spec.block_bytes, np.uint8) for _ in hashes])
        client.report_prefill(ns_id, saved_tokens=32, computed_tokens=8)
        with pytest.raises(grpc.RpcError) as error:
            client.lookup(b"\1" * 16, hashes)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_answers_without_a_token_and_store_calls_need_it(sidecar):
    for service in ("", "kvstore.v1.KVStore"):  # what the HEALTHCHECK and the Kubernetes probes ask
        assert health(sidecar, service) == health_pb2.HealthCheckResponse.SERVING
    with sidecar.client(token="not-the-token") as client, pytest.raises(grpc.RpcError) as error:
        client.stats()
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with sidecar.client() as client:
        assert client.stats() is not None


def test_http_is_tls_with_open_healthz_and_metrics_and_a_protected_page(sidecar):
    assert https_get(sidecar, "/healthz") == (200, "ok")
    status, body = https_get(sidecar, "/metrics")
    assert status == 200 and "kvstore_tier_capacity_bytes" in body
    assert https_get(sidecar, "/api/summary")[0] == 401
    assert https_get(sidecar, "/api/summary", sidecar.token)[0] == 200


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus is not installed (Debian package)")
def test_prometheus_records_the_hit_ratio_and_every_panel_has_series(sidecar, prometheus):
    traffic(sidecar)
    prometheus.wait_for("kvstore_lookup_tokens_total")  # scraped once after the first batch
    traffic(sidecar)  # the increase the rates see
    (overall,) = prometheus.wait_for("kvstore:token_hit_ratio:rate5m")
    assert float(overall["value"][1]) == pytest.approx(1.0, abs=0.05)  # every lookup hit in full
    by_tier = {r["metric"]["tier"]: float(r["value"][1])
               for r in prometheus.wait_for("kvstore:token_hit_ratio_by_tier:rate5m")}
    assert by_tier["host"] == pytest.approx(1.0, abs=0.05)
    prometheus.wait_for('kvstore:grpc_error_ratio:rate5m > 0')
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            assert prometheus.wait_for(expr, timeout_s=30), f"{panel['title']}: no series for {expr}"
