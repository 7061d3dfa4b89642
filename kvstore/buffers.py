"""Byte views over the buffers callers hand the store (numpy arrays, CPU torch tensors, bytes).

Every tier copies with ``numpy.copyto`` between flat ``uint8`` views, so a payload never makes a
Python ``bytes`` round trip. A device (CUDA) tensor is not a host buffer: callers stage it through
pinned host memory themselves (the engine's connector does).
"""

from __future__ import annotations

import sys

import numpy as np

from kvstore.errors import InvalidRequest


def byte_view(buf, writable: bool = False) -> np.ndarray:
    """A flat ``uint8`` numpy view of ``buf``'s memory (no copy).

    Accepts numpy arrays, CPU torch tensors, and objects with the buffer protocol. The buffer must
    be C-contiguous; with ``writable`` it must also be writable.
    """
    if isinstance(buf, np.ndarray):  # the commonest, and never a tensor
        if not buf.flags.c_contiguous:
            raise InvalidRequest("buffer array must be C-contiguous")
        view = buf if buf.ndim == 1 and buf.dtype == np.uint8 else buf.reshape(-1).view(np.uint8)
    elif (torch := sys.modules.get("torch")) is not None and isinstance(buf, torch.Tensor):  # never imported: no tensor
        if buf.device.type != "cpu":
            raise InvalidRequest(f"buffer must live in host memory, got a tensor on {buf.device}")
        if not buf.is_contiguous():
            raise InvalidRequest("buffer tensor must be contiguous")
        view = buf.view(torch.uint8).reshape(-1).numpy()
    else:
        try:
            view = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(f"buffer of type {type(buf).__name__} is not a contiguous byte buffer: {exc}") from None
    if writable and not view.flags.writeable:
        raise InvalidRequest("destination buffer is read-only")
    return view


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    """An uninitialised ``[nbytes]`` uint8 array whose first byte sits on an ``align`` boundary.

    Payloads put from page-aligned memory reach the disk tier with no copy: O_DIRECT writes them
    straight from where they lie (``kvstore.tiers.direct_io``); others go through a bounce buffer.
    Host-tier slots are page-aligned already; this is for buffers a caller fills itself.
    """
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes]  # the view keeps ``raw`` alive


def check_size(view: np.ndarray, expected: int, what: str) -> None:
    if view.nbytes != expected:
        raise InvalidRequest(f"{what} has {view.nbytes} bytes, expected exactly {expected}")
