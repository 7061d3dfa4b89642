"""``kvstore serve --config FILE``: a TOML file under the environment and the flags."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import fields

import pytest

from kvstore.config import StoreConfig
from kvstore.errors import InvalidRequest
from kvstore.service.cli import add_serve_arguments, store_config
from kvstore.service.client import KVStoreClient
from kvstore.service.config import ServeConfig
from kvstore.service.config_file import as_environment, layered_environment
from tests.kvstore.service.test_serve_process import REPO, start_serving


def test_file_settings_become_the_variables_they_stand_for_and_the_environment_wins(tmp_path):
    config = tmp_path / "kvstore.toml"
    config.write_text('address = "unix:/tmp/k.sock"\ndata_dir = "/srv/kv"\nhost_capacity = "8GiB"\n'
                      'durable_puts = true\nmax_leases_per_client = 7\nstream_idle_timeout_s = 2.5\n')
    environ = layered_environment(str(config), {"KVSTORE_HOST_CAPACITY": "1GiB"})
    serve = ServeConfig.from_env(environ)
    store = StoreConfig.from_env(environ)
    assert (serve.address, serve.durable_puts, serve.limits.max_leases_per_client) == ("unix:/tmp/k.sock", True, 7)
    assert serve.limits.stream_idle_timeout_s == 2.5, "a float limit keeps its fraction"
    assert store.disk.path == "/srv/kv/disk" and store.host.capacity_bytes == 1 << 30, "the environment wins"


@pytest.mark.parametrize("address, data_address, resolved", [
    ("127.0.0.1:50551", "auto", "127.0.0.1:0"), ("0.0.0.0:50551", "auto", "0.0.0.0:0"),
    ("unix:/run/kv.sock", "auto", "127.0.0.1:0"), ("[::1]:50551", "auto", "[::1]:0"),
    ("127.0.0.1:50551", "0.0.0.0:50553", "0.0.0.0:50553"), ("127.0.0.1:50551", "off", None),
])
def test_the_data_plane_listens_on_the_grpc_host_unless_told_otherwise(address, data_address, resolved):
    environ = {"KVSTORE_ADDRESS": address, "KVSTORE_DATA_ADDRESS": data_address}
    assert ServeConfig.from_env(environ).data_plane_address() == resolved
    assert as_environment({"data_address": "off"}) == {"KVSTORE_DATA_ADDRESS": "off"}


def test_unknown_keys_and_bad_values_are_clear_errors(tmp_path):
    with pytest.raises(InvalidRequest, match=r"unknown keys \['host_capacty'\]; known keys: .*'host_capacity'"):
        as_environment({"host_capacty": "1GiB"})
    with pytest.raises(InvalidRequest, match="must be a string, number or boolean"):
        as_environment({"address": ["a", "b"]})
    broken = tmp_path / "broken.toml"
    broken.write_text("address = \n")
    with pytest.raises(InvalidRequest, match="is not valid TOML"):
        layered_environment(str(broken), {})


def test_serve_reads_its_config_file_and_flags_override_it(tmp_path):
    config = tmp_path / "kvstore.toml"
    config.write_text(f'address = "unix:{tmp_path}/from-file.sock"\ndata_dir = "{tmp_path}"\n'
                      'host_capacity = "4MiB"\ndisk_capacity = "64MiB"\nhttp_address = "off"\n')
    process, address, _ = start_serving("--config", str(config), "--address", "127.0.0.1:0",
                                        env={"KVSTORE_SHM_DIR": str(tmp_path)})
    try:
        assert address.startswith("127.0.0.1:"), "the flag overrides the file"
        with KVStoreClient(address, timeout_s=10) as client:
            host = client.stats().tier("host")
            assert host.capacity_bytes == 4 << 20, "the file set the host tier"
        assert (tmp_path / "disk").is_dir()
    finally:
        process.terminate()
        process.wait(30)

    bad = tmp_path / "bad.toml"
    bad.write_text('adress = "x"\n')
    done = subprocess.run([sys.executable, "-m", "kvstore.service", "--config", str(bad)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 2 and "unknown keys ['adress']" in done.stderr


def test_every_serve_setting_is_a_file_key(tmp_path):
    """The README's rule: a TOML key is the KVSTORE_* variable without the prefix, in lower case."""
    config = tmp_path / "kvstore.toml"
    config.write_text("check_integrity_on_exit = true\nshutdown_grace_s = 2.5\n")
    serve = ServeConfig.from_env(layered_environment(str(config), {}))
    assert (serve.check_integrity_on_exit, serve.shutdown_grace_s) == (True, 2.5)
    for field in fields(ServeConfig):
        if field.name != "limits":
            assert as_environment({field.name: "1"}) == {f"KVSTORE_{field.name.upper()}": "1"}


