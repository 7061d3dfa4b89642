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
    try:
        request = TraceRequest(float(obj.get("timestamp", 0)), int(obj["input_length"]),
                               int(obj.get("output_length", 0)), tuple(int(h) for h in obj["hash_ids"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidRequest(f"{where}: not a trace request ({exc!r}); expected keys input_length and hash_ids") from None
    blocks = len(request.hash_ids)
    if request.input_length < 0 or any(h < 0 for h in request.hash_ids):
        raise InvalidRequest(f"{where}: input_length and hash_ids must be non-negative")
    if blocks and not block_tokens * (blocks - 1) < request.input_length <= block_tokens * blocks:
        raise InvalidRequest(
            f"{where}: {blocks} blocks of {block_tokens} tokens cannot hold input_length {request.input_length}; "
            f"is --block-tokens right?"
        )
    return request


def read_trace(path: str, block_tokens: int = 512) -> list[TraceRequest]:
    """Every request of a JSONL trace; a malformed line raises ``InvalidRequest`` naming it."""
    try:
        with open(path) as f:
            return list(_parse_lines(f, block_tokens, path))
    except FileNotFoundError:
        raise InvalidRequest(f"trace file {path} does not exist") from None


def _parse_lines(lines: Iterable[str], block_tokens: int, path: str) -> Iterator[TraceRequest]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"{path}:{number}: not JSON ({exc.msg})") from None
        yield parse_request(obj, block_tokens, f"{path}:{number}")


def write_trace(path: str, requests: Iterable[TraceRequest | dict]) -> None:
    with open(path, "w") as f:
        for request in requests:
            obj = request if isinstance(request, dict) else {
                "timestamp": request.timestamp, "input_length": request.input_length,
                "output_length": request.output_length, "hash_ids": list(request.hash_ids)}
            f.write(json.dumps(obj) + "\n")
