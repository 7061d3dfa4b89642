"""The sidecar's configuration: what it refuses at construction, with a message naming what works."""

from __future__ import annotations

import re

import pytest

from kvstore.errors import InvalidRequest
from kvstore.service.config import ServeConfig
from kvstore.service.config_file import as_environment
from kvstore.service.limits import ServiceLimits


@pytest.mark.parametrize("staging_bytes", [1, 1000, 4095])
def test_a_staging_area_smaller_than_one_page_is_refused_naming_what_works(staging_bytes):
    """Before, ``--staging-capacity 1000`` got as far as mapping an empty file (a traceback)."""
    with pytest.raises(InvalidRequest, match=f"staging capacity must be 0 .staging off. or at least 4096 bytes "
                                             f".one page., got {staging_bytes}"):
        ServeConfig(staging_bytes=staging_bytes)
    with pytest.raises(InvalidRequest, match="at least 4096 bytes"):
        ServeConfig.from_env({"KVSTORE_STAGING_BYTES": str(staging_bytes)})


@pytest.mark.parametrize("staging_bytes", [0, 4096, 256 << 20])
def test_no_staging_or_at_least_a_page_is_accepted(staging_bytes):
    assert ServeConfig(staging_bytes=staging_bytes).staging_bytes == staging_bytes


def test_staging_is_auto_unless_set_and_a_flag_of_auto_overrides_the_environment():
    assert ServeConfig.from_env({}).staging_bytes == "auto"
    assert ServeConfig.from_env({"KVSTORE_STAGING_BYTES": "64MiB"}).staging_bytes == 64 << 20
    assert ServeConfig.from_env({"KVSTORE_STAGING_BYTES": "Auto"}).staging_bytes == "auto"
    assert ServeConfig.from_env({"KVSTORE_STAGING_BYTES": "64MiB"}, staging_bytes="auto").staging_bytes == "auto"
    with pytest.raises(InvalidRequest, match="KVSTORE_STAGING_BYTES"):
        ServeConfig.from_env({"KVSTORE_STAGING_BYTES": "automatic"})


@pytest.mark.parametrize("key, value, reading", [
    ("KVSTORE_STREAM_IDLE_TIMEOUT_S", "30s", "as seconds"),
    ("KVSTORE_SHUTDOWN_GRACE_S", "10s", "as seconds"),
    ("KVSTORE_MAX_CHUNK_BYTES", "1 MiBs", "as a size"),
    ("KVSTORE_STAGING_BYTES", "lots", "as a size"),
    ("KVSTORE_DURABLE_PUTS", "sometimes", "as a boolean"),
])
def test_a_value_that_cannot_be_read_is_refused_naming_its_variable(key, value, reading):
    """Before, "cannot read '30s' as seconds" left the operator to guess which setting held it."""
    with pytest.raises(InvalidRequest, match=f"^{key}: cannot read '{value}' {reading}"):
        ServeConfig.from_env({key: value})


@pytest.mark.parametrize("settings, message", [
    ({"KVSTORE_MAX_TRANSFER_BLOCKS": "0"}, "^KVSTORE_MAX_TRANSFER_BLOCKS: must be positive and finite, got 0$"),
    ({"KVSTORE_STREAM_IDLE_TIMEOUT_S": "-5"}, "^KVSTORE_STREAM_IDLE_TIMEOUT_S: must be positive and finite, got -5.0$"),
    ({"KVSTORE_MAX_MESSAGE_BYTES": "1MiB"}, r"^KVSTORE_MAX_MESSAGE_BYTES: max_message_bytes \(1048576\) must exceed"),
    ({"KVSTORE_MAX_MESSAGE_BYTES": "3GiB"}, r"^KVSTORE_MAX_MESSAGE_BYTES: max_message_bytes must be at most 2147483647"),
    (as_environment({"max_transfer_blocks": 0}, "serve.toml"),
     "^max_transfer_blocks in serve.toml: must be positive and finite, got 0$"),
])
def test_a_readable_value_a_limit_refuses_names_where_it_was_set(settings, message):
    """Before, these named the field only ("max_transfer_blocks must be positive ..."), not the
    variable or the config file's key that held the value."""
    with pytest.raises(InvalidRequest, match=message):
        ServiceLimits.from_env(settings)


