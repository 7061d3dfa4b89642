"""Load the sidecar's generated gRPC stubs beside LMCache, whose pins are older than the stubs'.

LMCache 0.5.6 pins ``protobuf<7`` and (through ``grpcio-observability``) ``grpcio==1.78.0``; the
checked-in stubs (``kvstore/service/v1``) were generated for protobuf 7.35.1 and grpcio 1.85.1 and
refuse older runtimes at import: ``kvstore_pb2`` raises protobuf's ``VersionError`` and
``kvstore_pb2_grpc`` raises ``RuntimeError``. Nothing else in them depends on those versions: the
message module registers a serialized descriptor that protobuf 6 reads as is, and the stub class
only binds one method path per RPC.

``load()`` therefore imports the stubs as they are where the runtimes allow it (the project's own
environment: nothing changes), and otherwise

- imports ``kvstore_pb2`` with protobuf's own switch for skipping that check
  (``TEMPORARILY_DISABLE_PROTOBUF_VERSION_CHECK``), set for that one import only;
- puts a ``kvstore_pb2_grpc`` in ``sys.modules`` whose ``KVStoreStub`` is built from the service
  descriptor: the same method paths, the same streaming kinds, the same message classes.

After ``load()``, ``kvstore.service.client`` imports unchanged. This module knows the stubs'
module names and nothing about the messages themselves.
"""

from __future__ import annotations

import importlib
import os
import sys
import types

MESSAGES = "kvstore.service.v1.kvstore_pb2"
SERVICES = "kvstore.service.v1.kvstore_pb2_grpc"
SKIP_CHECK_ENV = "TEMPORARILY_DISABLE_PROTOBUF_VERSION_CHECK"


def load() -> types.ModuleType:
    """Make ``kvstore_pb2`` and ``kvstore_pb2_grpc`` importable here; returns the messages module.
    Idempotent; a no-op where the runtimes are as new as the stubs."""
    messages = _load_messages()
    if SERVICES not in sys.modules:
        try:
            importlib.import_module(SERVICES)
        except RuntimeError:  # grpcio older than the generator: same wire, refused by a version check
            module = descriptor_stubs(messages)
            sys.modules[SERVICES] = module
            sys.modules["kvstore.service.v1"].kvstore_pb2_grpc = module
    return messages


def _load_messages() -> types.ModuleType:
    from google.protobuf.runtime_version import VersionError

    try:
        return importlib.import_module(MESSAGES)
    except VersionError:  # raised before the descriptor is registered: nothing half-loaded
        previous = os.environ.get(SKIP_CHECK_ENV)
        os.environ[SKIP_CHECK_ENV] = "true"
        try:
            return importlib.import_module(MESSAGES)
        finally:
            if previous is None:
                del os.environ[SKIP_CHECK_ENV]
            else:
                os.environ[SKIP_CHECK_ENV] = previous


def descriptor_stubs(messages: types.ModuleType) -> types.ModuleType:
    """A stand-in ``kvstore_pb2_grpc`` module: ``KVStoreStub(channel)`` with one callable per RPC
    of every service in ``messages``, as the generated stub binds them."""
    module = types.ModuleType(SERVICES, "KVStoreStub built from the service descriptor (older grpcio)")
    for service in messages.DESCRIPTOR.services_by_name.values():
        setattr(module, f"{service.name}Stub", _stub_class(service, messages))
    return module


def _stub_class(service, messages: types.ModuleType) -> type:
    def __init__(self, channel) -> None:
        for method in service.methods:
            kind = _CALL_KINDS[(method.client_streaming, method.server_streaming)]
            request = getattr(messages, method.input_type.name)
            response = getattr(messages, method.output_type.name)
            setattr(self, method.name, getattr(channel, kind)(
                f"/{service.full_name}/{method.name}", request_serializer=request.SerializeToString,
                response_deserializer=response.FromString))

    return type(f"{service.name}Stub", (), {"__init__": __init__, "__doc__": f"Client stub of {service.full_name}."})


_CALL_KINDS = {(False, False): "unary_unary", (False, True): "unary_stream",
               (True, False): "stream_unary", (True, True): "stream_stream"}
