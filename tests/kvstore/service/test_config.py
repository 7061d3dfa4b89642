"""The sidecar's configuration: what it refuses at construction, with a message naming what works."""

from __future__ import annotations

import pytest

from kvstore.errors import InvalidRequest
from kvstore.service.config import ServeConfig


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
