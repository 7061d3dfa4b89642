"""Fixtures of the SidecarConnector tests: real sidecars (grpc.aio over a real store) and the
connectors made against them, each stopped or closed at the end of its test."""

import numpy as np
import pytest

from connectors.sidecar_connector import SidecarConnector
from kvstore.keys import namespace_hashes
from tests.connectors.sidecar_server import Sidecar
from tests.connectors.test_store_connector import NS


def _tracked(make, end):
    """A fixture's body: yields a factory calling ``make``, then ``end``s everything it made."""
    made = []

    def factory(*args, **kwargs):
        made.append(make(*args, **kwargs))
        return made[-1]

    yield factory
    for thing in made:
        end(thing)


@pytest.fixture
def sidecars():
    """``sidecars(store, **kw)``: a started ``Sidecar``, stopped after the test."""
    yield from _tracked(Sidecar, Sidecar.stop)


@pytest.fixture
def connectors():
    """``connectors(target, namespace, **kw)``: a ``SidecarConnector``, closed after the test."""
    yield from _tracked(SidecarConnector, SidecarConnector.close)


@pytest.fixture
def hashes():
    return namespace_hashes(NS, np.arange(4 * 6))  # 6 blocks
