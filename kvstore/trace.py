"""Workload traces in the Mooncake format: one JSON object per line.

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2, ...]}

``hash_ids`` are chained prefix block ids (two requests share an id exactly when they share that
whole prefix), ``block_tokens`` tokens per block (512 in the published traces). The last block
of a prompt may be partial: ``input_length`` is the true token count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Iterator

from kvstore.errors import InvalidRequest


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, index: int, block_tokens: int) -> int:
        """Real token count of block ``index`` (only the last one may be partial)."""
        if index < len(self.hash_ids) - 1:
            return block_tokens
        return self.input_length - block_tokens * (len(self.hash_ids) - 1)


def parse_request(obj: dict, block_tokens: int, where: str) -> TraceRequest:
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where}: not a trace request (a JSON {type(obj).__name__}); expected an object "
                             "with keys input_length and hash_ids")
    try:
        hash_ids = obj["hash_ids"]
        if not isinstance(hash_ids, list):
            raise TypeError(f"hash_ids is a {type(hash_ids).__name__}, not a list")
        request = TraceRequest(float(obj.get("timestamp", 0)), _integer(obj["input_length"]),
                               _integer(obj.get("output_length", 0)), tuple(_integer(h) for h in hash_ids))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"{where}: not a trace request ({exc!r}); expected keys input_length and hash_ids") from None
    blocks = len(request.hash_ids)
    if request.input_length < 0 or any(not 0 <= h < 1 << 128 for h in request.hash_ids):
        raise InvalidRequest(f"{where}: input_length must be non-negative and hash_ids in [0, 2**128)")
    if blocks and not block_tokens * (blocks - 1) < request.input_length <= block_tokens * blocks:
        raise InvalidRequest(
            f"{where}: {blocks} blocks of {block_tokens} tokens cannot hold input_length {request.input_length}; "
            f"is --block-tokens right?"
        )
    return request


def _integer(value) -> int:
    """``value`` as an int if it is a whole JSON number (not a bool, a string or 1024.7)."""
    if type(value) is int:  # the common case, first: a trace has millions of ids
        return value
    if isinstance(value, bool) or not isinstance(value, float) or not value.is_integer():
        raise ValueError(f"{value!r} is not a whole number")
    return int(value)


def read_trace(path: str, block_tokens: int = 512) -> list[TraceRequest]:
    """Every request of a JSONL trace; a malformed line raises ``InvalidRequest`` naming it."""
    try:
        with open(path) as f:
            return list(_parse_lines(f, block_tokens, path))
    except FileNotFoundError:
        raise InvalidRequest(f"trace file {path} does not exist") from None


def _parse_lines(lines: Iterable[str], block_tokens: int, path: str) -> Iterator[TraceRequest]:
    chains = ChainCheck()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{path}:{number}: not JSON ({exc.msg})") from None
        request = parse_request(obj, block_tokens, f"{path}:{number}")
        chains.check(request.hash_ids, f"{path}:{number}")
        yield request


class ChainCheck:
    """Checks that ``hash_ids`` are chained prefix ids across a trace: an id names one whole
    prefix, so it always follows the same id (or always starts a request). A trace that breaks
    this cannot be replayed as prefixes (a block would be its own ancestor, or have two parents)."""

    def __init__(self) -> None:
        self._parent: dict[int, tuple[int | None, str]] = {}  # id -> (the id before it, where first seen)

    def check(self, hash_ids: tuple[int, ...], where: str) -> None:
        if len(set(hash_ids)) != len(hash_ids):
            raise InvalidRequest(f"{where}: a hash id appears twice in one request; hash_ids must be chained "
                                 "prefix ids (each names the whole prefix up to its block)")
        parent = None
        for block in hash_ids:
            first = self._parent.setdefault(block, (parent, where))
            if first[0] != parent:
                raise InvalidRequest(
                    f"{where}: hash id {block} follows {_named(parent)} here but {_named(first[0])} at {first[1]}; "
                    "hash_ids must be chained prefix ids (each names the whole prefix up to its block)")
            parent = block


def _named(parent: int | None) -> str:
    return "nothing (a request's start)" if parent is None else f"id {parent}"


def write_trace(path: str, requests: Iterable[TraceRequest | dict]) -> None:
    with open(path, "w") as f:
        for request in requests:
            obj = request if isinstance(request, dict) else {
                "timestamp": request.timestamp, "input_length": request.input_length,
                "output_length": request.output_length, "hash_ids": list(request.hash_ids)}
            f.write(json.dumps(obj) + "\n")
