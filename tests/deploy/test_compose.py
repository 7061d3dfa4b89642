"""deploy/compose: the sidecar, Prometheus and Grafana wired to each other.

Prometheus scrapes the sidecar's service name and HTTP port and loads the rules file it mounts;
Grafana's provisioning points at that Prometheus and at the folder the dashboard is mounted in;
the sidecar's /dev/shm holds its shared-memory segments; secrets exist where the sidecar is
told to read them; make-secrets.sh writes a token and a certificate for the names clients dial.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

from tests.deploy.helpers import COMPOSE, REPO, docker_bytes, port_of, shm_segment_bytes, yaml_document


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml_document(COMPOSE / "compose.yaml")


def bind_mounts(service: dict) -> dict[str, Path]:
    """{container path: host path} of the service's bind mounts (host paths relative to compose.yaml)."""
    mounts = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith("."):
            mounts[target] = (COMPOSE / source).resolve()
    return mounts


def host_path(mounts: dict[str, Path], container_path: str) -> Path:
    """Where ``container_path`` comes from on the host, through the mount that holds it."""
    path = PurePosixPath(container_path)
    for target, source in mounts.items():
        if path == PurePosixPath(target) or PurePosixPath(target) in path.parents:
            return source / path.relative_to(target)
    raise AssertionError(f"{container_path} is not mounted from the host: {mounts}")


def test_services_and_the_image_build(compose):
    assert set(compose["services"]) == {"kvstore", "prometheus", "grafana"}
    build = compose["services"]["kvstore"]["build"]
    context = (COMPOSE / build["context"]).resolve()
    assert context == REPO and (context / build["dockerfile"]).is_file()


def test_ports_are_published_on_loopback_only(compose):
    for name, service in compose["services"].items():
        for mapping in service.get("ports", []):
            assert mapping.startswith("127.0.0.1:"), f"{name} publishes {mapping} beyond loopback"


def test_sidecar_binds_the_ports_it_publishes(compose):
    service = compose["services"]["kvstore"]
    env = service["environment"]
    published = {int(mapping.rsplit(":", 1)[1]) for mapping in service["ports"]}
    assert published == {port_of(env["KVSTORE_ADDRESS"]), port_of(env["KVSTORE_HTTP_ADDRESS"]),
                         port_of(env["KVSTORE_DATA_ADDRESS"])} == {50551, 50552, 50553}
    assert env["KVSTORE_ADDRESS"].startswith("0.0.0.0:")


def test_shm_holds_the_host_tier_and_the_staging_area(compose):
    service = compose["services"]["kvstore"]
    assert docker_bytes(service["shm_size"]) > shm_segment_bytes(service["environment"])


def test_disk_tier_is_on_a_named_volume(compose):
    service = compose["services"]["kvstore"]
    volumes = {spec.split(":")[1]: spec.split(":")[0] for spec in service["volumes"]}
    disk_path = PurePosixPath(service["environment"]["KVSTORE_DISK_PATH"])
    (mount,) = [target for target in volumes if PurePosixPath(target) in disk_path.parents]
    assert volumes[mount] in compose["volumes"]


def test_sidecar_reads_token_and_certificate_from_declared_secrets(compose):
    service = compose["services"]["kvstore"]
    for variable in ("KVSTORE_TOKEN_FILE", "KVSTORE_TLS_CERT", "KVSTORE_TLS_KEY"):
        path = PurePosixPath(service["environment"][variable])
        assert path.parent == PurePosixPath("/run/secrets"), variable
        assert path.name in service["secrets"] and path.name in compose["secrets"], variable
    for secret in compose["secrets"].values():
        assert (COMPOSE / secret["file"]).resolve().parent == COMPOSE / "secrets"
    ignored = (COMPOSE / "secrets" / ".gitignore").read_text().split()
    assert "*" in ignored, "the secrets folder must keep its files out of git"


def test_prometheus_scrapes_the_sidecar_and_loads_the_mounted_rules(compose):
    prometheus = compose["services"]["prometheus"]
    mounts = bind_mounts(prometheus)
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config_in_container = PurePosixPath(config_flag.split("=", 1)[1])
    assert host_path(mounts, str(config_in_container)) == COMPOSE / "prometheus.yml"
    config = yaml_document(COMPOSE / "prometheus.yml")
    for rule_file in config["rule_files"]:
        assert host_path(mounts, str(config_in_container.parent / rule_file)) == COMPOSE / "rules.yml"
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvstore"]
    (target,) = job["static_configs"][0]["targets"]
    http_port = port_of(compose["services"]["kvstore"]["environment"]["KVSTORE_HTTP_ADDRESS"])
    assert target == f"kvstore:{http_port}" and job["metrics_path"] == "/metrics"
    assert job["scheme"] == "https"  # the sidecar serves HTTP over TLS with its certificate
    ca = PurePosixPath(job["tls_config"]["ca_file"])
    assert ca.parent == PurePosixPath("/run/secrets") and ca.name in prometheus["secrets"]


def test_grafana_provisions_the_prometheus_datasource_and_the_dashboard_folder(compose):
    grafana = compose["services"]["grafana"]
    mounts = bind_mounts(grafana)
    provisioning = host_path(mounts, "/etc/grafana/provisioning")
    (datasource,) = yaml_document(next((provisioning / "datasources").glob("*.yaml")))["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    (provider,) = yaml_document(next((provisioning / "dashboards").glob("*.yaml")))["providers"]
    assert (host_path(mounts, provider["options"]["path"]) / "kvstore.json").is_file()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(mounts, home).is_file()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_make_secrets_writes_a_token_and_a_certificate_for_the_names_clients_dial(tmp_path):
    subprocess.run(["sh", str(COMPOSE / "make-secrets.sh"), str(tmp_path)], check=True, capture_output=True, timeout=60)
    token = (tmp_path / "token").read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0
    text = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "tls.crt"), "-noout", "-text"],
                          check=True, capture_output=True, text=True).stdout
    for name in ("DNS:kvstore", "DNS:localhost", "IP Address:127.0.0.1"):
        assert name in text
    key_matches = subprocess.run(["openssl", "pkey", "-in", str(tmp_path / "tls.key"), "-pubout"],
                                 check=True, capture_output=True, text=True).stdout
    assert key_matches == subprocess.run(["openssl", "x509", "-in", str(tmp_path / "tls.crt"), "-pubkey", "-noout"],
                                         check=True, capture_output=True, text=True).stdout
    subprocess.run(["sh", str(COMPOSE / "make-secrets.sh"), str(tmp_path)], check=True, capture_output=True, timeout=60)
    assert (tmp_path / "token").read_text().strip() == token  # existing secrets are kept
