"""The gRPC sidecar: one ``TieredStore`` served to every engine process on a host.

    codegen.py   regenerate the stubs in v1/ from proto/kvstore/service/v1/kvstore.proto
    limits.py    ServiceLimits (batch, chunk, message, concurrency) and the errors past them
    config.py    ServeConfig: address, shutdown grace, limits (flags > KVSTORE_* env > defaults)
    chunks.py    payloads <-> ordered chunks of at most max_chunk_bytes
    wire.py      protobuf messages <-> the store's types (Namespace, LookupResult, StoreStats ...)
    shm.py       the same-host fast path: leased host-tier slots (server), read-only segment maps (client)
    servicer.py  KVStoreServicer: each RPC translates and makes one store call
    server.py    create_server (tests bind port 0) and serve (signals, graceful shutdown)
    client.py    KVStoreClient: a blocking client whose methods mirror the store's
    cli.py       the ``kvstore serve`` flags (also ``python -m kvstore.service``)

This package knows the wire and nothing about caching: every decision (hits, leases, eviction,
sizes a block must have) is the store's, reached through its public API only, with one documented
exception: shm.py reads the host tier's slot of a block it has just leased.
"""
