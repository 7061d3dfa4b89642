"""Byte views over callers' buffers, and page-aligned payload buffers."""

import numpy as np
import pytest
import torch

from kvstore.buffers import aligned_empty, byte_view, check_size
from kvstore.errors import InvalidRequest


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 3_076_352])
def test_aligned_buffers_start_on_the_boundary_and_have_the_size_asked(nbytes):
    for align in (512, 4096):
        buf = aligned_empty(nbytes, align)
        assert buf.ctypes.data % align == 0 and buf.nbytes == nbytes and buf.dtype == np.uint8
        assert buf.flags.c_contiguous and buf.flags.writeable


def test_byte_views_share_memory_and_refuse_what_is_not_a_flat_host_buffer():
    array = np.arange(12, dtype=np.uint16)
    view = byte_view(array)
    assert view.nbytes == 24 and np.shares_memory(view, array)
    tensor = torch.arange(6, dtype=torch.int32)
    assert np.array_equal(byte_view(tensor).view(np.int32), tensor.numpy())
    with pytest.raises(InvalidRequest, match="C-contiguous"):
        byte_view(array.reshape(3, 4)[:, :2])
    with pytest.raises(InvalidRequest, match="read-only"):
        byte_view(b"abc", writable=True)
    with pytest.raises(InvalidRequest, match="expected exactly 10"):
        check_size(view, 10, "block payload")
