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
    deep = '{"extra":' + "[" * 20_000 + "]" * 20_000 + "}"  # within the request size, past the recursion limit
    error = refusal(stub, pb.RegisterNamespaceRequest(canonical_json=deep))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "nested too deeply" in error.details()
    assert store.namespaces() == []
    ok = stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=tiny_namespace().canonical_json()))
    assert ok.namespace_id == tiny_namespace().id, "the server goes on serving"


@pytest.mark.parametrize("fields, message", [
    (dict(cache_salt="s" * 4097), "Namespace.cache_salt has a string of 4097 characters, at most 4096"),
    (dict(model="m" * 5000), "Namespace.model has a string of 5000 characters, at most 4096"),
    (dict(extra=[["k", "v" * 4097]]), "Namespace.extra has a string of 4097 characters, at most 4096"),
    (dict(extra=[[f"k{i}", "v"] for i in range(2000)]), "canonical_json has 2"),
])
def test_a_namespace_too_large_to_keep_is_invalid_in_either_form(store, stub, fields, message):
    """Namespaces stay in the sidecar's memory until it restarts: 30 with a 3 MiB salt once took
    132 MiB. Refused as canonical_json and as the Namespace message's fields alike."""
    big = tiny_namespace(**{k: tuple(map(tuple, v)) if k == "extra" else v for k, v in fields.items()})
    as_fields = pb.Namespace(model=big.model, model_config_hash=big.model_config_hash, num_layers=big.num_layers,
                             components=big.components, block_size=big.block_size, cache_salt=big.cache_salt,
                             extra=[pb.KeyValue(key=k, value=v) for k, v in big.extra])
    for request in (pb.RegisterNamespaceRequest(canonical_json=big.canonical_json()),
                    pb.RegisterNamespaceRequest(fields=as_fields)):
        error = refusal(stub, request)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.details() and "until it restarts" in error.details()
    assert store.namespaces() == []
    at_limits = tiny_namespace(cache_salt="s" * 4096, extra=tuple((f"k{i}", "v") for i in range(100)))
    assert stub.RegisterNamespace(pb.RegisterNamespaceRequest(canonical_json=at_limits.canonical_json())) \
        .namespace_id == at_limits.id


@pytest.mark.parametrize("form", ["canonical_json", "fields"])
def test_a_request_past_its_size_is_refused_before_it_is_parsed(store, stub, form):
    """A 3.9 MB canonical_json was parsed, checked and serialised again on the event loop before its
    size was refused: about 1.4 s of every other client's calls waiting, per call."""
    huge = tiny_namespace(extra=tuple((f"k{i}", "v" * 4000) for i in range(1000)))
    request = pb.RegisterNamespaceRequest(canonical_json=huge.canonical_json()) if form == "canonical_json" else \
        pb.RegisterNamespaceRequest(fields=pb.Namespace(model=huge.model, model_config_hash="x", num_layers=1,
                                                        components=["mla_bf16"],
                                                        extra=[pb.KeyValue(key=k, value=v) for k, v in huge.extra]))
    error = refusal(stub, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("a RegisterNamespace request of ") and "at most 65536" in error.details()
    assert store.namespaces() == []
