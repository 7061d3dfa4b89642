"""The LMCache remote-storage plugin: vLLM and SGLang deployments that run LMCache put our
sidecar (``kvstore serve``) behind it as its remote storage.

    adapter.py    KVStoreConnectorAdapter: the class LMCache's config names (remote_storage_plugins)
    connector.py  KVStoreConnector: LMCache's RemoteConnector over KVStoreClient
    config.py     PluginConfig: our keys in LMCache's extra_config
    namespace.py  the store namespace of one LMCache configuration, and its block geometry
    framing.py    one variable-size object in one fixed-size block, with its metadata and checksum
    chunk_meta.py an object's description (shapes, dtypes, format), checked against this configuration's;
                  the LMCache settings whose objects are not whole chunks (refused)
    workers.py    the threads for the blocking sidecar calls; cancelled calls stop, closed ones answer misses
    cpu_engine.py a real LMCacheEngine on the CPU over a paged cache (tests, benchmark, trying it out)

Install it with ``pip install .[lmcache]`` (after a CPU or CUDA torch). The plugin knows LMCache's
connector interface and the sidecar client; the store knows nothing of it.
"""
