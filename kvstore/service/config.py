"""Configuration of the sidecar process (the store's own is ``kvstore.config.StoreConfig``).

Flags override the environment, the environment overrides the embedded defaults::

    KVSTORE_ADDRESS=127.0.0.1:50551       HOST:PORT, or unix:PATH for a unix socket
    KVSTORE_HTTP_ADDRESS=127.0.0.1:50552  metrics, /healthz and the dashboard; "off" disables it
    KVSTORE_DATA_ADDRESS=auto             the native data plane (kvstore.service.dataplane): HOST:PORT,
                                          "auto" (the gRPC address's host, any free port; 127.0.0.1
                                          for a unix socket) or "off"
    KVSTORE_TOKEN / KVSTORE_TOKEN_FILE    the bearer token, or a file whose first line is it
    KVSTORE_TLS_CERT, KVSTORE_TLS_KEY     PEM files: gRPC (and HTTP) over TLS
    KVSTORE_ALLOW_PLAINTEXT=0             serve every port beyond loopback without TLS (trusted networks only)
    KVSTORE_PROTECT_METRICS=0             /metrics needs the token too
    KVSTORE_STAGING_BYTES=256MiB          shared-memory staging for same-host puts; 0 disables it,
                                          else at least 4096 (one page)
    KVSTORE_DURABLE_PUTS=0                answer a put only once it is fsynced to the disk tier
    KVSTORE_SHUTDOWN_GRACE_S=10           how long in-flight calls may finish after SIGTERM
    KVSTORE_MAX_LOOKUP_BLOCKS=16384       and the other ServiceLimits fields (kvstore.service.limits):
    KVSTORE_MAX_TRANSFER_BLOCKS=32        KVSTORE_MAX_CHUNK_BYTES=1MiB, KVSTORE_MAX_MESSAGE_BYTES=4MiB,
                                          KVSTORE_MAX_CONCURRENT_TRANSFERS=16,
                                          KVSTORE_STREAM_IDLE_TIMEOUT_S=30 (seconds), ...

All three addresses default to loopback. Beyond loopback the sidecar refuses to start without a bearer
token, and without TLS (kvstore.service.security).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from kvstore.config import ENV_PREFIX, parse_bool, parse_seconds, parse_size, read_setting
from kvstore.errors import InvalidRequest
from kvstore.service.limits import ServiceLimits
from kvstore.service.staging import DEFAULT_STAGING_BYTES, MIN_STAGING_BYTES

DEFAULT_ADDRESS = "127.0.0.1:50551"
DEFAULT_HTTP_ADDRESS = "127.0.0.1:50552"
HTTP_OFF = "off"
DATA_OFF = "off"
DATA_AUTO = "auto"

_STRINGS = ("address", "http_address", "data_address", "token", "token_file", "tls_cert", "tls_key")
_PARSED = (("allow_plaintext", parse_bool), ("protect_metrics", parse_bool), ("durable_puts", parse_bool),
           ("check_integrity_on_exit", parse_bool), ("staging_bytes", parse_size), ("shutdown_grace_s", parse_seconds))


@dataclass(frozen=True)
class ServeConfig:
    address: str = DEFAULT_ADDRESS
    http_address: str = DEFAULT_HTTP_ADDRESS
    data_address: str = DATA_AUTO
    token: str | None = None
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    allow_plaintext: bool = False
    protect_metrics: bool = False
    staging_bytes: int = DEFAULT_STAGING_BYTES
    durable_puts: bool = False
    shutdown_grace_s: float = 10.0
    check_integrity_on_exit: bool = False  # after a graceful shutdown: IntegrityCheckFailed if the books disagree
    limits: ServiceLimits = field(default_factory=ServiceLimits)

    def __post_init__(self) -> None:
        if not (self.address.startswith("unix:") or ":" in self.address):
            raise InvalidRequest(f"address must be HOST:PORT or unix:PATH, got {self.address!r}")
        if self.http_address != HTTP_OFF and (self.http_address.startswith("unix:") or ":" not in self.http_address):
            raise InvalidRequest(f"http_address must be HOST:PORT or 'off', got {self.http_address!r}")
        if self.data_address not in (DATA_OFF, DATA_AUTO) and (self.data_address.startswith("unix:")
                                                                or ":" not in self.data_address):
            raise InvalidRequest(f"data_address must be HOST:PORT, 'auto' or 'off', got {self.data_address!r}")
        if self.staging_bytes < 0 or 0 < self.staging_bytes < MIN_STAGING_BYTES:
            raise InvalidRequest(f"staging capacity must be 0 (staging off) or at least {MIN_STAGING_BYTES} bytes "
                                 f"(one page), got {self.staging_bytes}; --staging-capacity or KVSTORE_STAGING_BYTES")
        if self.shutdown_grace_s < 0:
            raise InvalidRequest(f"shutdown_grace_s must not be negative, got {self.shutdown_grace_s}")

    def data_plane_address(self) -> str | None:
        """Where the native data plane listens: None when off; "auto" resolves to the gRPC
        address's host (127.0.0.1 behind a unix socket) and any free port."""
        if self.data_address == DATA_OFF:
            return None
        if self.data_address != DATA_AUTO:
            return self.data_address
        host = "127.0.0.1" if self.address.startswith("unix:") else self.address.rsplit(":", 1)[0]
        return f"{host}:0"

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "ServeConfig":
        """Defaults, then ``KVSTORE_*`` variables, then ``overrides`` (None values are ignored)."""
        env = os.environ if environ is None else environ
        values: dict = {name: env[ENV_PREFIX + name.upper()] for name in _STRINGS if ENV_PREFIX + name.upper() in env}
        values.update({name: read_setting(env, ENV_PREFIX + name.upper(), parse)
                       for name, parse in _PARSED if ENV_PREFIX + name.upper() in env})
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(limits=ServiceLimits.from_env(env), **values)
