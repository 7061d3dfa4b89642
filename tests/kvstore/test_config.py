"""StoreConfig: sizes, environment, validation, and the store it builds."""

from dataclasses import fields

import pytest

from kvstore.config import DiskConfig, HostConfig, StoreConfig, parse_size
from kvstore.errors import InvalidRequest
from kvstore.service.config_file import as_environment


@pytest.mark.parametrize("text, expected", [("4GiB", 4 << 30), ("512MB", 512_000_000), ("1048576", 1 << 20),
                                            (" 2 mib ", 2 << 20), ("1.5KiB", 1536), (77, 77)])
def test_parse_size_reads_units(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "4 parsecs", "-1GiB"])
def test_parse_size_rejects_garbage_with_examples(text):
    with pytest.raises(InvalidRequest, match="examples"):
        parse_size(text)


@pytest.mark.parametrize("text, message", [
    ("0.5", "'0.5' is less than one byte"),  # rounded to 0, which disables a tier
    ("1" * 400, "is more than any machine holds"),  # float infinity: OverflowError
    ("99999999999999999999TiB", "is more than any machine holds"),
])
def test_parse_size_refuses_a_size_below_one_byte_or_past_any_machine(text, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_size(text)


def test_a_host_tier_larger_than_this_machine_is_refused_before_anything_is_allocated(tmp_path):
    """3.6 PB raised MemoryError from the slab's page list, before the shared-memory check could say why."""
    from kvstore.tiers.host import HostTier

    with pytest.raises(InvalidRequest, match="more than this machine's memory"):
        HostTier(4_000_000 << 40, shm_dir=str(tmp_path))


def test_environment_sets_every_knob(tmp_path):
    env = {"KVSTORE_HOST_CAPACITY": "8MiB", "KVSTORE_DISK_PATH": str(tmp_path / "d"),
           "KVSTORE_DISK_CAPACITY": "16MiB", "KVSTORE_DURABLE": "yes", "KVSTORE_POLICY": "lru",
           "KVSTORE_WRITE_POLICY": "on_eviction", "KVSTORE_PROMOTE_ON_HIT": "0", "UNRELATED": "x"}
    cfg = StoreConfig.from_env(env)
    assert cfg.host.capacity_bytes == 8 << 20
    assert (cfg.disk.path, cfg.disk.capacity_bytes, cfg.disk.durable) == (str(tmp_path / "d"), 16 << 20, True)
    assert (cfg.write_policy, cfg.promote_on_hit) == ("on_eviction", False)


def test_overrides_beat_environment():
    cfg = StoreConfig.from_env({"KVSTORE_WRITE_POLICY": "on_eviction"}, write_policy="write_through")
    assert cfg.write_policy == "write_through"


def test_zero_capacity_disables_a_tier():
    cfg = StoreConfig.from_env({"KVSTORE_HOST_CAPACITY": "0"})
    assert cfg.host is None and cfg.disk is not None


@pytest.mark.parametrize("env, message", [
    ({"KVSTORE_POLICY": "fifo"}, "KVSTORE_POLICY: must be one of"),
    ({"KVSTORE_WRITE_POLICY": "sometimes"}, "KVSTORE_WRITE_POLICY: must be one of"),
    ({"KVSTORE_DURABLE": "maybe"}, "boolean"),
    ({"KVSTORE_HOST_CAPACITY": "0", "KVSTORE_DISK_CAPACITY": "0"}, "at least one"),
])
def test_bad_configuration_is_refused_with_a_reason(env, message):
    with pytest.raises(InvalidRequest, match=message):
        StoreConfig.from_env(env)


def test_the_lease_ttl_is_each_clients_choice_not_a_store_setting():
    """KVSTORE_LEASE_TTL_S was documented ("lease time-to-live, default 30") and parsed, but no
    lease used it: every lookup names its own TTL (the connectors' ``lease_ttl_s``, 60 s). A
    value that did nothing is gone rather than kept; its config-file key is now an unknown key."""
    assert "lease_ttl_s" not in {f.name for f in fields(StoreConfig)}
    with pytest.raises(InvalidRequest, match=r"unknown keys \['lease_ttl_s'\]"):
        as_environment({"lease_ttl_s": "30s"})


def test_auto_sizes_are_positive_and_bounded(tmp_path):
    assert 0 < HostConfig().resolved_capacity() <= 64 << 30
    assert 0 < DiskConfig(path=str(tmp_path / "not" / "yet")).resolved_capacity() <= 1 << 40


@pytest.mark.parametrize("page_bytes", [64 << 20, 3 << 20, 1 << 20])
def test_the_auto_host_capacity_is_whole_pages_so_no_start_warns_of_an_unused_rest(page_bytes):
    """Before, a quarter of the available memory, not a multiple of the page: every start with an
    automatic capacity below about 6.4 GiB logged a WARNING of the unused rest."""
    capacity = HostConfig(page_bytes=page_bytes).resolved_capacity()
    assert capacity % page_bytes == 0 and capacity >= page_bytes


def test_the_auto_host_capacity_fits_in_half_the_room_of_its_shared_memory_directory(tmp_path):
    """Before, it was a quarter of the available memory whatever the directory held: a container's
    64 MiB /dev/shm got a multi-GiB tier, refused at start (earlier: SIGBUS at the first write past the room)."""
    from tests.kvstore.tiers.tmpfs import mounted_tmpfs

    with mounted_tmpfs(str(tmp_path / "shm"), 16 << 20) as shm:
        capacity = HostConfig(shm_dir=shm).resolved_capacity()
        assert 0 < capacity <= 8 << 20
        StoreConfig(host=HostConfig(shm_dir=shm, page_bytes=1 << 20), disk=None).open_store().close()


def test_a_disk_tier_of_auto_size_reopened_full_keeps_its_size_and_its_blocks(tmp_path):
    """The auto size is half the free space, and the room the tier's own files take counts as
    free: before, a tier that filled its half reopened with half of what it had left free, and
    evicted half its blocks at every start (a real tmpfs of 24 MiB, the store opened three times)."""
    from kvstore.keys import namespace_hashes
    from kvstore.layout import BlockSpec
    from tests.conftest import payloads_for, tiny_namespace
    from tests.kvstore.tiers.tmpfs import mounted_tmpfs

    with mounted_tmpfs(str(tmp_path / "fs"), 24 << 20) as fs:
        config = StoreConfig(host=None, disk=DiskConfig(path=f"{fs}/disk", segment_bytes=1 << 20, direct_io=False))
        namespace = tiny_namespace()
        spec, hashes = BlockSpec.of(namespace), namespace_hashes(namespace, list(range(4 * 4000)))
        capacities, held = [], []
        for start in range(3):
            capacities.append(config.disk.resolved_capacity())
            with config.open_store() as store:
                ns_id = store.register_namespace(namespace)
                held.append(store.stats().tiers[0].blocks)
                if start == 0:  # fill it: more blocks than the tier holds
                    for i in range(0, len(hashes), 100):
                        store.put(ns_id, hashes[i:i + 100], payloads_for(spec, hashes[i:i + 100]),
                                  parent=hashes[i - 1] if i else None)
                    store.flush()
                    full = store.stats().tiers[0]
                    assert full.evictions > 0 and full.used_bytes > capacities[0] * 0.9
                    held[0] = full.blocks
        assert max(capacities) - min(capacities) < 256 << 10, capacities
        assert held[1] == held[2] == held[0], held


def test_open_store_builds_host_then_disk(tmp_path):
    cfg = StoreConfig(host=HostConfig(capacity_bytes=1 << 20, page_bytes=1 << 20, shm_dir=str(tmp_path), prefault=False),
                      disk=DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=4 << 20))
    with cfg.open_store() as store:
        assert [t.name for t in store.tiers] == ["host", "disk"]
        assert store.tiers[0].capacity_bytes == 1 << 20 and store.tiers[1].capacity_bytes == 4 << 20
    assert not list(tmp_path.glob("kvstore-*")), "closing the store removes the shared-memory file"