def test_a_bad_value_in_the_config_file_is_named_by_its_key_and_the_file(tmp_path):
    """Before, a file with "4 MiBs" among several sizes said only "cannot read '4 MiBs' as a size"."""
    config = tmp_path / "kvstore.toml"
    config.write_text('host_capacity = "8MiB"\ndisk_capacity = "64MiB"\nstaging_bytes = "4 MiBs"\n'
                      'promote_on_hit = "sometimes"\n')
    environ = layered_environment(str(config), {})
    with pytest.raises(InvalidRequest, match=f"^staging_bytes in {re.escape(str(config))}: cannot read '4 MiBs' as a size"):
        ServeConfig.from_env(environ)
    with pytest.raises(InvalidRequest, match=f"^promote_on_hit in {re.escape(str(config))}: cannot read 'sometimes' as a boolean"):
        StoreConfig.from_env(environ)
    overridden = layered_environment(str(config), {"KVSTORE_PROMOTE_ON_HIT": "perhaps"})
    with pytest.raises(InvalidRequest, match="^KVSTORE_PROMOTE_ON_HIT: cannot read 'perhaps'"):
        StoreConfig.from_env(overridden)

    done = subprocess.run([sys.executable, "-m", "kvstore.service", "--config", str(config), "--address",
                           "127.0.0.1:0", "--http-address", "off", "--data-address", "off",
                           "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})
    assert done.returncode == 2, done.stderr
    assert f"kvstore serve: staging_bytes in {config}: cannot read '4 MiBs' as a size" in done.stderr
    flag = subprocess.run([sys.executable, "-m", "kvstore.service", "--host-capacity", "lots", "--address",
                           "127.0.0.1:0", "--http-address", "off", "--data-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
    assert flag.returncode == 2 and "kvstore serve: --host-capacity: cannot read 'lots' as a size" in flag.stderr


def serve_args(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("source", ["environment", "file"])
def test_a_capacity_of_0_outside_the_flags_disables_the_tier_for_serve(tmp_path, source):
    """Before, ``kvstore serve`` rebuilt a tier a variable or the file had disabled, at its
    default (automatic) capacity: only a flag's 0 disabled one."""
    settings = {"KVSTORE_HOST_CAPACITY": "0", "KVSTORE_DISK_CAPACITY": "16MiB"}
    if source == "file":
        config = tmp_path / "kvstore.toml"
        config.write_text('host_capacity = "0"\ndisk_capacity = "16MiB"\n')
        environ = layered_environment(str(config), {})
    else:
        environ = settings
    store = store_config(serve_args("--data-dir", str(tmp_path)), environ)
    assert store.host is None
    assert (store.disk.path, store.disk.capacity_bytes) == (str(tmp_path / "disk"), 16 << 20)
    store = store_config(serve_args(), {"KVSTORE_DISK_CAPACITY": "0", "KVSTORE_HOST_CAPACITY": "1MiB"})
    assert store.disk is None and store.host.capacity_bytes == 1 << 20


def test_a_capacity_flag_enables_a_tier_the_environment_disabled_and_keeps_its_other_settings(tmp_path):
    environ = {"KVSTORE_HOST_CAPACITY": "0", "KVSTORE_SHM_DIR": str(tmp_path), "KVSTORE_DISK_CAPACITY": "0"}
    store = store_config(serve_args("--host-capacity", "2MiB"), environ)
    assert (store.host.capacity_bytes, store.host.shm_dir, store.disk) == (2 << 20, str(tmp_path), None)
    with pytest.raises(InvalidRequest, match="at least one of the host and disk tiers"):
        store_config(serve_args("--host-capacity", "0"), {"KVSTORE_DISK_CAPACITY": "0"})


@pytest.mark.parametrize("make", [lambda tmp: tmp / "missing", lambda tmp: tmp / "file"])
def test_a_shared_memory_directory_that_is_no_directory_is_refused_naming_the_file_key(tmp_path, make):
    (tmp_path / "file").write_text("")
    config = tmp_path / "kvstore.toml"
    config.write_text(f'shm_dir = "{make(tmp_path)}"\n')
    with pytest.raises(InvalidRequest, match=f"shm_dir in {config}: '{make(tmp_path)}' (does not exist|is not a dir)"):
        store_config(serve_args(), layered_environment(str(config), {}))


@pytest.mark.parametrize("text, key, refusal", [
    ('host_capacity = "100"', "host_capacity", "host tier capacity must be at least 4096 bytes"),
    ('disk_capacity = "1KiB"', "disk_capacity", "disk tier capacity must be at least"),
    ('host_page_bytes = "1KiB"', "host_page_bytes", "the host tier's page size must be at least 4096 bytes"),
])
def test_a_capacity_the_tier_would_refuse_is_refused_naming_the_file_key(tmp_path, text, key, refusal):
    """Before, "100" parsed, and the tier then refused it naming --host-capacity or KVSTORE_HOST_CAPACITY,
    neither of which the operator had set."""
    config = tmp_path / "kvstore.toml"
    config.write_text(text + "\n")
    with pytest.raises(InvalidRequest, match=f"^{key} in {re.escape(str(config))}: {refusal}"):
        store_config(serve_args(), layered_environment(str(config), {}))
    with pytest.raises(InvalidRequest, match=f"^--host-capacity: {refusal}" if key == "host_capacity" else "."):
        store_config(serve_args("--host-capacity", "100", "--disk-capacity", "1KiB"), {})


def test_a_flag_capacity_past_the_machine_memory_is_refused_naming_the_flag():
    with pytest.raises(InvalidRequest, match="^--host-capacity: host tier capacity .* more than this machine's memory"):
        store_config(serve_args("--host-capacity", "1000TiB"), {})


@pytest.mark.parametrize("table, refusal", [
    ({"shutdown_grace_s": True}, "shutdown_grace_s is not an on/off setting, got true"),  # was read as 1 s
    ({"host_capacity": False}, "host_capacity is not an on/off setting, got false"),  # was 0: the tier disabled
    ({"data_dir": "/a", "disk_path": "/b"}, "data_dir and disk_path both say where the disk tier lives"),
])
def test_a_file_value_of_the_wrong_kind_or_a_contradiction_is_refused(table, refusal):
    with pytest.raises(InvalidRequest, match=f"^store.toml: {refusal}"):
        as_environment(table, "store.toml")


def test_a_file_boolean_still_sets_an_on_off_setting():
    environ = as_environment({"durable": True, "direct_io": False, "protect_metrics": True})
    store, serve = StoreConfig.from_env(environ), ServeConfig.from_env(environ)
    assert (store.disk.durable, store.disk.direct_io, serve.protect_metrics) == (True, False, True)


@pytest.mark.parametrize("value", [1.5, "2.0005k", "0.5"])
def test_a_count_limit_must_be_a_whole_number(value):
    """Before, max_lookup_blocks = 1.5 was floored to 1."""
    with pytest.raises(InvalidRequest, match=r"^max_lookup_blocks in store.toml: .* is not a whole number"):
        ServeConfig.from_env(as_environment({"max_lookup_blocks": value}, "store.toml"))


def test_count_and_byte_limits_read_their_units():
    limits = ServeConfig.from_env(as_environment({"max_lookup_blocks": "16k", "max_chunk_bytes": "512KiB",
                                                  "max_leases_per_client": 7})).limits
    assert (limits.max_lookup_blocks, limits.max_chunk_bytes, limits.max_leases_per_client) == (16000, 512 << 10, 7)
