"""``python -m kvstore.service`` as a real process: serve, take traffic, SIGTERM, exit cleanly,
and the disk tier holds what was put when a new store opens it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.service import dataplane
from kvstore.service.client import KVStoreClient
from kvstore.service.limits import ServiceLimits
from kvstore.service.server import server_options
from kvstore.store import TieredStore
from kvstore.tiers.disk import DiskTier
from tests.conftest import payloads_for
from tests.kvstore.tiers.tmpfs import mounted_tmpfs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def start_serving(*args, env=None) -> tuple[subprocess.Popen, str, str]:
    """Start the sidecar (HTTP on a free port unless ``args`` say otherwise); returns the process,
    the address from its ``listening on`` line and the URL from its ``dashboard on`` line."""
    environment = {**os.environ, "PYTHONPATH": REPO, **(env or {})}
    http = [] if "--http-address" in args else ["--http-address", "127.0.0.1:0"]
    process = subprocess.Popen([sys.executable, "-m", "kvstore.service", *http, *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=environment)
    line = process.stdout.readline()
    url_line = process.stdout.readline() if "--http-address off" not in " ".join(args) else "dashboard on -"
    if "listening on" not in line or "dashboard on" not in url_line:
        process.kill()
        pytest.fail(f"no listening lines: {line!r} {url_line!r}; stderr: {process.communicate(timeout=10)[1]}")
    return process, line.split("listening on ", 1)[1].strip(), url_line.split("dashboard on ", 1)[1].strip()


def test_serve_takes_traffic_then_sigterm_exits_cleanly_and_disk_persists(tmp_path, namespace, spec, chain):
    process, address, url = start_serving("--address", "127.0.0.1:0", "--data-dir", str(tmp_path),
                                     "--host-capacity", "4MiB", env={"KVSTORE_DISK_CAPACITY": "256MiB"})
    try:
        assert address.startswith("127.0.0.1:") and not address.endswith(":0")
        payloads = payloads_for(spec, chain[:3])
        with KVStoreClient(address, timeout_s=30) as client:
            ns_id = client.register_namespace(namespace)
            assert client.put(ns_id, chain[:3], payloads).stored == 3
            assert client.lookup(ns_id, chain[:3]).tiers == ("host",) * 3
        with KVStoreClient(address, timeout_s=30, shared_memory=False) as remote:  # as from another host
            dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
            assert remote.load_shm(ns_id, chain[:3], dsts).tiers == ("host",) * 3
            assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        assert url.startswith("http://127.0.0.1:") and not url.endswith(":0/")
        with urllib.request.urlopen(url + "healthz", timeout=10) as reply:
            assert reply.read() == b"ok"
        with urllib.request.urlopen(url + "metrics", timeout=10) as reply:
            exposition = reply.read().decode()
        assert f'kvstore_put_blocks_total{{namespace="tiny-mla/{ns_id.hex()[:8]}",outcome="stored"}} 3.0' in exposition
        if dataplane.available():  # the 3 blocks streamed by the native data plane, not Python's Get
            assert f"kvstore_dataplane_sent_bytes_total {3.0 * spec.block_bytes}" in exposition
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill() if process.poll() is None else None
    assert process.returncode == 0, err
    assert "Traceback" not in err

    with TieredStore([DiskTier(str(tmp_path / "disk"), 256 << 20)]) as store:
        ns_id = store.register_namespace(namespace)
        assert store.lookup(ns_id, chain[:4]).tiers == ("disk",) * 3
        dsts = [np.zeros(spec.block_bytes, np.uint8) for _ in range(3)]
        assert store.load(ns_id, chain[:3], dsts).complete
        assert all(np.array_equal(d, p) for d, p in zip(dsts, payloads))


def test_a_sigterm_right_after_the_listening_line_shuts_down_gracefully(tmp_path):
    """The ready line came before the signal handlers: a supervisor's SIGTERM just after it killed
    the sidecar without its shutdown (exit -15, the store not closed)."""
    flags = ("--http-address", "off", "--data-address", "off", "--host-capacity", "4MiB", "--disk-capacity", "0")
    for _ in range(3):
        process, _, _ = start_serving("--address", "127.0.0.1:0", *flags, env={"KVSTORE_SHM_DIR": str(tmp_path)})
        process.terminate()
        assert process.wait(30) == 0, process.stderr.read()
    assert not list(tmp_path.glob("kvstore-*")), "every sidecar removed its shared-memory segment"


def test_serve_refuses_a_bad_address_with_a_message(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvstore.service", "--address", "nonsense", "--data-dir",
                           str(tmp_path), "--host-capacity", "1MiB", "--disk-capacity", "16MiB"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 2
    assert "--address: must be HOST:PORT or unix:PATH, got 'nonsense': no :PORT" in done.stderr
    for data_address, message in (("nowhere", "--data-address: must be HOST:PORT, 'auto' or 'off', got 'nowhere'"),
                                   ("0.0.0.0:0", "--data-address '0.0.0.0:0' is reachable from other hosts")):
        done = subprocess.run([sys.executable, "-m", "kvstore.service", "--data-address", data_address, "--data-dir",
                               str(tmp_path), "--host-capacity", "1MiB", "--disk-capacity", "16MiB"],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
        assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize("flags, env, message", [
    (("--host-capacity", "100"), {}, "--host-capacity: host tier capacity must be at least 4096 bytes (0 disables "
                                     "the tier), got 100"),
    ((), {"KVSTORE_HOST_CAPACITY": "5"}, "KVSTORE_HOST_CAPACITY: host tier capacity must be at least 4096 bytes"),
    (("--host-capacity", "1MiB", "--disk-capacity", "100"), {},
     "--disk-capacity: disk tier capacity must be at least 8192 bytes (0 disables the tier), got 100"),
])
def test_a_tier_capacity_too_small_is_refused_naming_where_it_was_set(tmp_path, flags, env, message):
    done = subprocess.run([sys.executable, "-m", "kvstore.service", "--http-address", "off", "--data-dir",
                           str(tmp_path), *flags], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_SHM_DIR": str(tmp_path), **env})
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_protect_metrics_without_a_token_is_refused_at_start(tmp_path):
    """Before, the sidecar started and /metrics answered anyone: nothing to ask for."""
    done = subprocess.run([sys.executable, "-m", "kvstore.service", "--protect-metrics", "--address", "127.0.0.1:0",
                           "--data-dir", str(tmp_path), "--host-capacity", "1MiB", "--disk-capacity", "16MiB"],
                          capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in {**os.environ, "PYTHONPATH": REPO}.items() if not k.startswith("KVSTORE_TOKEN")})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith("kvstore serve: --protect-metrics (KVSTORE_PROTECT_METRICS) needs a bearer token")


@pytest.mark.parametrize("flags, message", [
    (("--address", "nosuchhost.invalid:0", "--data-address", "off"),
     "cannot listen on 'nosuchhost.invalid:0': Name or service not known; give another --address"),
    (("--address", "127.0.0.1:0", "--data-address", "192.0.2.1:0"),  # TEST-NET-1: no local address
     "the data plane cannot start: cannot listen on 192.0.2.1:0: Cannot assign requested address"),
])
def test_an_address_the_os_cannot_bind_is_one_line_of_ours_without_grpc_logging(tmp_path, flags, message):
    """Before, gRPC's C core logged its bind failure (a long E... line) to stderr ahead of our message."""
    done = subprocess.run([sys.executable, "-m", "kvstore.service", *flags, "--http-address", "off", "--allow-plaintext",
                           "--data-dir", str(tmp_path), "--host-capacity", "1MiB", "--disk-capacity", "16MiB"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_TOKEN": "t" * 32})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.startswith(f"kvstore serve: {message}") and done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize("flag, forms", [("--address", "HOST:PORT or unix:PATH"),
                                         ("--http-address", "HOST:PORT or 'off'"),
                                         ("--data-address", "HOST:PORT, 'auto' or 'off'")])
