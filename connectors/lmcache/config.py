"""The plugin's settings, read from LMCache's ``extra_config`` under ``remote_storage_plugin.NAME.``.

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: connectors.lmcache.adapter    # LMCache's own two keys
      remote_storage_plugin.kvstore.class_name: KVStoreConnectorAdapter
      remote_storage_plugin.kvstore.address: 127.0.0.1:50551                  # ours, all optional
      remote_storage_plugin.kvstore.token_file: /run/secrets/kvstore-token

Every key of ours has a default (the table in ``PluginConfig``), so only LMCache's two are needed
for a sidecar on its default loopback address. An unknown key under the prefix is a mistake and
raises ``InvalidRequest`` naming the valid ones.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields
from collections.abc import Mapping
from typing import Any

from kvstore.config import parse_bool
from kvstore.errors import InvalidRequest
from kvstore.service import security
from kvstore.service.config import DEFAULT_ADDRESS
from kvstore.store import MAX_LEASE_TTL_S

log = logging.getLogger(__name__)

LMCACHE_KEYS = ("module_path", "class_name")  # read by LMCache itself


def plugin_extra_config(address: str, plugin_name: str = "kvstore", **options: Any) -> dict[str, Any]:
    """The LMCache config entries that put the sidecar at ``address`` behind LMCache:
    ``remote_storage_plugins`` and ``extra_config``, with ``options`` as further keys of ours."""
    prefix = f"remote_storage_plugin.{plugin_name}."
    extra = {prefix + "module_path": "connectors.lmcache.adapter", prefix + "class_name": "KVStoreConnectorAdapter",
             prefix + "address": address, **{prefix + key: value for key, value in options.items()}}
    return {"remote_storage_plugins": [plugin_name], "extra_config": extra}


@dataclass(frozen=True)
class PluginConfig:
    address: str = DEFAULT_ADDRESS  # the sidecar: HOST:PORT or unix:PATH
    token: str | None = None  # bearer token; None: token_file, else KVSTORE_TOKEN / KVSTORE_TOKEN_FILE
    token_file: str | None = None  # file whose first line is the token
    tls_root_certs: str | None = None  # PEM file of the roots that sign the sidecar's certificate: TLS
    timeout_s: float = 10.0  # bound on every sidecar call; past it the call is a miss (a Get from disk
    # past it while the sidecar answers: gets and lookups stop at host memory for a back-off window)
    lookup_timeout_s: float = 1.0  # bound on a lookup (contains, list): LMCache's scheduler waits on it
    lease_ttl_s: float = 30.0  # how long a get pins the blocks it copies from shared memory
    shared_memory: bool = True  # same host: copy from the sidecar's mapped memory (falls back by itself;
    # false, or another host: the sidecar's native data plane streams those blocks, Put carries puts)
    workers: int = 2  # threads that make the blocking sidecar calls for LMCache's event loop
    cache_salt: str = ""  # namespace.cache_salt: tenants whose caches must never mix
    weights_hash: str = ""  # namespace.weights_hash: fine-tunes that share a model name

    def __post_init__(self) -> None:
        for name in ("timeout_s", "lookup_timeout_s", "lease_ttl_s", "workers"):
            if not getattr(self, name) > 0:
                raise InvalidRequest(f"remote_storage_plugin.*.{name} must be positive, got {getattr(self, name)}")
        if not self.lease_ttl_s <= MAX_LEASE_TTL_S:  # the sidecar would refuse every get
            raise InvalidRequest(f"remote_storage_plugin.*.lease_ttl_s must be at most {MAX_LEASE_TTL_S:g} (the "
                                 f"store's longest lease), got {self.lease_ttl_s}")
        if not self.address:
            raise InvalidRequest("remote_storage_plugin.*.address must be HOST:PORT or unix:PATH")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None, plugin_name: str = "kvstore") -> PluginConfig:
        """Our keys under ``remote_storage_plugin.{plugin_name}.`` in LMCache's ``extra_config``."""
        prefix = f"remote_storage_plugin.{plugin_name}."
        ours = {k[len(prefix):]: v for k, v in (extra or {}).items() if k.startswith(prefix)}
        keys = {_KEY_NAMES.get(f.name, f.name): f for f in fields(cls)}
        unknown = sorted(set(ours) - set(keys) - set(LMCACHE_KEYS))
        if unknown:
            raise InvalidRequest(f"unknown LMCache extra_config keys {[prefix + k for k in unknown]}; valid: "
                                 f"{[prefix + k for k in sorted(keys)]}")
        values = {keys[k].name: _convert(prefix + k, keys[k].type, v) for k, v in ours.items() if k in keys}
        return cls(**values)

    def bearer_token(self) -> str | None:
        """The token to send: ``token``, else ``token_file``'s, else the sidecar client's environment."""
        if self.token is None and self.token_file is None:
            return security.load_token(*security.token_from_env())
        return security.load_token(self.token, self.token_file)

    def root_certificates(self) -> bytes | None:
        if self.tls_root_certs is None:
            return None
        try:
            with open(self.tls_root_certs, "rb") as f:
                return f.read()
        except OSError as exc:
            raise InvalidRequest(f"cannot read tls_root_certs {self.tls_root_certs!r}: {exc.strerror}") from None


_KEY_NAMES = {"cache_salt": "namespace.cache_salt", "weights_hash": "namespace.weights_hash"}


def _convert(key: str, kind: str, value: Any) -> Any:
    """A YAML or string value as the field's type (``kind``: the annotation, a string here)."""
    if kind == "bool":
        return value if isinstance(value, bool) else parse_bool(str(value))
    if kind in ("int", "float"):
        try:
            return int(value) if kind == "int" else float(value)
        except (TypeError, ValueError):
            raise InvalidRequest(f"{key} must be a number ({kind}), got {value!r}") from None
    return None if value is None else str(value)


def warn_if_hash_seed_random(environ: Mapping[str, str] = os.environ) -> bool:
    """Warn (and return True) when ``PYTHONHASHSEED`` is unset or random. LMCache seeds its chunk
    keys from it (vLLM's first block hash, or Python's ``hash`` without vLLM): each process then
    names the same prompt's chunks differently, and nothing stored hits after a restart or in
    another engine."""
    if environ.get("PYTHONHASHSEED", "random") not in ("", "random"):
        return False
    log.warning("PYTHONHASHSEED is not set: LMCache names each process's chunks differently, so they hit in no "
                "other engine and not after a restart; set it to one value in every engine process "
                "(export PYTHONHASHSEED=0)")
    return True