@pytest.mark.parametrize("key, value, reading", [
    ("KVSTORE_PROMOTE_ON_HIT", "sometimes", "as a boolean; use 1/0"),
    ("KVSTORE_HOST_CAPACITY", "4 MiBs", "as a size; examples"),
    ("KVSTORE_HOST_PAGE_BYTES", "lots", "as a size; examples"),
    ("KVSTORE_DIRECT_IO", "maybe", "as a boolean; use 1/0"),
])
def test_a_value_that_cannot_be_read_is_refused_naming_its_variable(key, value, reading):
    """Before, the message said only "cannot read 'sometimes' as a boolean": which of a dozen
    variables held it was left to guess."""
    with pytest.raises(InvalidRequest, match=f"^{key}: cannot read '{value}' {reading}"):
        StoreConfig.from_env({key: value})


def test_a_policy_not_among_the_choices_is_refused_naming_where_it_was_set():
    with pytest.raises(InvalidRequest, match=r"^KVSTORE_POLICY: must be one of \['adaptive', .*\], got 'foo'$"):
        StoreConfig.from_env({"KVSTORE_POLICY": "foo"})
    with pytest.raises(InvalidRequest, match=r"^write_policy in store.toml: must be one of \['on_eviction', "
                                             r"'write_through'\], got 'writethrough'$"):
        StoreConfig.from_env(as_environment({"write_policy": "writethrough"}, "store.toml"))
