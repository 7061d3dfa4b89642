"""Fixtures of the SidecarConnector tests: real sidecars (grpc.aio over a real store) and the
connectors made against them, each stopped or closed at the end of its test."""

import numpy as np
import pytest

from connectors.sidecar_connector import SidecarConnector
from kvstore.keys import namespace_hashes
from tests.connectors.sidecar_server import Sidecar
from tests.connectors.test_store_connector import NS


@pytest.fixture
def sidecars():
    started = []

    def start(store, **kw) -> Sidecar:
        started.append(Sidecar(store, **kw))
        return started[-1]

    yield start
    for sidecar in started:
        sidecar.stop()


@pytest.fixture
def connectors():
    made = []

    def make(*args, **kw) -> SidecarConnector:
        made.append(SidecarConnector(*args, **kw))
        return made[-1]

    yield make
    for connector in made:
        connector.close()


@pytest.fixture
def hashes():
    return namespace_hashes(NS, np.arange(4 * 6))  # 6 blocks
