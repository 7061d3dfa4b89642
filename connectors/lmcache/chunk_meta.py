"""LMCache's description of an object (group shapes, dtypes, memory format) as a frame carries it
(``framing.ObjectMeta``, by name), and the check that a stored description is one this LMCache
configuration could have written. The plugin serves whole chunks in LMCache's own layout only:
``require_whole_chunks`` refuses the LMCache settings that store anything else.

The frame's checksum covers an object's bytes, not its metadata, so a block can hold the right
bytes under a wrong description: a transposed shape, another dtype, another memory format,
negative dimensions. ``ChunkGeometry.allocation`` refuses all of those before LMCache allocates.
Knows torch and LMCache's ``MemoryFormat``; no sidecar, no framing bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

from connectors.lmcache.framing import CorruptObject, ObjectMeta
from kvstore.errors import InvalidRequest

Allocation = tuple[list[torch.Size], list[torch.dtype], MemoryFormat]  # what allocate() takes


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def require_whole_chunks(config) -> None:
    """Raises ``InvalidRequest`` (saying what to set) unless LMCache's ``config`` stores whole chunks
    as it allocates them, the only objects ``ChunkGeometry`` accepts: ``use_layerwise`` stores one
    object per layer ([tokens, 2, D] or [tokens, 576]), and a ``remote_serde`` other than "naive"
    stores another encoding (cachegen: compressed bytes). Either way every get would be a miss."""
    if config.use_layerwise:
        raise InvalidRequest("the kvstore plugin stores whole chunks, and LMCache's use_layerwise stores one object "
                             "per layer: set use_layerwise: false, or use another remote backend for layerwise "
                             "caching")
    if config.remote_serde != "naive":
        raise InvalidRequest(f"the kvstore plugin serves LMCache's chunks as LMCache allocates them, and remote_serde "
                             f"{config.remote_serde!r} encodes them otherwise: set remote_serde: naive")


def object_meta(obj: MemoryObj) -> ObjectMeta:
    """How ``obj`` is described in its frame."""
    meta = obj.metadata
    shapes = meta.shapes or [meta.shape]
    dtypes = meta.dtypes or [meta.dtype]
    return ObjectMeta(tuple(tuple(s) for s in shapes), tuple(dtype_name(d) for d in dtypes), meta.fmt.name)


@dataclass(frozen=True)
class ChunkGeometry:
    """The objects of one LMCache configuration: a full chunk's ``shapes`` (one per group), the
    groups' ``dtypes`` and the memory format. A shorter chunk (a prompt's last) differs from a full
    one only in the format's token dimension."""

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    fmt: MemoryFormat

    def allocation(self, meta: ObjectMeta) -> Allocation:
        """``meta`` as ``allocate()`` takes it, if it describes a chunk of this configuration: the
        same format and dtypes, and in every group the full chunk's shape except for the token
        dimension, which holds 1 up to the full chunk's tokens, the same in every group. Raises
        ``CorruptObject`` (naming what differs) otherwise; pure."""
        if meta.fmt != self.fmt.name or meta.dtypes != tuple(dtype_name(d) for d in self.dtypes):
            raise CorruptObject(f"format {meta.fmt} and dtypes {list(meta.dtypes)}, where this LMCache writes "
                                f"{self.fmt.name} and {[dtype_name(d) for d in self.dtypes]}")
        tokens = {self._tokens(shape, full) for shape, full in zip(meta.shapes, self.shapes)}
        if len(meta.shapes) != len(self.shapes) or None in tokens or len(tokens) != 1:
            raise CorruptObject(f"shapes {[list(s) for s in meta.shapes]} are not those of a chunk of at most "
                                f"{[list(s) for s in self.shapes]} (token dimension {self.fmt.token_dim()})")
        return [torch.Size(s) for s in meta.shapes], list(self.dtypes), self.fmt

    def _tokens(self, shape: tuple[int, ...], full: torch.Size) -> int | None:
        """The tokens ``shape`` holds if it is ``full`` but for 1..full tokens; else None."""
        axis = self.fmt.token_dim()
        if len(shape) != len(full) or any(shape[i] != full[i] for i in range(len(full)) if i != axis):
            return None
        return shape[axis] if 1 <= shape[axis] <= full[axis] else None
