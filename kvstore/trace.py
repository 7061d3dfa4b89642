"""Workload traces in the Mooncake format: one JSON object per line.

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2, ...]}

``hash_ids`` are chained prefix block ids (two requests share an id exactly when they share that
whole prefix), ``block_tokens`` tokens per block (512 in the published traces). The last block
of a prompt may be partial: ``input_length`` is the true token count. Tokens past the last id's
block (``input_length > len(hash_ids) * block_tokens``, as from generators that hash only whole
blocks) are an unhashed tail: input tokens that no cache could hold, so never hit.

A file is UTF-8 text (a byte-order mark is skipped), gzip-compressed or not. Its requests are
replayed in timestamp order: ``read_trace`` sorts them when the file is out of order.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import zlib
from dataclasses import dataclass
from operator import attrgetter
from typing import IO, Iterable, Iterator

from kvstore.errors import InvalidRequest

_GZIP_MAGIC = b"\x1f\x8b"
_BOM = "\ufeff"


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, index: int, block_tokens: int) -> int:
        """Real token count of block ``index``: ``block_tokens`` but for a partial last block (an
        unhashed tail past the last block is no block's: it never counts here)."""
        if index < len(self.hash_ids) - 1:
            return block_tokens
        return min(block_tokens, self.input_length - block_tokens * (len(self.hash_ids) - 1))


@dataclass(frozen=True)
class Trace:
    """A trace as read: its requests in timestamp order (equal timestamps in file order), and
    what reading it found."""

    requests: list[TraceRequest]
    reordered_requests: int = 0  # requests stamped earlier than one before them in the file
    unhashed_tail_requests: int = 0  # requests with tokens past their last id's block


def parse_request(obj: dict, block_tokens: int, where: str) -> TraceRequest:
    """One trace line's object as a request; ``InvalidRequest`` naming ``where`` if it is none."""
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where}: not a trace request (a JSON {type(obj).__name__}); expected an object "
                             "with keys input_length and hash_ids")
    missing = [key for key in ("input_length", "hash_ids") if key not in obj]
    if missing:
        raise InvalidRequest(f"{where}: not a trace request (no {' and no '.join(missing)}); expected keys "
                             "input_length and hash_ids")
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list):
        raise InvalidRequest(f"{where}: not a trace request (hash_ids is a JSON {_json_type(hash_ids)}, not a list "
                             "of block ids)")
    try:
        request = TraceRequest(_timestamp(obj.get("timestamp", 0)), _integer(obj["input_length"], "input_length"),
                               _integer(obj.get("output_length", 0), "output_length"),
                               tuple(_integer(h, "a hash id") for h in hash_ids))
    except ValueError as exc:
        raise InvalidRequest(f"{where}: not a trace request ({exc})") from None
    if not math.isfinite(request.timestamp):
        raise InvalidRequest(f"{where}: timestamp must be a finite number, got {request.timestamp}")
    blocks = len(request.hash_ids)
    if request.input_length < 0 or any(not 0 <= h < 1 << 128 for h in request.hash_ids):
        raise InvalidRequest(f"{where}: input_length must be non-negative and hash_ids in [0, 2**128)")
    if blocks and request.input_length <= block_tokens * (blocks - 1):
        raise InvalidRequest(
            f"{where}: input_length {request.input_length} leaves the last of {blocks} hash ids without a token at "
            f"{block_tokens} tokens a block (they need more than {block_tokens * (blocks - 1)}); check that "
            f"--block-tokens ({block_tokens}) is the trace's block size")
    return request


def _integer(value, name: str) -> int:
    """``value`` as an int if it is a whole JSON number (not a bool, a string or 1024.7); else
    ``ValueError`` naming the field."""
    if type(value) is int:  # the common case, first: a trace has millions of ids
        return value
    if isinstance(value, bool) or not isinstance(value, float) or not value.is_integer():
        raise ValueError(f"{name} {json.dumps(value)} is not a whole number")
    return int(value)


