"""The LMCache remote-storage plugin: vLLM and SGLang deployments that run LMCache put our
sidecar (``kvstore serve``) behind it as its remote storage.

    adapter.py    KVStoreConnectorAdapter: the class LMCache's config names (remote_storage_plugins)
    connector.py  KVStoreConnector: LMCache's RemoteConnector over KVStoreClient
    config.py     PluginConfig: our keys in LMCache's extra_config
    namespace.py  the store namespace of one LMCache configuration, and its block geometry
    framing.py    one variable-size object in one fixed-size block, with its metadata and checksum
    session.py    the client with its namespace registered on demand; availability logging
    stubs.py      the sidecar's gRPC stubs under LMCache's older protobuf and grpcio pins
    cpu_engine.py a real LMCacheEngine on the CPU over a paged cache (tests, benchmark, trying it out)

LMCache lives in its own environment (it pins protobuf<7; the project's stubs are generated for 7):
importing this package first makes the sidecar client importable there (``stubs.load``). The
plugin knows LMCache's connector interface and the sidecar client; the store knows nothing of it.
"""

from connectors.lmcache import stubs

stubs.load()
