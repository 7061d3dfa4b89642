"""The plugin's settings from LMCache's extra_config, and the namespace derived from its metadata."""

from __future__ import annotations

import pytest

from connectors.lmcache.config import PluginConfig, warn_if_hash_seed_random
from connectors.lmcache.namespace import lmcache_namespace
from kvstore.errors import InvalidRequest
from kvstore.layout import BlockSpec

PREFIX = "remote_storage_plugin.kvstore."
V3 = {"kv_shape": "61x1x256x1x576", "use_mla": "true", "shapes": "1x61x256x576", "dtypes": "bfloat16",
      "fmt": "KV_MLA_FMT"}
V3_CHUNK_BYTES = 61 * 256 * 576 * 2


def test_lmcache_own_keys_alone_give_the_defaults():
    extra = {PREFIX + "module_path": "connectors.lmcache.adapter", PREFIX + "class_name": "KVStoreConnectorAdapter",
             "remote_storage_plugin.redis.redis_url": "redis://x:1", "save_chunk_meta": False}
    assert PluginConfig.from_extra_config(extra) == PluginConfig()
    assert PluginConfig.from_extra_config(None).address == "127.0.0.1:50551"


def test_our_keys_are_read_with_their_types_under_the_plugins_name():
    extra = {"remote_storage_plugin.kvstore.b.address": "unix:/run/kvstore.sock",
             "remote_storage_plugin.kvstore.b.shared_memory": "false", "remote_storage_plugin.kvstore.b.workers": "3",
             "remote_storage_plugin.kvstore.b.timeout_s": 2.5,
             "remote_storage_plugin.kvstore.b.namespace.cache_salt": "tenant-a"}
    config = PluginConfig.from_extra_config(extra, plugin_name="kvstore.b")
    assert (config.address, config.shared_memory, config.workers, config.timeout_s, config.cache_salt) == (
        "unix:/run/kvstore.sock", False, 3, 2.5, "tenant-a")


def test_an_unknown_key_is_refused_with_the_valid_ones():
    with pytest.raises(InvalidRequest, match=r"unknown LMCache extra_config keys "
                       r"\['remote_storage_plugin.kvstore.adress'\].*remote_storage_plugin.kvstore.address"):
        PluginConfig.from_extra_config({PREFIX + "adress": "127.0.0.1:1"})


@pytest.mark.parametrize("key, value, message", [
    ("workers", "many", "must be a number"),
    ("timeout_s", "0", "timeout_s must be positive"),
    ("lookup_timeout_s", "-1", "lookup_timeout_s must be positive"),
    ("lease_ttl_s", "7200", r"lease_ttl_s must be at most 3600 \(the store's longest lease\)"),
    ("shared_memory", "maybe", "as a boolean"),
])
def test_a_bad_value_is_refused_with_what_would_be_valid(key, value, message):
    with pytest.raises(InvalidRequest, match=message):
        PluginConfig.from_extra_config({PREFIX + key: value})


def test_the_token_comes_from_the_config_or_its_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_TOKEN", "from-env")
    assert PluginConfig().bearer_token() == "from-env"
    (tmp_path / "token").write_text("from-file\n")
    assert PluginConfig(token_file=str(tmp_path / "token")).bearer_token() == "from-file"
    assert PluginConfig(token="inline").bearer_token() == "inline"


def test_a_deepseek_v3_chunk_takes_one_62_row_block_of_256_tokens():
    namespace = lmcache_namespace("deepseek-ai/DeepSeek-V3", 256, V3_CHUNK_BYTES, V3)
    spec = BlockSpec.of(namespace)
    assert (namespace.block_size, namespace.num_layers, namespace.components) == (256, 62, ("mla_bf16",))
    assert spec.block_bytes == 18_284_544 and spec.block_bytes - V3_CHUNK_BYTES == 294_912
    assert ("lmcache.kv_shape", "61x1x256x1x576") in namespace.extra and namespace.engine == "lmcache"


def test_whatever_changes_the_bytes_changes_the_namespace():
    base = lmcache_namespace("deepseek-ai/DeepSeek-V3", 256, V3_CHUNK_BYTES, V3)
    fp8 = lmcache_namespace("deepseek-ai/DeepSeek-V3", 256, V3_CHUNK_BYTES // 2, {**V3, "dtypes": "float8_e4m3fn"})
    smaller_chunks = lmcache_namespace("deepseek-ai/DeepSeek-V3", 128, V3_CHUNK_BYTES // 2, V3)
    salted = lmcache_namespace("deepseek-ai/DeepSeek-V3", 256, V3_CHUNK_BYTES, V3, cache_salt="tenant-a")
    assert len({base.id, fp8.id, smaller_chunks.id, salted.id}) == 4
    assert base == lmcache_namespace("deepseek-ai/DeepSeek-V3", 256, V3_CHUNK_BYTES, dict(reversed(V3.items())))


@pytest.mark.parametrize("environ, warns", [({}, True), ({"PYTHONHASHSEED": "random"}, True),
                                             ({"PYTHONHASHSEED": "0"}, False), ({"PYTHONHASHSEED": "42"}, False)])
def test_a_random_hash_seed_is_warned_of_at_start(caplog, environ, warns):
    """LMCache seeds its chunk keys from it: unset, no chunk hits in another process."""
    with caplog.at_level("WARNING", logger="connectors.lmcache.config"):
        assert warn_if_hash_seed_random(environ) is warns
    assert any("PYTHONHASHSEED=0" in r.getMessage() for r in caplog.records) is warns
