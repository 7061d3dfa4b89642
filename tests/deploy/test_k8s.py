"""deploy/k8s: the kinds a node-local sidecar needs, with labels, ports, probes and sizes that agree.

The DaemonSet's pods are what the Service selects and what the ServiceMonitor scrapes; the
container's ports are the ones its KVSTORE_*ADDRESS variables bind and the probes dial; the
token and certificate files it is told about are in the Secret volumes it mounts; its memory
limit holds the host tier it prefaults.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.helpers import K8S, k8s_quantity_bytes, port_of, shm_segment_bytes, yaml_document, yaml_documents

KINDS = {"Namespace", "ServiceAccount", "DaemonSet", "Service", "ServiceMonitor", "PrometheusRule"}


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    """{kind: object} of every resource the kustomization lists (one of each kind)."""
    found = {}
    for name in yaml_document(K8S / "kustomization.yaml")["resources"]:
        for obj in yaml_documents(K8S / name):
            assert obj["kind"] not in found, f"two {obj['kind']} objects"
            found[obj["kind"]] = obj
    return found


@pytest.fixture(scope="module")
def pod(objects) -> dict:
    return objects["DaemonSet"]["spec"]["template"]


@pytest.fixture(scope="module")
def container(pod) -> dict:
    (main,) = [c for c in pod["spec"]["containers"] if c["name"] == "kvstore"]
    return main


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def mount_of(container: dict, path: str) -> dict:
    """The volume mount that holds ``path`` (the longest matching mount path)."""
    mounts = [m for m in container["volumeMounts"] if path == m["mountPath"] or path.startswith(m["mountPath"] + "/")]
    assert mounts, f"nothing mounted at {path}"
    return max(mounts, key=lambda m: len(m["mountPath"]))


def volume(pod: dict, name: str) -> dict:
    (found,) = [v for v in pod["spec"]["volumes"] if v["name"] == name]
    return found


def test_kustomization_lists_every_manifest_and_the_expected_kinds(objects):
    listed = set(yaml_document(K8S / "kustomization.yaml")["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(objects) == KINDS


def test_namespace_is_the_kustomization_namespace(objects):
    assert objects["Namespace"]["metadata"]["name"] == yaml_document(K8S / "kustomization.yaml")["namespace"]


def test_selectors_match_the_pods_and_the_service(objects, pod):
    labels = pod["metadata"]["labels"]
    daemonset, service, monitor = objects["DaemonSet"], objects["Service"], objects["ServiceMonitor"]
    assert daemonset["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert pod["spec"]["serviceAccountName"] == objects["ServiceAccount"]["metadata"]["name"]


def test_service_ports_reach_the_container_ports_the_sidecar_binds(objects, container):
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    service = {p["name"]: p for p in objects["Service"]["spec"]["ports"]}
    assert {name: p["port"] for name, p in service.items()} == {"grpc": 50551, "http": 50552, "data": 50553}
    for name, port in service.items():
        assert ports[port["targetPort"]] == port["port"], name
    env = env_of(container)
    assert env["KVSTORE_ADDRESS"] == f"0.0.0.0:{ports['grpc']}"
    assert env["KVSTORE_HTTP_ADDRESS"] == f"0.0.0.0:{ports['http']}"
    assert env["KVSTORE_DATA_ADDRESS"] == f"0.0.0.0:{ports['data']}"  # GetSlots advertises the bound port
    assert objects["Service"]["spec"]["internalTrafficPolicy"] == "Local"  # a node's engines use its sidecar


def test_servicemonitor_scrapes_metrics_over_tls_keeping_the_namespace_label(objects):
    (endpoint,) = objects["ServiceMonitor"]["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in objects["Service"]["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["scheme"] == "https"  # the sidecar serves HTTP over TLS once it has a certificate
    assert endpoint["honorLabels"] is True


@pytest.mark.parametrize("probe", ["startupProbe", "readinessProbe", "livenessProbe"])
def test_probes_ask_the_grpc_health_service_on_the_grpc_port(container, probe):
    command = container[probe]["exec"]["command"]
    assert command[0] == "grpc_health_probe"
    flags = dict(arg.lstrip("-").partition("=")[::2] for arg in command[1:])
    grpc_port = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    assert port_of(flags["addr"]) == grpc_port
    assert "tls" in flags, "the sidecar serves gRPC over TLS"
    if probe == "readinessProbe":
        assert flags["service"] == "kvstore.v1.KVStore"


def test_sidecar_runs_unprivileged(pod, container):
    pod_security = pod["spec"]["securityContext"]
    assert pod_security["runAsNonRoot"] is True and pod_security["runAsUser"] != 0
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False
    assert security["readOnlyRootFilesystem"] is True
    assert security["capabilities"]["drop"] == ["ALL"] and "add" not in security["capabilities"]
    assert pod["spec"]["automountServiceAccountToken"] is False
    for init in pod["spec"].get("initContainers", []):
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}, init["name"]


def test_host_tier_shares_the_nodes_shm_and_disk_tier_is_on_the_node(pod, container):
    shm = volume(pod, mount_of(container, "/dev/shm")["name"])
    assert shm["hostPath"]["path"].startswith("/dev/shm/")  # a tmpfs engine pods on the node mount too
    env = env_of(container)
    data = volume(pod, mount_of(container, env["KVSTORE_DISK_PATH"])["name"])
    assert data["hostPath"]["type"] == "Directory"  # never created on the root disk by accident
    assert "rm -f /dev/shm/kvstore-*" in container["args"][0] and "exec kvstore serve" in container["args"][0]


def test_token_and_certificate_come_from_secret_volumes(pod, container):
    env = env_of(container)
    for variable, secret_name in (("KVSTORE_TOKEN_FILE", "kvstore-token"), ("KVSTORE_TLS_CERT", "kvstore-tls"),
                                  ("KVSTORE_TLS_KEY", "kvstore-tls")):
        path = env[variable]
        mount = mount_of(container, path)
        secret = volume(pod, mount["name"])["secret"]
        assert mount["readOnly"] is True
        assert secret["secretName"] == secret_name, variable
        assert path.removeprefix(mount["mountPath"] + "/") in {item["path"] for item in secret["items"]}, variable
        assert secret["defaultMode"] & 0o007 == 0, "secrets must not be world-readable"


def test_memory_holds_the_shared_memory_the_sidecar_prefaults(container):
    resources = container["resources"]
    assert k8s_quantity_bytes(resources["limits"]["memory"]) >= shm_segment_bytes(env_of(container)) + (1 << 30)
    assert resources["requests"]["memory"] == resources["limits"]["memory"]  # never evicted for using its tier
    assert "cpu" in resources["requests"]


def test_termination_grace_outlasts_the_sidecars_shutdown_grace(pod, container):
    assert pod["spec"]["terminationGracePeriodSeconds"] > float(env_of(container)["KVSTORE_SHUTDOWN_GRACE_S"])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomize_builds_every_object_into_the_namespace():
    result = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    built = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert {doc["kind"] for doc in built} == KINDS
    namespace = yaml_document(K8S / "kustomization.yaml")["namespace"]
    assert all(doc["metadata"].get("namespace") == namespace for doc in built if doc["kind"] != "Namespace")