def _timestamp(value) -> float:
    """``value`` as a float (milliseconds in the Mooncake traces; a number in a string is taken as
    it always was), else ``ValueError`` naming the field."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"timestamp {json.dumps(value)} is not a number") from None
    except OverflowError:  # an integer beyond any float
        raise ValueError(f"timestamp {str(value)[:20]}... is too large for a number of milliseconds") from None


def _json_type(value) -> str:
    """The JSON name of a parsed value's type: number, string, object, boolean, null."""
    names = {bool: "boolean", int: "number", float: "number", str: "string", dict: "object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def read_trace(path: str, block_tokens: int = 512) -> Trace:
    """Every request of a JSONL trace (gzip or not), in timestamp order. A malformed line raises
    ``InvalidRequest`` naming the file and line; a damaged gzip file names the file."""
    try:
        with _open(path) as f:
            return _in_time_order(list(_parse_lines(f, block_tokens, path)), block_tokens)
    except FileNotFoundError:
        raise InvalidRequest(f"trace file {path} does not exist") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise InvalidRequest(f"{path}: damaged gzip data ({exc}); check it with gzip -t") from None


@contextlib.contextmanager
def _open(path: str) -> Iterator[IO[bytes]]:
    """``path`` for reading bytes, decompressed if it is gzip (known by its magic, not its name).
    Opened once and peeked at, so a pipe (``<(zcat ...)``, ``/dev/stdin``) reads whole."""
    with open(path, "rb") as raw:
        if raw.peek(len(_GZIP_MAGIC))[: len(_GZIP_MAGIC)] == _GZIP_MAGIC:
            with gzip.GzipFile(fileobj=raw, mode="rb") as unzipped:
                yield unzipped
        else:
            yield raw


def _parse_lines(lines: Iterable[bytes], block_tokens: int, path: str) -> Iterator[TraceRequest]:
    chains = ChainCheck()
    for number, raw in enumerate(lines, 1):
        where = f"{path}:{number}"
        line = _text(raw, where)
        if number == 1:
            line = line.removeprefix(_BOM)
        if not line.strip():
            continue
        request = parse_request(_json(line, where), block_tokens, where)
        chains.check(request, block_tokens, where)
        yield request


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{where}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1}); "
                             "save the trace as UTF-8") from None


def _json(line: str, where: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{where}: not JSON ({exc.msg})") from None
    except ValueError as exc:  # json's limit on integer digits
        raise InvalidRequest(f"{where}: a number too large to read ({exc.args[0].split(':')[0]}); "
                             "hash_ids must be in [0, 2**128)") from None
    except RecursionError:
        raise InvalidRequest(f"{where}: not a trace request (JSON nested too deeply)") from None


def _in_time_order(requests: list[TraceRequest], block_tokens: int) -> Trace:
    """``requests`` sorted stably by timestamp (a list already in order is kept as it is)."""
    reordered, latest = 0, -math.inf
    for request in requests:
        if request.timestamp < latest:
            reordered += 1
        else:
            latest = request.timestamp
    if reordered:
        requests.sort(key=attrgetter("timestamp"))
    tails = sum(1 for r in requests if r.input_length > block_tokens * len(r.hash_ids))
    return Trace(requests, reordered, tails)


class ChainCheck:
    """Checks that ``hash_ids`` are chained prefix ids across a trace: an id names one whole
    prefix, so it always follows the same id (or always starts a request) and always holds as
    many tokens (a partial last block and the full block a longer prompt has there are two
    blocks, with two ids). A trace that breaks this cannot be replayed as prefixes: a block would
    be its own ancestor or have two parents, or a hit on it would count tokens it never stored."""

    def __init__(self) -> None:
        # id -> (the id before it, its tokens, where first seen)
        self._seen: dict[int, tuple[int | None, int, str]] = {}

    def check(self, request: TraceRequest, block_tokens: int, where: str) -> None:
        hash_ids = request.hash_ids
        if len(set(hash_ids)) != len(hash_ids):
            raise InvalidRequest(f"{where}: a hash id appears twice in one request; hash_ids must be chained "
                                 "prefix ids (each names the whole prefix up to its block)")
        parent = None
        for index, block in enumerate(hash_ids):
            tokens = request.block_tokens(index, block_tokens)
            first = self._seen.setdefault(block, (parent, tokens, where))
            if first[0] != parent:
                raise InvalidRequest(
                    f"{where}: hash id {block} follows {_named(parent)} here but {_named(first[0])} at {first[2]}; "
                    "hash_ids must be chained prefix ids (each names the whole prefix up to its block)")
            if first[1] != tokens:
                raise InvalidRequest(
                    f"{where}: hash id {block} holds {tokens} tokens here but {first[1]} at {first[2]} "
                    f"(at {block_tokens} tokens a block); a partial last block and the block a longer prompt "
                    "fills there must have different ids, as their tokens differ")
            parent = block


def _named(parent: int | None) -> str:
    return "nothing (a request's start)" if parent is None else f"id {parent}"


def write_trace(target: str | IO[str], requests: Iterable[TraceRequest | dict]) -> None:
    """``requests`` as a JSONL trace to ``target``, a path or an open text file (standard output, say)."""
    if not isinstance(target, str):
        _write_lines(target, requests)
        return
    with open(target, "w") as f:
        _write_lines(f, requests)


def _write_lines(f: IO[str], requests: Iterable[TraceRequest | dict]) -> None:
    for request in requests:
        obj = request if isinstance(request, dict) else {
            "timestamp": request.timestamp, "input_length": request.input_length,
            "output_length": request.output_length, "hash_ids": list(request.hash_ids)}
        f.write(json.dumps(obj) + "\n")
