"""Sizing a cache in bytes: what a token of KV costs for a model, and capacities given in bytes.

A replay measures hit rates against a capacity in tokens; an operator buys memory and disks in
bytes. The bytes per token follow from a model's layer count and the formats it caches
(``kvstore.layout``), so the presets name those, not byte counts:

    model              cached per token and layer               bytes per token (61 layers)
    deepseek-v3        mla_bf16 (576 bf16)                      70,272
    deepseek-v3-fp8    mla_fp8_ds (FlashMLA's 656-byte fp8)     40,016
    deepseek-v3.2      mla_fp8_ds + indexer_fp8 (132)           48,068
    kimi-k2            mla_bf16 (DeepSeek V3's attention)       70,272

Capacities are read as tokens (``3M``, decimal units) or, with a model, as bytes (``128GiB``,
``2TB``; binary units KiB..TiB, decimal KB..TB). Bytes are of KV payload: a tier's own overhead
is not counted (the host tier packs blocks into pages and can hold up to about 6% fewer).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Sequence

from kvstore.errors import InvalidRequest
from kvstore.layout import DEEPSEEK_NUM_LAYERS, DEEPSEEK_V3_COMPONENTS, DEEPSEEK_V32_COMPONENTS, BlockSpec

MODELS: dict[str, tuple[int, tuple[str, ...]]] = {  # name -> (layers, cached component formats)
    "deepseek-v3": (DEEPSEEK_NUM_LAYERS, DEEPSEEK_V3_COMPONENTS),
    "deepseek-v3-fp8": (DEEPSEEK_NUM_LAYERS, ("mla_fp8_ds",)),
    "deepseek-v3.2": (DEEPSEEK_NUM_LAYERS, DEEPSEEK_V32_COMPONENTS),
    "kimi-k2": (DEEPSEEK_NUM_LAYERS, DEEPSEEK_V3_COMPONENTS),
}

_TOKEN_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_BYTE_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_QUANTITY = re.compile(r"\s*(\d+(?:\.\d+)?(?:e\+?\d+)?)\s*([a-z]*)\s*")  # read exactly: 4.1M is 4,100,000


def bytes_per_token(model: str) -> int:
    """Bytes of KV one token occupies in the store for ``model`` (all layers and components)."""
    try:
        layers, components = MODELS[model]
    except KeyError:
        raise InvalidRequest(f"unknown model {model!r}; known: {', '.join(MODELS)}") from None
    return BlockSpec(layers, 1, components).bytes_per_token


def parse_capacity(text: str, model: str | None = None) -> int:
    """A capacity in tokens: ``"3M"`` -> 3,000,000; with ``model``, ``"128GiB"`` -> the tokens whose
    KV payload fits in 128 GiB (rounded down; a tier's own overhead is not counted: the host tier
    packs blocks into pages and can hold up to about 6% fewer). Raises ``InvalidRequest`` on
    anything else."""
    if _QUANTITY.fullmatch(text.lower().replace("-", "", 1)) and text.strip().startswith("-"):
        raise InvalidRequest(f"a capacity must be at least one token, got {text!r}")
    match = _QUANTITY.fullmatch(text.lower())
    unit = match[2] if match else None
    # An exponent past 1000 is no capacity, and 1e999999999 would be a number of a billion digits
    if match and "e" in match[1] and int(match[1].partition("e")[2]) > 1000:
        raise InvalidRequest(f"{text!r} is more tokens than any cache holds; check the number")
    if unit in _TOKEN_UNITS:
        count = Fraction(match[1]) * _TOKEN_UNITS[unit]
    elif unit in _BYTE_UNITS:
        if model is None:
            raise InvalidRequest(f"{text!r} is a size in bytes: give --model (one of {', '.join(MODELS)}) to turn "
                                 "it into tokens, or give tokens (e.g. 3M)")
        # exact: in Decimal's 28 digits 1e30GiB could not be divided (a traceback until session 34)
        count = Fraction(match[1]) * _BYTE_UNITS[unit] // bytes_per_token(model)
    else:
        raise InvalidRequest(f"cannot read {text!r} as a capacity; examples: 3M or 500k tokens, "
                             "or 128GiB with --model")
    if count < 1:
        raise InvalidRequest(f"a capacity must be at least one token, got {text!r}")
    return int(count)


def format_bytes(n: float) -> str:
    """``1.5 * 2**30`` -> ``"1.5 GiB"`` (one decimal, so a unit starts where 1023.95 would round up)."""
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if round(n, 1) < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"


def smallest_capacity_reaching(points: Sequence[tuple[int, float]], fraction: float) -> int | None:
    """The least capacity among measured ``(capacity_tokens, fraction_of_max)`` points that keeps at
    least ``fraction`` of the maximum hit rate; None when none does. A measured bound, not an
    interpolation: the capacity that just reaches ``fraction`` lies between it and the point below."""
    reaching = [capacity for capacity, kept in points if kept >= fraction]
    return min(reaching, default=None)
