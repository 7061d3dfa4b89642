"""Store configuration: typed dataclasses, validated on construction, with embedded defaults.

Every field can come from the environment under one prefix, ``KVSTORE_`` (flags override the
environment, the environment overrides defaults)::

    KVSTORE_HOST_CAPACITY=4GiB      host tier bytes ("0" disables the tier; default: auto)
    KVSTORE_SHM_DIR=/dev/shm        where the host tier's shared-memory segment lives (default /dev/shm)
    KVSTORE_HOST_PAGE_BYTES=64MiB   the host tier's allocation unit (slabs of one block size each)
    KVSTORE_DISK_PATH=/var/lib/kvstore
    KVSTORE_DISK_CAPACITY=200GiB    disk tier bytes ("0" disables it; default: auto)
    KVSTORE_DURABLE=1               acknowledge a disk write only after fsync
    KVSTORE_DIRECT_IO=0             disk tier reads and writes buffered (default: O_DIRECT)
    KVSTORE_POLICY=adaptive         or lru, reuse_arc, hit_density, hit_density_pooled
    KVSTORE_WRITE_POLICY=write_through | on_eviction
    KVSTORE_PROMOTE_ON_HIT=1

Lease lengths are not configured here: each lookup names its own (a connector's ``lease_ttl_s``).

Auto sizes: the host tier takes a quarter of the memory available now (at most 64 GiB); the disk
tier takes half of the free space of its file system (at most 1 TiB).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Mapping, TypeVar

from kvstore.errors import InvalidRequest
from kvstore.lease import MAX_LEASED_BLOCKS
from kvstore.policies import DEFAULT_POLICY, POLICIES
from kvstore.store import WRITE_POLICIES, TieredStore
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_files import allocated_bytes, disk_capacity_problem
from kvstore.tiers.host import PAGE_ALIGN, HostTier, host_capacity_problem
from kvstore.tiers.shm_segment import default_shm_dir

ENV_PREFIX = "KVSTORE_"
T = TypeVar("T")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


MAX_SIZE = (1 << 63) - 1  # bytes: what a file offset or a C ssize_t holds


def parse_size(text: str | int) -> int:
    """``"4GiB"``, ``"512MB"``, ``"1048576"`` -> bytes, rounded down to a whole byte. A size
    between 0 and one byte (``"0.5"``: 0 would disable a tier) or past ``MAX_SIZE`` is refused."""
    if isinstance(text, int):
        return text
    exact = _exact_amount(text, "a size; examples: 4GiB, 512MB, 1048576")
    if 0 < exact < 1:
        raise InvalidRequest(f"{str(text).strip()!r} is less than one byte (0 disables a tier; give whole bytes)")
    return int(exact)


def parse_count(text: str) -> int:
    """``"16384"``, ``"16k"`` -> a whole number of things (blocks, leases); ``"1.5"`` is refused."""
    exact = _exact_amount(text, "a count; examples: 16384, 16k")
    if exact.denominator != 1:
        raise InvalidRequest(f"{str(text).strip()!r} is not a whole number")
    return int(exact)


def _exact_amount(text: str, what: str) -> Fraction:
    """A number with an optional decimal unit or binary byte unit, exactly, at most ``MAX_SIZE``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidRequest(f"cannot read {text!r} as {what}")
    exact = Fraction(match.group(1)) * _UNITS[unit]
    if exact > MAX_SIZE:
        raise InvalidRequest(f"{str(text).strip()!r} is more than any machine holds (at most 2**63 - 1)")
    return exact


def tier_size(problem: Callable[[int], str | None]) -> Callable[[str], int]:
    """A parser of a tier's capacity: a size, 0 (the tier disabled) or one ``problem`` does not refuse."""
    def parse(text: str) -> int:
        size = parse_size(text)
        if size and (reason := problem(size)):
            raise InvalidRequest(reason)
        return size
    return parse


host_size = tier_size(host_capacity_problem)
disk_size = tier_size(disk_capacity_problem)


def host_page_size(text: str) -> int:
    """The host tier's page size: a size of at least ``PAGE_ALIGN`` bytes."""
    size = parse_size(text)
    if size < PAGE_ALIGN:
        raise InvalidRequest(f"the host tier's page size must be at least {PAGE_ALIGN} bytes, got {size}")
    return size


def existing_directory(text: str) -> str:
    """A path that must already be a directory (the store creates its segments there, not it)."""
    if not os.path.isdir(text):
        reason = "is not a directory" if os.path.exists(text) else "does not exist"
        raise InvalidRequest(f"{text!r} {reason}; give an existing directory, as a tmpfs like /dev/shm")
    return text


def default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(base, "kvstore")


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


