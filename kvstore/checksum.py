"""Per-layer checksums of a block payload (xxh3-64 of each layer's byte range).

One checksum per layer lets a single layer be loaded and verified on its own. An object stored
as one opaque unit is a block of one "layer".
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash


def layer_checksums(payload: np.ndarray, num_layers: int) -> tuple[int, ...]:
    """xxh3-64 of each of ``num_layers`` equal slices of the flat ``uint8`` payload."""
    size = payload.nbytes // num_layers
    assert size * num_layers == payload.nbytes, "payload must split into equal layers (caller bug)"
    digest = xxhash.xxh3_64_intdigest
    return tuple(digest(payload[i * size : (i + 1) * size]) for i in range(num_layers))


def layers_match(view: np.ndarray, expected: Sequence[int]) -> bool:
    """True when ``view``, split into ``len(expected)`` equal layers, has exactly those checksums."""
    return layer_checksums(view, len(expected)) == tuple(expected)
