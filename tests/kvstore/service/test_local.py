"""``LocalSidecar``: a real sidecar process whose log is never left to fill a pipe."""

from __future__ import annotations

import numpy as np

from kvstore.keys import namespace_hashes
from kvstore.service.client import KVStoreClient
from kvstore.service.local import LocalSidecar
from tests.conftest import payloads_for


def test_a_sidecar_that_logs_a_lot_keeps_serving_and_its_log_is_kept(tmp_path, namespace, spec):
    """gRPC's own tracing writes kilobytes per call to stderr: far past a pipe's 64 KiB, where a
    sidecar whose stderr nobody read blocked on its next line and stopped answering."""
    env = {"GRPC_VERBOSITY": "DEBUG", "GRPC_TRACE": "api,call_error,channel", "KVSTORE_SHM_DIR": str(tmp_path)}
    with LocalSidecar(str(tmp_path), "16MiB", http_address="off", env=env) as sidecar:
        with KVStoreClient(sidecar.address, timeout_s=10, data_plane=False) as client:
            ns_id = client.register_namespace(namespace)
            hashes = namespace_hashes(namespace, np.arange(8))
            client.put(ns_id, hashes, payloads_for(spec, hashes))
            for _ in range(300):
                assert client.lookup(ns_id, hashes).hit_blocks == 2
        assert len(sidecar.log()) > 256 << 10, "the sidecar logged past a pipe's capacity"
    assert sidecar.process.returncode == 0
