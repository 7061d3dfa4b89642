"""Pick the engine's connector by configuration alone.

    KVSTORE_SIDECAR=127.0.0.1:50551   (or unix:/run/kvstore.sock)  -> SidecarConnector to that sidecar
    unset                                                          -> StoreConnector over an in-process store
    KVSTORE_LOAD_TIMEOUT_S=30 (or off)                             -> how long a load may take, either way
    KVSTORE_MAX_TRANSFER_BLOCKS, KVSTORE_MAX_LOOKUP_BLOCKS, ...    -> a sidecar's limits, read as it reads them

An explicit ``sidecar`` argument (a ``--sidecar ADDRESS`` flag) wins over the variable. Without a
sidecar, ``store`` is used when given; otherwise a store is opened from ``StoreConfig.from_env``
and the connector closes it on ``close``.
"""

from __future__ import annotations

import os
import threading
from typing import Mapping

from connectors._pages import DEFAULT_LOAD_TIMEOUT_S
from connectors.base import KVConnector
from connectors.store_connector import StoreConnector
from kvstore.config import ENV_PREFIX
from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace
from kvstore.service.limits import ServiceLimits

SIDECAR_ENV = ENV_PREFIX + "SIDECAR"
LOAD_TIMEOUT_ENV = ENV_PREFIX + "LOAD_TIMEOUT_S"


def sidecar_address(sidecar: str | None = None, environ: Mapping[str, str] | None = None) -> str | None:
    """The sidecar to use: ``sidecar`` if given, else ``$KVSTORE_SIDECAR``; None (or empty): in-process."""
    env = os.environ if environ is None else environ
    return sidecar or env.get(SIDECAR_ENV) or None


def load_timeout_from(environ: Mapping[str, str] | None = None) -> float | None:
    """``$KVSTORE_LOAD_TIMEOUT_S``: seconds, or ``off`` (None: no deadline); the default when unset."""
    value = (os.environ if environ is None else environ).get(LOAD_TIMEOUT_ENV, "").strip()
    if not value:
        return DEFAULT_LOAD_TIMEOUT_S
    if value.lower() == "off":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= threading.TIMEOUT_MAX:
        raise InvalidRequest(f"{LOAD_TIMEOUT_ENV}={value!r}: give positive seconds (30, 2.5) up to "
                             f"{threading.TIMEOUT_MAX:.0f}, or 'off' for no deadline")
    return seconds


def connector_from_config(namespace: Namespace, *, sidecar: str | None = None, store=None,
                          environ: Mapping[str, str] | None = None, **options) -> KVConnector:
    """A ``SidecarConnector`` when a sidecar address is configured, else a ``StoreConnector``.

    ``options`` go to the connector (``lease_ttl_s``, ``read_only``, ``load_timeout_s``; for a
    sidecar also ``timeout_s`` and ``limits``, by default ``ServiceLimits.from_env``: give the
    engine the sidecar's ``KVSTORE_MAX_*`` variables, or it sends batches the sidecar refuses)."""
    address = sidecar_address(sidecar, environ)
    options.setdefault("load_timeout_s", load_timeout_from(environ))
    if address:
        # grpc loads only for a sidecar
        from connectors.sidecar_connector import SidecarConnector

        options.setdefault("limits", ServiceLimits.from_env(environ))
        return SidecarConnector(address, namespace, **options)
    if store is not None:
        return StoreConnector(store, namespace, **options)
    from kvstore.config import StoreConfig

    store = StoreConfig.from_env(environ).open_store()
    try:
        return OwningStoreConnector(store, namespace, **options)
    except BaseException:  # options the connector refuses: the store it would have owned is ours to close
        store.close()
        raise


class OwningStoreConnector(StoreConnector):
    """A ``StoreConnector`` that opened its own store and closes it with itself."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.store.close()
