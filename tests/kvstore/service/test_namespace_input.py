"""RegisterNamespace refuses what no Namespace can be with INVALID_ARGUMENT and a message naming
the field, whichever form it comes in (canonical_json or the Namespace message), and registers
nothing: never UNKNOWN, never a namespace the Namespace message could not express."""

from __future__ import annotations

import json

import grpc
import pytest

from kvstore.service.v1 import kvstore_pb2 as pb
from tests.conftest import tiny_namespace


def registered_json(**fields) -> str:
    """The tiny namespace's canonical_json with ``fields`` replaced."""
    return json.dumps({**json.loads(tiny_namespace().canonical_json()), **fields})


def refusal(stub, request: pb.RegisterNamespaceRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        stub.RegisterNamespace(request, timeout=30)
    return info.value


@pytest.mark.parametrize("fields, message", [
    (dict(components=[["mla_bf16"]]), "Namespace.components must be a list of strings"),
    (dict(components=[{}]), "Namespace.components must be a list of strings"),
    (dict(components=[None]), "Namespace.components must be a list of strings"),
    (dict(extra=[[1, 2, 3]]), "Namespace.extra must be a list of [key, value] pairs of strings"),
    (dict(extra=[[{}, []]]), "Namespace.extra must be a list of [key, value] pairs of strings"),
    (dict(extra=[["lora"]]), "Namespace.extra must be a list of [key, value] pairs of strings"),
])
def test_elements_of_the_wrong_type_are_invalid_and_register_nothing(store, stub, fields, message):
    error = refusal(stub, pb.RegisterNamespaceRequest(canonical_json=registered_json(**fields)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert store.namespaces() == []


def test_json_nested_too_deeply_is_invalid_not_unknown(store, stub):
    deep = '{"extra":' + "[" * 200_000 + "]" * 200_000 + "}"
    error = refusal(stub, pb.RegisterNamespaceRequest(canonical_json=deep))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nested too deeply" in error.details()
    assert store.namespaces() == []
    ok = stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=tiny_namespace().canonical_json()))
    assert ok.namespace_id == tiny_namespace().id, "the server goes on serving"
