"""Configuration of the sidecar process (the store's own is ``kvstore.config.StoreConfig``).

Flags override the environment, the environment overrides the embedded defaults::

    KVSTORE_ADDRESS=127.0.0.1:50551       HOST:PORT, or unix:PATH for a unix socket (every HOST:PORT here:
                                          a port from 0, any free one, to 65535; IPv6 as [::1]:PORT)
    KVSTORE_HTTP_ADDRESS=127.0.0.1:50552  metrics, /healthz and the dashboard; "off" disables it
    KVSTORE_DATA_ADDRESS=auto             the native data plane (kvstore.service.dataplane): HOST:PORT,
                                          "auto" (the gRPC address's host, any free port; 127.0.0.1
                                          for a unix socket) or "off"
    KVSTORE_TOKEN / KVSTORE_TOKEN_FILE    the bearer token, or a file whose first line is it
    KVSTORE_TLS_CERT, KVSTORE_TLS_KEY     PEM files: gRPC (and HTTP) over TLS
    KVSTORE_ALLOW_PLAINTEXT=0             serve every port beyond loopback without TLS (trusted networks only)
    KVSTORE_PROTECT_METRICS=0             /metrics needs the token too
    KVSTORE_STAGING_BYTES=auto            shared-memory staging for same-host puts; 0 disables it,
                                          else at least 4096 (one page); auto: 256MiB, at most half
                                          the room the host tier left in the shared-memory directory
    KVSTORE_DURABLE_PUTS=0                answer a put only once it is fsynced to the disk tier
    KVSTORE_SHUTDOWN_GRACE_S=10           how long in-flight calls may finish after SIGTERM
    KVSTORE_DATA_PLANE_PROBE_S=10         seconds between probes of the data plane's listener, which is
                                          restarted after two unanswered ones (DataPlaneWatchdog); 0: none
    KVSTORE_MAX_LOOKUP_BLOCKS=16384       and the other ServiceLimits fields (kvstore.service.limits):
    KVSTORE_MAX_TRANSFER_BLOCKS=32        KVSTORE_MAX_CHUNK_BYTES=1MiB, KVSTORE_MAX_MESSAGE_BYTES=4MiB,
                                          KVSTORE_MAX_CONCURRENT_TRANSFERS=16,
                                          KVSTORE_STREAM_IDLE_TIMEOUT_S=30 (seconds), ...

All three addresses default to loopback. Beyond loopback the sidecar refuses to start without a bearer
token, and without TLS (kvstore.service.security).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Mapping

from kvstore.config import ENV_PREFIX, parse_bool, parse_seconds, parse_size, read_as, read_setting
from kvstore.errors import InvalidRequest
from kvstore.service.limits import ServiceLimits
from kvstore.service.staging import MIN_STAGING_BYTES, STAGING_AUTO

DEFAULT_ADDRESS = "127.0.0.1:50551"
DEFAULT_HTTP_ADDRESS = "127.0.0.1:50552"
HTTP_OFF = "off"
DATA_OFF = "off"
DATA_AUTO = "auto"

MAX_PORT = 65535

def staging_size(text: str) -> int | str:
    """A staging capacity: a size in bytes, or "auto"."""
    return STAGING_AUTO if text.strip().lower() == STAGING_AUTO else parse_size(text)


_STRINGS = ("token", "token_file", "tls_cert", "tls_key")
_PARSED = {"allow_plaintext": parse_bool, "protect_metrics": parse_bool, "durable_puts": parse_bool,
           "check_integrity_on_exit": parse_bool, "staging_bytes": staging_size, "shutdown_grace_s": parse_seconds,
           "data_plane_probe_s": parse_seconds}
# What each address may be: its forms (for messages), its words, and whether unix:PATH is one.
_ADDRESS_FORMS = {"address": ("HOST:PORT or unix:PATH", (), True),
                  "http_address": ("HOST:PORT or 'off'", (HTTP_OFF,), False),
                  "data_address": ("HOST:PORT, 'auto' or 'off'", (DATA_AUTO, DATA_OFF), False)}


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
    staging_bytes: int | str = STAGING_AUTO  # bytes, or "auto" (kvstore.service.staging.open_staging)
    durable_puts: bool = False
    shutdown_grace_s: float = 10.0
    data_plane_probe_s: float = 10.0  # 0: no DataPlaneWatchdog
    check_integrity_on_exit: bool = False  # after a graceful shutdown: IntegrityCheckFailed if the books disagree
    limits: ServiceLimits = field(default_factory=ServiceLimits)

    def __post_init__(self) -> None:
        for name in _ADDRESS_FORMS:
            read_as(name, getattr(self, name), partial(check_address, name))
        staging = self.staging_bytes
        if staging != STAGING_AUTO and (staging < 0 or 0 < staging < MIN_STAGING_BYTES):
            raise InvalidRequest(f"staging capacity must be 0 (staging off) or at least {MIN_STAGING_BYTES} bytes "
                                 f"(one page), got {self.staging_bytes}; --staging-capacity or KVSTORE_STAGING_BYTES")
        if not (math.isfinite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0):
            raise InvalidRequest(f"the shutdown grace must be finite seconds, 0 or more, got {self.shutdown_grace_s}; "
                                 "--shutdown-grace-s or KVSTORE_SHUTDOWN_GRACE_S")
        if not (math.isfinite(self.data_plane_probe_s) and self.data_plane_probe_s >= 0):
            raise InvalidRequest(f"the data plane's probe interval must be finite seconds, 0 (no probes) or more, "
                                 f"got {self.data_plane_probe_s}; KVSTORE_DATA_PLANE_PROBE_S")

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
        parsers = {**dict.fromkeys(_STRINGS, str), **_PARSED,
                   **{name: partial(check_address, name) for name in _ADDRESS_FORMS}}
        values = {name: read_setting(env, ENV_PREFIX + name.upper(), parse)
                  for name, parse in parsers.items() if ENV_PREFIX + name.upper() in env}
        for name in _ADDRESS_FORMS:  # flags: named as such
            if overrides.get(name) is not None:
                read_as("--" + name.replace("_", "-"), overrides[name], partial(check_address, name))
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(limits=ServiceLimits.from_env(env), **values)


def check_address(name: str, text: str) -> str:
    """``text`` if it is one of the forms the address setting ``name`` takes, else ``InvalidRequest``
    listing them. A port is a number from 0 (any free one) to 65535; an IPv6 host is in brackets."""
    forms, words, unix = _ADDRESS_FORMS[name]
    problem = None if text in words else _address_problem(text, unix)
    if problem is not None:
        raise InvalidRequest(f"must be {forms}, got {text!r}: {problem}")
    return text


def _address_problem(text: str, unix: bool) -> str | None:
    if text.startswith("unix:"):
        if not unix:
            return "a unix socket cannot serve this"
        return None if len(text) > len("unix:") else "unix: needs a PATH"
    host, colon, port = text.rpartition(":")
    if not colon:
        return "no :PORT"
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        return "an IPv6 host goes in brackets, as in [::1]:PORT"
    if not (port.isascii() and port.isdigit()) or int(port) > MAX_PORT:
        return f"the port must be a number from 0 to {MAX_PORT} (0: any free one), not {port!r}"
    return None
