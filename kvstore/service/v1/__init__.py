"""Generated protobuf and gRPC stubs of ``proto/kvstore/service/v1/kvstore.proto`` (package
``kvstore.v1``). Never edit them: run ``python -m kvstore.service.codegen``."""
