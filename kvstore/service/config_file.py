"""``kvstore serve --config FILE``: the sidecar's settings in a TOML file.

Keys are the ``KVSTORE_*`` variable names without the prefix, in lower case, plus ``data_dir``::

    address = "unix:/run/kvstore/kvstore.sock"
    http_address = "127.0.0.1:50552"
    data_dir = "/var/lib/kvstore"          # the disk tier lives in DATA_DIR/disk
    host_capacity = "8GiB"
    disk_capacity = "200GiB"
    durable_puts = true
    max_leases_per_client = 2048

Precedence: embedded defaults < the file < ``KVSTORE_*`` variables < flags. The file is turned
into the variables it stands for, so every setting is parsed and checked in one place
(``ServeConfig.from_env``, ``StoreConfig.from_env``). An unknown key is an error that lists the
known ones.
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields
from typing import Mapping

from kvstore.config import ENV_PREFIX, Settings
from kvstore.errors import InvalidRequest
from kvstore.service.config import ServeConfig
from kvstore.service.limits import ServiceLimits

STORE_KEYS = ("host_capacity", "host_page_bytes", "shm_dir", "disk_path", "disk_capacity", "durable", "direct_io", "policy",
              "write_policy", "promote_on_hit")
# Every ServeConfig setting (limits are flat keys of their own), so a new setting cannot be left out.
SERVE_KEYS = (*(f.name for f in fields(ServeConfig) if f.name != "limits"), *(f.name for f in fields(ServiceLimits)))
KNOWN_KEYS = frozenset(STORE_KEYS + SERVE_KEYS + ("data_dir",))
# The on/off settings: a TOML true or false anywhere else (shutdown_grace_s = true) is a mistake, not 1 or 0.
BOOLEAN_KEYS = frozenset(("durable", "direct_io", "promote_on_hit",
                          *(f.name for f in fields(ServeConfig) if f.type == "bool")))


def read_config_file(path: str) -> Settings:
    """The ``KVSTORE_*`` variables ``path`` stands for (``data_dir`` becomes ``KVSTORE_DISK_PATH``)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover  (Python 3.10)
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f)
    except OSError as exc:
        raise InvalidRequest(f"cannot read the config file {path!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequest(f"the config file {path!r} is not valid TOML: {exc}") from None
    return as_environment(table, path)


def as_environment(table: Mapping[str, object], source: str = "the config file") -> Settings:
    """The variables ``table`` stands for, each remembering its key in ``source`` (for errors)."""
    unknown = sorted(set(table) - KNOWN_KEYS)
    if unknown:
        raise InvalidRequest(f"{source}: unknown keys {unknown}; known keys: {sorted(KNOWN_KEYS)}")
    if "data_dir" in table and "disk_path" in table:
        raise InvalidRequest(f"{source}: data_dir and disk_path both say where the disk tier lives "
                             "(in DATA_DIR/disk, or at DISK_PATH); keep one")
    env, origins = {}, {}
    for key, value in table.items():
        if isinstance(value, (dict, list)):
            raise InvalidRequest(f"{source}: {key} must be a string, number or boolean, got {type(value).__name__}")
        if isinstance(value, bool) and key not in BOOLEAN_KEYS:
            raise InvalidRequest(f"{source}: {key} is not an on/off setting, got {str(value).lower()}; "
                                 f"the on/off ones are {sorted(BOOLEAN_KEYS)}")
        text = ("1" if value else "0") if isinstance(value, bool) else str(value)
        variable = ENV_PREFIX + ("DISK_PATH" if key == "data_dir" else key.upper())
        env[variable] = os.path.join(text, "disk") if key == "data_dir" else text
        origins[variable] = f"{key} in {source}"
    return Settings(env, origins)


def layered_environment(config_file: str | None, environ: Mapping[str, str] | None = None) -> Settings:
    """The file's variables overlaid by the real environment (which wins)."""
    env = dict(os.environ if environ is None else environ)
    if not config_file:
        return Settings(env)
    file = read_config_file(config_file)
    return Settings({**file, **env}, {key: origin for key, origin in file.origins.items() if key not in env})
