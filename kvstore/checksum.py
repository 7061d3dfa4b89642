"""Per-layer checksums of a block payload (xxh3-64 of each layer's byte range).

One checksum per layer lets a single layer be loaded and verified on its own. An object stored
as one opaque unit is a block of one "layer".
"""

from __future__ import annotations

from concurrent.futures import Executor, Future
from typing import Iterator, Sequence

import numpy as np
import xxhash


def layer_checksums(payload: np.ndarray, num_layers: int) -> tuple[int, ...]:
    """xxh3-64 of each of ``num_layers`` equal slices of the flat ``uint8`` payload."""
    digest = xxhash.xxh3_64_intdigest
    if num_layers == 1:  # an object stored as one unit (and every replay block): no slicing
        return (digest(payload),)
    size = payload.nbytes // num_layers
    assert size * num_layers == payload.nbytes, "payload must split into equal layers (caller bug)"
    return tuple(digest(payload[i * size : (i + 1) * size]) for i in range(num_layers))


def layers_match(view: np.ndarray, expected: Sequence[int]) -> bool:
    """True when ``view``, split into ``len(expected)`` equal layers, has exactly those checksums."""
    return layer_checksums(view, len(expected)) == tuple(expected)


# Below this a payload hashes faster inline than a hand-off to a thread costs (xxh3 hashes 256 KiB
# in about 25 us; a future's round trip is 20-50 us).
MIN_OFFLOAD_BYTES = 256 * 1024


def checksums_ahead(payloads: Sequence[np.ndarray], num_layers: int, executor: Executor | None,
                    ahead: int = 1, min_offload_bytes: int = MIN_OFFLOAD_BYTES) -> Iterator[tuple[int, ...]]:
    """``layer_checksums`` of each payload in order, computing up to ``ahead`` payloads beyond the
    one the caller works on in ``executor``, so hashing the next block overlaps with writing this
    one (a write releases the GIL while the device works). Inline with no executor, for one
    payload, or for payloads under ``min_offload_bytes`` (the first one's size decides).
    Closing the iterator early waits for nothing and cancels what has not started."""
    if executor is None or len(payloads) < 2 or payloads[0].nbytes < min_offload_bytes:
        for payload in payloads:  # a plain loop: one generator per block, not two
            yield layer_checksums(payload, num_layers)
        return
    pending: list[Future] = []
    try:
        for i in range(len(payloads)):
            while len(pending) <= ahead and i + len(pending) < len(payloads):
                pending.append(executor.submit(layer_checksums, payloads[i + len(pending)], num_layers))
            yield pending.pop(0).result()
    finally:
        for future in pending:
            future.cancel()
