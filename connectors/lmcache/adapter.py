"""The class LMCache loads by name: ``KVStoreConnectorAdapter`` builds a ``KVStoreConnector``.

LMCache instantiates the adapter with no arguments and asks it to ``create_connector`` for the URL
``plugin://NAME`` of each entry ``NAME`` of ``remote_storage_plugins`` it was configured with
(``kvstore``, or ``kvstore.INSTANCE`` for a second sidecar). The context carries LMCache's config
(our settings are in its ``extra_config``), its metadata (the namespace is derived from it), the
event loop and the CPU backend that allocates the objects a get returns. The sidecar's limits
(``KVSTORE_MAX_LOOKUP_BLOCKS``, ``KVSTORE_MAX_TRANSFER_BLOCKS``, ...) come from the environment, as
the sidecar reads them.
"""

from __future__ import annotations

from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type

from connectors.lmcache.config import PluginConfig
from connectors.lmcache.connector import KVStoreConnector
from kvstore.service.limits import ServiceLimits

PLUGIN_TYPE = "kvstore"


class KVStoreConnectorAdapter(ConnectorAdapter):
    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> KVStoreConnector:
        """Raises ``InvalidRequest`` for a mistaken ``extra_config`` (LMCache then runs without us)."""
        settings = PluginConfig.from_extra_config(context.config.extra_config, context.plugin_name or PLUGIN_TYPE)
        return KVStoreConnector(context.config, context.metadata, context.loop, context.local_cpu_backend, settings,
                                ServiceLimits.from_env())  # the sidecar's limits, read from the same variables