@pytest.mark.parametrize("name, value, problem", [
    ("ADDRESS", "127.0.0.1:500551", "the port must be a number from 0 to 65535 (0: any free one), not '500551'"),
    ("ADDRESS", "127.0.0.1:abc", "the port must be a number from 0 to 65535 (0: any free one), not 'abc'"),
    ("ADDRESS", "127.0.0.1:", "the port must be a number from 0 to 65535 (0: any free one), not ''"),
    ("ADDRESS", "::1:50551", "an IPv6 host goes in brackets, as in [::1]:PORT"),
    ("ADDRESS", "nonsense", "no :PORT"),
    ("ADDRESS", "unix:", "unix: needs a PATH"),
    ("HTTP_ADDRESS", "127.0.0.1:99999", "the port must be a number from 0 to 65535 (0: any free one), not '99999'"),
    ("HTTP_ADDRESS", "unix:/run/kv.sock", "a unix socket cannot serve this"),
    ("DATA_ADDRESS", "127.0.0.1:99999", "the port must be a number from 0 to 65535 (0: any free one), not '99999'"),
    ("DATA_ADDRESS", "0.0.0.0:-1", "the port must be a number from 0 to 65535 (0: any free one), not '-1'"),
])
def test_an_address_whose_port_is_not_a_port_is_refused_naming_the_setting(name, value, problem):
    """Before, port 500551 wrapped to 41799 without a word, 'abc' was blamed on a port in use, and
    99999 on --http-address raised an OverflowError traceback."""
    forms = {"ADDRESS": "HOST:PORT or unix:PATH", "HTTP_ADDRESS": "HOST:PORT or 'off'",
             "DATA_ADDRESS": "HOST:PORT, 'auto' or 'off'"}[name]
    expected = f"KVSTORE_{name}: must be {forms}, got {value!r}: {problem}"
    with pytest.raises(InvalidRequest) as refused:
        ServeConfig.from_env({f"KVSTORE_{name}": value})
    assert str(refused.value) == expected
    flag = "--" + name.lower().replace("_", "-")
    with pytest.raises(InvalidRequest, match=f"^{flag}: must be "):
        ServeConfig.from_env({}, **{name.lower(): value})


@pytest.mark.parametrize("name, value", [
    ("address", "127.0.0.1:0"), ("address", "0.0.0.0:65535"), ("address", "[::1]:50551"), ("address", "localhost:1"),
    ("address", "unix:/run/kvstore.sock"), ("http_address", "off"), ("http_address", "[::]:50552"),
    ("data_address", "auto"), ("data_address", "off"), ("data_address", "10.0.0.7:50553"),
])
def test_every_documented_address_form_is_accepted(name, value):
    assert getattr(ServeConfig.from_env({f"KVSTORE_{name.upper()}": value}), name) == value


@pytest.mark.parametrize("grace", [float("nan"), float("inf"), -1.0])
def test_a_shutdown_grace_that_is_not_finite_seconds_is_refused(grace):
    message = f"the shutdown grace must be finite seconds, 0 or more, got {grace}; --shutdown-grace-s or KVSTORE_"
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        ServeConfig(shutdown_grace_s=grace)
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        ServeConfig.from_env({"KVSTORE_SHUTDOWN_GRACE_S": str(grace)})


@pytest.mark.parametrize("interval", [float("nan"), float("inf"), -1.0])
def test_a_data_plane_probe_interval_that_is_not_finite_seconds_is_refused(interval):
    message = f"probe interval must be finite seconds, 0 (no probes) or more, got {interval}; KVSTORE_DATA_PLANE_PROBE_S"
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        ServeConfig.from_env({"KVSTORE_DATA_PLANE_PROBE_S": str(interval)})
    assert ServeConfig.from_env({"KVSTORE_DATA_PLANE_PROBE_S": "0"}).data_plane_probe_s == 0
    assert ServeConfig().data_plane_probe_s == 10