def test_serve_refuses_a_port_past_65535_naming_the_flag_before_it_listens(tmp_path, flag, forms):
    """Before: --address 127.0.0.1:500551 listened on port 41799 (500551 mod 65536) without a word,
    --http-address 127.0.0.1:99999 died of an OverflowError traceback (exit 1), and
    --data-address 127.0.0.1:99999 was accepted."""
    addresses = {"--address": "127.0.0.1:0", "--http-address": "off", "--data-address": "off", flag: "127.0.0.1:99999"}
    done = subprocess.run([sys.executable, "-m", "kvstore.service", *(x for item in addresses.items() for x in item),
                           "--data-dir", str(tmp_path), "--host-capacity", "1MiB", "--disk-capacity", "16MiB"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr == (f"kvstore serve: {flag}: must be {forms}, got '127.0.0.1:99999': the port must be a "
                           "number from 0 to 65535 (0: any free one), not '99999'\n")


def test_serve_refuses_to_send_a_token_over_plain_http_beyond_loopback(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvstore.service", "--http-address", "0.0.0.0:0", "--data-dir",
                           str(tmp_path), "--host-capacity", "1MiB", "--disk-capacity", "16MiB"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_TOKEN": "secret"})
    assert done.returncode == 2
    assert "--http-address '0.0.0.0:0' is reachable from other hosts: give --tls-cert and --tls-key" in done.stderr


@pytest.mark.parametrize("setting, message", [
    ({"KVSTORE_WRITE_POLICY": "on_eviction"}, "durable puts need write_policy write_through, not 'on_eviction'"),
    ({"KVSTORE_DISK_CAPACITY": "0"}, "durable puts need a disk tier"),
])
def test_serve_refuses_durable_puts_where_a_put_does_not_reach_the_disk_before_its_answer(tmp_path, setting, message):
    done = subprocess.run([sys.executable, "-m", "kvstore.service", "--durable-puts", "--data-dir", str(tmp_path),
                           "--host-capacity", "1MiB", "--disk-capacity", setting.get("KVSTORE_DISK_CAPACITY", "16MiB")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, **setting})
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_serve_whose_shm_dir_cannot_hold_the_staging_area_exits_naming_it_and_leaves_no_segment(tmp_path):
    """The host tier fits the tmpfs, the staging area after it does not: the start fails with the
    room named, and the host arena already made is closed (before, the staging area was built
    outside the try that closes the store, and the arena stayed in the shm dir)."""
    with mounted_tmpfs(str(tmp_path / "shm"), 24 << 20) as shm:
        serving = subprocess.Popen([sys.executable, "-m", "kvstore.service", "--address", "127.0.0.1:0",
                                    "--http-address", "off", "--data-address", "off", "--host-capacity", "16MiB",
                                    "--disk-capacity", "0", "--staging-capacity", "16MiB"], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_SHM_DIR": shm})
        try:
            out, err = serving.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            serving.kill()
            pytest.fail(f"the sidecar started on a tmpfs that cannot hold it: {serving.communicate()}")
        left = os.listdir(shm)
    assert serving.returncode == 2 and "listening on" not in out, (out, err)
    assert f"kvstore serve: cannot reserve {16 << 20} bytes of shared memory in {shm}: {8 << 20} bytes are free" \
        in err, err
    assert "Traceback" not in err
    assert left == []


def test_serve_with_its_defaults_starts_in_a_64_mib_dev_shm_and_takes_same_host_puts(tmp_path, namespace, spec,
                                                                                    chain):
    """A container's default /dev/shm: the host tier takes half of it and the staging area half of
    the rest (before, the default 256 MiB staging area could not be reserved and the start failed)."""
    with mounted_tmpfs(str(tmp_path / "shm"), 64 << 20) as shm:
        process, address, _ = start_serving("--address", "127.0.0.1:0", "--http-address", "off", "--data-dir",
                                            str(tmp_path / "data"), env={"KVSTORE_SHM_DIR": shm,
                                                                        "KVSTORE_DISK_CAPACITY": "64MiB"})
        try:
            segments = {name: os.path.getsize(os.path.join(shm, name)) for name in os.listdir(shm)}
            staging = [size for name, size in segments.items() if name.startswith("kvstore-staging-")]
            assert sorted(segments.values()) == [16 << 20, 32 << 20] and staging == [16 << 20], segments
            payloads = payloads_for(spec, chain[:3])
            with KVStoreClient(address, timeout_s=30) as client:
                ns_id = client.register_namespace(namespace)
                assert client.put_shm(ns_id, chain[:3], payloads).stored == 3
                assert client.stats().tier("host").blocks == 3
        finally:
            process.terminate()
            process.communicate(timeout=30)
    assert process.returncode == 0


def test_an_integrity_failure_at_shutdown_is_named(make_store, monkeypatch):
    from kvstore.service.server import IntegrityCheckFailed, _check_integrity

    store = make_store(host_bytes=1 << 20, page_bytes=64 << 10)

    def disagree():
        raise AssertionError("host tier: 3 blocks in the directory, 2 in the tier")

    monkeypatch.setattr(store, "check_integrity", disagree)
    with pytest.raises(IntegrityCheckFailed, match="at shutdown: host tier: 3 blocks"):
        _check_integrity(store)
    store.close()


def test_a_second_sidecar_on_a_taken_port_fails_instead_of_sharing_it(tmp_path):
    """Python gRPC sets SO_REUSEPORT by default: the second would bind too and the kernel would
    split the clients between two stores."""
    flags = ("--http-address", "off", "--data-address", "off", "--host-capacity", "4MiB", "--disk-capacity", "0")
    first, address, _ = start_serving("--address", "127.0.0.1:0", *flags, env={"KVSTORE_SHM_DIR": str(tmp_path)})
    try:
        second = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--address", address, *flags],
                                capture_output=True, text=True, timeout=60,
                                env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_SHM_DIR": str(tmp_path)})
        assert first.poll() is None, "the first sidecar keeps serving"
    finally:
        first.terminate()
        first.wait(30)
    assert (second.returncode, second.stdout) == (2, "")
    assert second.stderr.startswith(f"kvstore serve: cannot listen on '{address}': address in use;")
    assert second.stderr.count("\n") == 1, "one line: no gRPC log line of the failed bind ahead of ours"


def test_a_second_sidecar_on_a_served_unix_socket_fails_instead_of_taking_it(tmp_path):
    """gRPC removes whatever is at a unix:PATH and binds anew: the second sidecar took the socket,
    and the first ran on, unreachable. A socket nothing answers on is still taken over."""
    socket_path = tmp_path / "kv.sock"
    flags = ("--http-address", "off", "--data-address", "off", "--host-capacity", "4MiB", "--disk-capacity", "0")
    env = {**os.environ, "PYTHONPATH": REPO, "KVSTORE_SHM_DIR": str(tmp_path)}
    first, address, _ = start_serving("--address", f"unix:{socket_path}", *flags, env={"KVSTORE_SHM_DIR": str(tmp_path)})
    try:
        second = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--address", address, *flags],
                                capture_output=True, text=True, timeout=60, env=env)
        with grpc.insecure_channel(address) as channel:  # the first still answers on its socket
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        first.terminate()
        first.wait(30)
    assert (second.returncode, second.stdout) == (2, "")
    assert f"cannot listen on '{address}': another process serves that socket (a running sidecar?)" in second.stderr
    stale = tmp_path / "stale.sock"  # a socket file nothing listens on, as a killed process leaves
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as gone:
        gone.bind(str(stale))
    third, _, _ = start_serving("--address", f"unix:{stale}", *flags, env={"KVSTORE_SHM_DIR": str(tmp_path)})
    third.terminate()  # it listened there (start_serving read its line)
    assert third.wait(30) == 0


def test_a_unix_path_that_is_a_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--address", f"unix:{path}", "--http-address",
                           "off", "--data-address", "off", "--host-capacity", "4MiB", "--disk-capacity", "0"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_SHM_DIR": str(tmp_path)})
    assert done.returncode == 2 and f"{path} exists and is not a socket" in done.stderr, done.stderr
    assert path.read_text() == "mine"


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="drops root's file-access capabilities")
def test_a_unix_socket_in_a_directory_the_user_may_not_write_names_that_cause(tmp_path):
    """Root without CAP_DAC_OVERRIDE stands in for a user without the right. Before, it read
    'is it in use?'."""
    directory = tmp_path / "locked"
    directory.mkdir(mode=0o555)
    done = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", sys.executable, "-m",
                           "kvstore.cli", "serve", "--address", f"unix:{directory}/kv.sock", "--http-address", "off",
                           "--data-address", "off", "--host-capacity", "4MiB", "--disk-capacity", "0"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_SHM_DIR": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert f"this user may not create a socket in {directory}" in done.stderr
    assert "Failed to add port" not in done.stderr, "gRPC's own line came first"


def test_a_unix_socket_in_a_missing_directory_is_refused_before_grpc_logs_its_own_line(tmp_path):
    """Before session 34 gRPC's 'add_port.cc ... Failed to add port to server' line came first."""
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "serve", "--address", f"unix:{tmp_path}/no/kv.sock",
                           "--http-address", "off", "--data-address", "off", "--host-capacity", "4MiB",
                           "--disk-capacity", "0"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO, "KVSTORE_SHM_DIR": str(tmp_path)})
    assert done.returncode == 2, done.stderr
    assert f"the directory {tmp_path}/no does not exist" in done.stderr
    assert "Failed to add port" not in done.stderr, done.stderr


def test_the_server_pings_its_clients_to_find_vanished_hosts():
    options = dict(server_options(ServiceLimits()))
    assert 0 < options["grpc.keepalive_time_ms"] <= 60_000 and 0 < options["grpc.keepalive_timeout_ms"] <= 20_000
    assert options["grpc.http2.max_pings_without_data"] == 0, "pings go on while a stalled stream sends nothing"
    assert options["grpc.keepalive_permit_without_calls"] == 1
