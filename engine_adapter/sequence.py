"""A request as the caller writes it, and the ``Sequence`` that carries it through the engine.

``Request`` and ``RequestOutput`` cross the engine's boundary (immutable); ``Sequence`` is the one
mutable object the scheduler, block manager and engine hand each other (nano-vllm style): its
tokens (prompt, then outputs), its pages, its cache and its counters.

This module knows tokens and counters; nothing about the model, pages' contents or the store.
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from engine_adapter.paged_cache import PagedSequenceCache

if TYPE_CHECKING:
    from engine_adapter.block_manager import PendingLoad

_ids = itertools.count()


@dataclass(frozen=True)
class Request:
    """Generate up to ``max_new_tokens`` after ``prompt_ids``; temperature 0 is greedy."""

    prompt_ids: tuple[int, ...]
    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    request_id: str = ""  # "" gets a unique one

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", _token_ids("prompt_ids", self.prompt_ids))
        object.__setattr__(self, "stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        if not self.prompt_ids:
            raise ValueError("prompt_ids must hold at least one token")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, numbers.Real) or \
                not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not _is_int(self.seed) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if not isinstance(self.request_id, str):
            raise ValueError(f"request_id must be a string, got {self.request_id!r}")
        if not self.request_id:
            object.__setattr__(self, "request_id", f"req-{next(_ids)}")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _token_ids(name: str, ids: object) -> tuple[int, ...]:
    """``ids`` as a tuple of ints; ``ValueError`` naming ``name`` for anything else (a float id
    would be truncated to another token, a bare int is no sequence)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
        raise ValueError(f"{name} must be a sequence of token ids, got {ids!r}")
    ids = tuple(ids)
    for token in ids:
        if not _is_int(token):
            raise ValueError(f"{name} must hold int token ids, got {token!r}")
    return tuple(int(t) for t in ids)


@dataclass
class RequestStats:
    """Where a request's prompt tokens came from, and when its first token came out. The hits are
    those of its first admission; a preempted request's recomputation counts in
    ``computed_prompt_tokens`` only, so reused and computed add up to the prompt without preemptions."""

    prompt_tokens: int
    device_hit_tokens: int = 0  # reused from cached pages of the device pool
    connector_hit_tokens: int = 0  # loaded through the connector (host, disk ... tiers)
    computed_prompt_tokens: int = 0  # prompt tokens run through the model (recomputation included)
    ttft_s: float | None = None
    preemptions: int = 0
    load_failures: int = 0


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    stats: RequestStats
    error: str | None = None  # why the engine ended the request early (output_ids: what came before); None: done


@dataclass
class Sequence:
    """A request in flight. ``token_ids`` grows by one per decode step."""

    request: Request
    token_ids: list[int] = field(init=False)
    arrival: float = field(default_factory=time.perf_counter)
    block_table: list[int] = field(default_factory=list)  # page of block i (pinned while running)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the full blocks so far
    committed_blocks: int = 0  # leading blocks registered in the pool (hits, loaded, computed)
    cache: PagedSequenceCache | None = None
    load: PendingLoad | None = None  # the connector load in flight, until its first forward is done
    stats: RequestStats = field(init=False)
    generator: torch.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.request.prompt_ids)
        self.stats = RequestStats(prompt_tokens=self.num_prompt_tokens)
        self.generator = torch.Generator().manual_seed(self.request.seed)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_cached_tokens(self) -> int:
        """Positions whose cache entries exist (0 while not admitted)."""
        return 0 if self.cache is None else self.cache.length

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_cached_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        outputs = self.output_ids
        return len(outputs) >= self.request.max_new_tokens or (
            bool(outputs) and outputs[-1] in self.request.stop_token_ids)

    def output(self, error: str | None = None) -> RequestOutput:
        return RequestOutput(self.request_id, self.request.prompt_ids, tuple(self.output_ids), replace(self.stats),
                             error)