@dataclass
class HostConfig:
    capacity_bytes: int | None = None  # None: auto
    page_bytes: int = 64 << 20
    shm_dir: str | None = None
    prefault: bool = True  # touch every page at start (costs ~1-3 s per GiB once, keeps puts at memcpy speed)

    def resolved_capacity(self) -> int:
        """The configured capacity; auto: a quarter of the available memory, at most 64 GiB and
        at most half the free room of the shared-memory directory (a container's /dev/shm is often
        64 MiB; the rest of the room is left for the sidecar's staging area and other users),
        rounded down to whole pages where it holds one (the rest would go unused, with a warning)."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        room = shutil.disk_usage(self.shm_dir or default_shm_dir()).free
        auto = max(4096, min(available_memory_bytes() // 4, 64 << 30, room // 2))
        return auto - auto % self.page_bytes if auto >= self.page_bytes else auto  # whole pages: none unused


@dataclass
class DiskConfig:
    path: str = field(default_factory=lambda: os.path.join(default_data_dir(), "disk"))
    capacity_bytes: int | None = None  # None: auto
    segment_bytes: int = 256 << 20
    durable: bool = False
    direct_io: bool = True  # O_DIRECT reads (with read-ahead) and appends (write-behind): no double caching

    def resolved_capacity(self) -> int:
        """The configured capacity; auto: half the file system's free space, at most 1 TiB, where
        the room the tier's directory already takes (its segments and index) counts as free. Else
        a tier reopened full would get half of what it left free, and evict down to that at every
        start."""
        if self.capacity_bytes is not None:
            return self.capacity_bytes
        probe = self.path
        while not os.path.exists(probe):
            probe = os.path.dirname(probe) or "."
        return min((shutil.disk_usage(probe).free + allocated_bytes(self.path)) // 2, 1 << 40)


@dataclass
class StoreConfig:
    host: HostConfig | None = field(default_factory=HostConfig)
    disk: DiskConfig | None = field(default_factory=DiskConfig)
    policy: str = DEFAULT_POLICY
    write_policy: str = "write_through"
    promote_on_hit: bool = True
    max_leases: int = 65536
    max_leased_blocks: int = MAX_LEASED_BLOCKS

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise InvalidRequest(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise InvalidRequest(f"write_policy must be one of {WRITE_POLICIES}, got {self.write_policy!r}")
        if self.host is None and self.disk is None:
            raise InvalidRequest("at least one of the host and disk tiers must be enabled")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, host_settings: Mapping[str, object] | None = None,
                 disk_settings: Mapping[str, object] | None = None, **overrides) -> "StoreConfig":
        """Defaults, then ``KVSTORE_*`` variables, then ``overrides`` (None values are ignored) and
        the tiers' ``host_settings`` and ``disk_settings`` (``HostConfig``/``DiskConfig`` fields, a
        command's flags say). A tier whose capacity ends up 0 is disabled."""
        env = os.environ if environ is None else environ
        host, disk = HostConfig(), DiskConfig()
        for target, name, key, parse in ((host, "capacity_bytes", "HOST_CAPACITY", host_size),
                                         (host, "shm_dir", "SHM_DIR", existing_directory),
                                         (host, "page_bytes", "HOST_PAGE_BYTES", host_page_size),
                                         (disk, "path", "DISK_PATH", str),
                                         (disk, "capacity_bytes", "DISK_CAPACITY", disk_size),
                                         (disk, "durable", "DURABLE", parse_bool),
                                         (disk, "direct_io", "DIRECT_IO", parse_bool)):
            if ENV_PREFIX + key in env:
                setattr(target, name, read_setting(env, ENV_PREFIX + key, parse))
        values = {name: read_setting(env, ENV_PREFIX + key, parse)
                  for name, key, parse in (("policy", "POLICY", one_of(POLICIES)),
                                           ("write_policy", "WRITE_POLICY", one_of(WRITE_POLICIES)),
                                           ("promote_on_hit", "PROMOTE_ON_HIT", parse_bool))
                  if ENV_PREFIX + key in env}
        values.update({k: v for k, v in overrides.items() if v is not None})
        for target, settings in ((host, host_settings), (disk, disk_settings)):
            for name, value in (settings or {}).items():
                setattr(target, name, value)
        return cls(host=None if host.capacity_bytes == 0 else host,
                   disk=None if disk.capacity_bytes == 0 else disk, **values)

    def open_store(self, progress=None) -> "TieredStore":
        """Build the tiers (host first, then disk) and the store over them."""
        tiers = []
        if self.host is not None:
            tiers.append(HostTier(self.host.resolved_capacity(), self.host.page_bytes, self.host.shm_dir,
                                  prefault=self.host.prefault))
        if self.disk is not None:
            try:
                tiers.append(DiskTier(self.disk.path, self.disk.resolved_capacity(), self.disk.segment_bytes,
                                      self.disk.durable, progress=progress, direct_io=self.disk.direct_io))
            except BaseException:
                for tier in tiers:
                    tier.close()
                raise
        return TieredStore(tiers, policy=self.policy, write_policy=self.write_policy,
                           promote_on_hit=self.promote_on_hit, max_leases=self.max_leases,
                           max_leased_blocks=self.max_leased_blocks)


def one_of(choices) -> Callable[[str], str]:
    """A parser of one of ``choices`` (``InvalidRequest`` naming them otherwise)."""
    def parse(text: str) -> str:
        if text not in choices:
            raise InvalidRequest(f"must be one of {sorted(choices)}, got {text!r}")
        return text
    return parse


def parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise InvalidRequest(f"cannot read {text!r} as a boolean; use 1/0, true/false, yes/no or on/off")


def parse_seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidRequest(f"cannot read {text!r} as seconds; examples: 10, 2.5") from None


class Settings(dict):
    """``KVSTORE_*`` variables that remember where each was set, for error messages: ``origin``
    is the variable's own name unless ``origins`` says otherwise (a config file's key and path)."""

    def __init__(self, values: Mapping[str, str], origins: Mapping[str, str] | None = None):
        super().__init__(values)
        self.origins = dict(origins or {})

    def origin(self, key: str) -> str:
        return self.origins.get(key, key)


def read_setting(env: Mapping[str, str], key: str, parse: Callable[[str], T]) -> T:
    """``parse(env[key])``; a value it cannot read is refused naming where it was set."""
    return read_as(env.origin(key) if isinstance(env, Settings) else key, env[key], parse)


def read_as(origin: str, text: str, parse: Callable[[str], T]) -> T:
    """``parse(text)``; its ``InvalidRequest`` says ``origin`` (a variable, a flag, a file's key) first."""
    try:
        return parse(text)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{origin}: {exc}") from None
