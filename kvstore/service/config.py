"""Configuration of the sidecar process (the store's own is ``kvstore.config.StoreConfig``).

Flags override the environment, the environment overrides the embedded defaults::

    KVSTORE_ADDRESS=127.0.0.1:50551       HOST:PORT, or unix:PATH for a unix socket
    KVSTORE_SHUTDOWN_GRACE_S=10           how long in-flight calls may finish after SIGTERM
    KVSTORE_MAX_LOOKUP_BLOCKS=16384       and the other ServiceLimits fields (kvstore.service.limits):
    KVSTORE_MAX_TRANSFER_BLOCKS=32        KVSTORE_MAX_CHUNK_BYTES=1MiB, KVSTORE_MAX_MESSAGE_BYTES=4MiB,
                                          KVSTORE_MAX_CONCURRENT_TRANSFERS=16

The default address is loopback TCP: the service has no authentication or TLS, so it must not
listen beyond the host (use a unix socket to restrict it to a user or group by file mode).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Mapping

from kvstore.config import ENV_PREFIX, parse_size
from kvstore.errors import InvalidRequest
from kvstore.service.limits import ServiceLimits

DEFAULT_ADDRESS = "127.0.0.1:50551"


@dataclass(frozen=True)
class ServeConfig:
    address: str = DEFAULT_ADDRESS
    shutdown_grace_s: float = 10.0
    limits: ServiceLimits = field(default_factory=ServiceLimits)

    def __post_init__(self) -> None:
        if not (self.address.startswith("unix:") or ":" in self.address):
            raise InvalidRequest(f"address must be HOST:PORT or unix:PATH, got {self.address!r}")
        if self.shutdown_grace_s < 0:
            raise InvalidRequest(f"shutdown_grace_s must not be negative, got {self.shutdown_grace_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "ServeConfig":
        """Defaults, then ``KVSTORE_*`` variables, then ``overrides`` (None values are ignored)."""
        env = os.environ if environ is None else environ
        values: dict = {}
        if ENV_PREFIX + "ADDRESS" in env:
            values["address"] = env[ENV_PREFIX + "ADDRESS"]
        if ENV_PREFIX + "SHUTDOWN_GRACE_S" in env:
            values["shutdown_grace_s"] = _seconds(env[ENV_PREFIX + "SHUTDOWN_GRACE_S"])
        limits = {f.name: parse_size(env[key]) for f in fields(ServiceLimits)
                  if (key := ENV_PREFIX + f.name.upper()) in env}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(limits=ServiceLimits(**limits), **values)


def _seconds(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise InvalidRequest(f"cannot read {text!r} as seconds; examples: 10, 2.5") from None
