"""BelowMemoryWindow: reads below the sidecar's memory are cut while a hang is on record."""

import grpc
import numpy as np
import pytest

from connectors.lmcache.below_memory import BELOW_MEMORY, BelowMemoryWindow, PastDeadline, load_in_time


def test_until_a_read_below_memory_hangs_nothing_is_cut():
    window = BelowMemoryWindow("host", 1.0)
    assert window.lookup_usable(["host", "disk", "disk"], 3) == 3
    assert window.get_usable(1, 3) == 3


def test_after_a_hang_lookups_and_gets_stop_at_memory_until_a_read_answers():
    window = BelowMemoryWindow("host", 1.0)
    assert window.hung() is True and window.hung() is False  # the first hang since an answer, then not
    assert window.lookup_usable(["host", "disk", "disk"], 3) == 1
    assert window.lookup_usable(["host", "host"], 2) == 2  # all in memory: nothing to cut
    assert window.get_usable(2, 5) == 2
    assert window.below_memory(["host", BELOW_MEMORY]) and not window.below_memory(["host"])
    assert window.answered() is True and window.answered() is False
    assert window.lookup_usable(["host", "disk"], 2) == 2


class _Late(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


@pytest.mark.parametrize("code, raised", [(grpc.StatusCode.DEADLINE_EXCEEDED, PastDeadline),
                                          (grpc.StatusCode.UNAVAILABLE, grpc.RpcError)])
def test_only_a_get_past_its_deadline_is_a_read_that_hung(code, raised):
    class Client:
        def load(self, ns_id, digests, blocks):
            raise _Late(code)
    with pytest.raises(raised) as info:
        load_in_time(Client(), b"n" * 16, b"d" * 16, np.zeros(8, np.uint8))
    assert isinstance(info.value, PastDeadline) == (code == grpc.StatusCode.DEADLINE_EXCEEDED)
