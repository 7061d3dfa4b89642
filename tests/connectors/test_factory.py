"""connector_from_config: an engine configured by the same ``KVSTORE_*`` variables as its sidecar
keeps within the sidecar's limits, and a call the sidecar refuses is logged as a refusal."""

import logging

import numpy as np
import pytest
import torch

from connectors.factory import connector_from_config
from connectors.sidecar_connector import SidecarConnector
from kvstore.errors import InvalidRequest
from kvstore.keys import namespace_hashes
from kvstore.service.limits import ServiceLimits
from tests.connectors.sidecar_server import Sidecar
from tests.connectors.test_store_connector import NS, SPEC, BytePool

LOWERED = {"KVSTORE_MAX_TRANSFER_BLOCKS": "2", "KVSTORE_MAX_LOOKUP_BLOCKS": "4"}


@pytest.fixture
def hashes():
    return namespace_hashes(NS, np.arange(4 * 6))  # 6 blocks


@pytest.fixture
def lowered_sidecar(make_store):
    """A sidecar run with KVSTORE_MAX_TRANSFER_BLOCKS=2 and KVSTORE_MAX_LOOKUP_BLOCKS=4."""
    sidecar = Sidecar(make_store(), ServiceLimits.from_env(LOWERED))
    yield sidecar
    sidecar.stop()


def test_an_engine_given_the_sidecars_environment_keeps_within_its_limits(lowered_sidecar, hashes):
    """Before, the connector kept the default batch of 32 blocks and lookups of 16384 hashes: every
    save of more than 2 blocks and every lookup of more than 4 was refused, so nothing was cached."""
    connector = connector_from_config(NS, environ={"KVSTORE_SIDECAR": lowered_sidecar.target, **LOWERED})
    try:
        assert (connector.limits.max_transfer_blocks, connector.limits.max_lookup_blocks) == (2, 4)
        source = BytePool(8, seed=1)
        connector.save("a", hashes, [2, 3, 4, 5, 6, 7], source, parent=None)  # three puts of 2 blocks
        connector.flush()
        assert lowered_sidecar.store.stats().stored_blocks == 6
        hit = connector.lookup("b", hashes)  # the first 4 of the 6 hashes are looked up
        assert hit.blocks == 4
        target = BytePool(8)
        assert connector.start_load(hit, hashes, [0, 1, 2, 3], target).wait() == 4
        assert all(torch.equal(target.layer_page_bytes(layer, dst), source.layer_page_bytes(layer, src))
                   for layer in range(SPEC.num_layers) for src, dst in zip([2, 3, 4, 5], [0, 1, 2, 3]))
    finally:
        connector.close()


def test_a_limit_the_environment_gets_wrong_is_refused_naming_it():
    with pytest.raises(InvalidRequest, match="^KVSTORE_MAX_TRANSFER_BLOCKS: cannot read 'two' as a count"):
        connector_from_config(NS, sidecar="127.0.0.1:1", environ={"KVSTORE_MAX_TRANSFER_BLOCKS": "two"})


def test_a_call_the_sidecar_refuses_is_logged_as_a_refusal_not_as_a_sidecar_gone(lowered_sidecar, hashes, caplog):
    """Before, a lookup refused RESOURCE_EXHAUSTED was logged as "the engine serves without it
    (misses) until it answers", though the sidecar answers every call."""
    connector = SidecarConnector(lowered_sidecar.target, NS, limits=ServiceLimits())  # limits it does not share
    try:
        with caplog.at_level(logging.DEBUG, logger="connectors.sidecar_session"):
            assert connector.lookup("a", hashes).blocks == 0
            assert connector.lookup("b", hashes).blocks == 0
    finally:
        connector.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"kvstore sidecar {lowered_sidecar.target} refused to look up (RESOURCE_EXHAUSTED: 6 blocks "
                        "in one call exceed max_lookup_blocks=4; split the call); such calls are misses (more like it "
                        "are logged at debug level)"]
    assert "until it answers" not in caplog.text
