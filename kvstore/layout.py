"""Block layouts: component formats and where each layer's bytes sit inside a block payload.

A block is ``block_size`` consecutive tokens across all layers, with every component those layers
have. The payload is layer-major so one layer is one contiguous byte range (the engine can load
layer 0 before the last layer has arrived)::

    payload = | layer 0: comp 0 page | comp 1 page | ... | layer 1: comp 0 page | ... |
    layer_bytes  = sum(format.page_bytes(block_size) for each component)
    block_bytes  = num_layers * layer_bytes

Per token and layer (DESIGN.md section 4):

    format        bytes/token  page content (block_size tokens)
    mla_bf16      1152         [T, 576] bf16: 512 normalised latent, 64 rope key (interleaved)
    mla_fp8_ds    656          [T, 656] bytes: 512 fp8 e4m3 | 4 fp32 tile scales | 64 bf16 rope
    indexer_fp8   132          [T, 128] fp8 e4m3 values, then [T] fp32 scales (blocked per page)
    indexer_bf16  256          [T, 128] bf16, unquantised

This module knows byte sizes and offsets only; the conversions live in ``kvstore.quant``.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from functools import cached_property

from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace


@dataclass(frozen=True)
class ComponentFormat:
    name: str
    bytes_per_token: int
    kind: str  # "mla" or "indexer": a block holds at most one of each kind

    def page_bytes(self, block_size: int) -> int:
        return self.bytes_per_token * block_size


FORMATS: dict[str, ComponentFormat] = {
    f.name: f
    for f in (
        ComponentFormat("mla_bf16", 1152, "mla"),
        ComponentFormat("mla_fp8_ds", 656, "mla"),
        ComponentFormat("indexer_fp8", 132, "indexer"),
        ComponentFormat("indexer_bf16", 256, "indexer"),
    )
}

# Real DeepSeek models (61 layers): V3 caches bf16 MLA; V3.2's default is FlashMLA fp8 + fp8 indexer.
DEEPSEEK_V3_COMPONENTS = ("mla_bf16",)
DEEPSEEK_V32_COMPONENTS = ("mla_fp8_ds", "indexer_fp8")
DEEPSEEK_NUM_LAYERS = 61


def component_format(name: str) -> ComponentFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise InvalidRequest(
            f"unknown component format {name!r}; valid formats: {', '.join(sorted(FORMATS))}"
        ) from None


@dataclass(frozen=True)
class BlockSpec:
    """Byte geometry of one block: layers x components x block_size tokens."""

    num_layers: int
    block_size: int
    components: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.block_size <= 0:
            raise InvalidRequest(
                f"num_layers and block_size must be positive, got {self.num_layers}, {self.block_size}"
            )
        formats = [component_format(c) for c in self.components]
        if not formats:
            raise InvalidRequest("a block needs at least one component format")
        kinds = [f.kind for f in formats]
        if len(set(kinds)) != len(kinds):
            raise InvalidRequest(
                f"a block holds at most one MLA and one indexer component, got {self.components}"
            )
        object.__setattr__(self, "components", tuple(self.components))

    @classmethod
    def of(cls, namespace: Namespace) -> "BlockSpec":
        return cls(namespace.num_layers, namespace.block_size, namespace.components)

    @cached_property
    def bytes_per_token(self) -> int:
        """Bytes per token across all layers and components."""
        return self.num_layers * sum(FORMATS[c].bytes_per_token for c in self.components)

    @cached_property
    def layer_bytes(self) -> int:
        return sum(FORMATS[c].page_bytes(self.block_size) for c in self.components)

    @cached_property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    def layer_range(self, layer: int) -> tuple[int, int]:
        """``(offset, length)`` of one layer's bytes inside the block payload."""
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):  # 0.5 sliced nothing, True was 1
            raise InvalidRequest(f"layer must be a whole number, got {layer!r} ({type(layer).__name__})")
        if not 0 <= layer < self.num_layers:
            raise InvalidRequest(f"layer {layer} out of range [0, {self.num_layers})")
        return layer * self.layer_bytes, self.layer_bytes

    def component_range(self, layer: int, component: str) -> tuple[int, int]:
        """``(offset, length)`` of one component page of one layer inside the block payload."""
        if component not in self.components:
            raise InvalidRequest(f"component {component!r} not in this block's {self.components}")
        offset, _ = self.layer_range(layer)
        for name in self.components:
            size = FORMATS[name].page_bytes(self.block_size)
            if name == component:
                return offset, size
            offset += size
        raise AssertionError("unreachable: component was checked above")
