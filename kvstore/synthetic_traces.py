"""Seeded synthetic KV-cache traces in the Mooncake trace format.

Each generator returns a list of dicts ``{timestamp (ms, int), input_length, output_length,
hash_ids}`` sorted by timestamp, where ``hash_ids`` are chained prefix block ids of ``block``
tokens (the last block may be partial), exactly like
the published Mooncake trace (see ``kvstore.trace``).

Prompts are built from immutable *segments* (a system prompt, a user message, a model output,
a tool result, a document): each segment is a unique token string with an id, and a prompt is a
list of segments. A block's id is derived from the chained hash of the segment pieces it
covers, so two prompts share a block id exactly when they share the whole prefix up to the end
of that block (a partial last block differs from the full block that later replaces it).

    multi_turn_chat(seed, ...)  conversations that grow turn by turn over shared system prompts
    agent_sessions(seed, ...)   agent loops: long shared tool prefixes, a growing transcript,
                                short parallel branches (tool calls), one-off large documents
"""

from __future__ import annotations

import math
import random
from itertools import count

__all__ = ["multi_turn_chat", "agent_sessions", "GENERATORS"]


class _Blocks:
    """Maps segment lists to chained block ids (ids allocated in order of first appearance)."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.ids: dict[tuple, int] = {}
        self.segments = count()

    def new_segment(self) -> int:
        return next(self.segments)

    def hash_ids(self, segments: list[tuple[int, int]]) -> list[int]:
        out: list[int] = []
        parent = None
        pieces: list[tuple[int, int, int]] = []
        used = 0
        for seg, length in segments:
            pos = 0
            while pos < length:
                take = min(length - pos, self.block - used)
                pieces.append((seg, pos, pos + take))
                pos += take
                used += take
                if used == self.block:
                    parent = self._id(parent, pieces)
                    out.append(parent)
                    pieces, used = [], 0
        if pieces:
            out.append(self._id(parent, pieces))
        return out

    def _id(self, parent, pieces) -> int:
        key = (parent, tuple(pieces))
        got = self.ids.get(key)
        if got is None:
            got = self.ids[key] = len(self.ids)
        return got


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int = 1, hi: int = 10**7) -> int:
    return int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def _finish(requests: list[tuple[float, int, int, list]], blocks: _Blocks) -> list[dict]:
    requests.sort(key=lambda r: (r[0], r[1]))
    out = []
    for t, _, out_len, segs in requests:
        ids = blocks.hash_ids(segs)
        out.append({"timestamp": int(t), "input_length": sum(n for _, n in segs),
                    "output_length": out_len, "hash_ids": ids})
    return out


def multi_turn_chat(seed: int, n_conversations: int = 1500, duration_s: float = 1800.0,
                    n_system_prompts: int = 6, mean_turns: float = 4.0, zipf_s: float = 1.1,
                    think_median_s: float = 25.0, block: int = 512,
                    max_context: int = 128_000) -> list[dict]:
    """Multi-turn chat: each turn's input = previous input + previous output + a new user message.

    - a few shared system prompts (Zipf-popular, 300..6000 tokens); some conversations start
      with a pasted document (one-off, 2K..30K tokens);
    - number of turns per conversation: geometric with mean ``mean_turns``, times a heavy-tailed
      engagement factor (Zipf over conversations: a few conversations run for dozens of turns);
    - user messages lognormal (median 120 tokens), outputs lognormal (median 350 tokens);
    - think time between turns lognormal (median ``think_median_s``, heavy tail: some users come
      back many minutes later), plus decode time (~30 tokens/s);
    - conversation starts are Poisson over ``duration_s``; requests past it are dropped.
    """
    rng = random.Random(seed)
    blocks = _Blocks(block)
    sys_prompts = [(blocks.new_segment(), _lognormal(rng, 1500, 0.9, 300, 6000)) for _ in range(n_system_prompts)]
    sys_w = _zipf_weights(n_system_prompts, 1.0)
    engagement = _zipf_weights(n_conversations, zipf_s)
    rng.shuffle(engagement)
    mean_eng = sum(engagement) / n_conversations
    requests = []
    seq = count()
    for c in range(n_conversations):
        t = rng.uniform(0, duration_s)
        mean = max(1.0, mean_turns * min(8.0, (engagement[c] / mean_eng) ** 0.5))
        turns = 1 + int(rng.expovariate(1.0 / (mean - 1))) if mean > 1 else 1
        segs = [rng.choices(sys_prompts, sys_w)[0]]
        if rng.random() < 0.15:
            segs.append((blocks.new_segment(), _lognormal(rng, 8000, 0.8, 2000, 30000)))
        for _ in range(turns):
            if t > duration_s:
                break
            segs = segs + [(blocks.new_segment(), _lognormal(rng, 120, 1.0, 5, 4000))]
            n_in = sum(n for _, n in segs)
            if n_in > max_context:
                break
            out_len = _lognormal(rng, 350, 0.8, 10, 4000)
            requests.append((t * 1000.0, next(seq), out_len, list(segs)))
            segs = segs + [(blocks.new_segment(), out_len)]
            t += out_len / 30.0 + _lognormal(rng, think_median_s, 1.2, 1, 3600)
    return _finish(requests, blocks)


def agent_sessions(seed: int, n_sessions: int = 300, duration_s: float = 1800.0,
                   n_agent_types: int = 8, block: int = 512, max_context: int = 128_000,
                   branch_prob: float = 0.35, doc_prob: float = 0.05) -> list[dict]:
    """Agent workloads.

    - a handful of agent types, each with a long shared system + tool-definition prefix
      (4K..24K tokens, Zipf-popular);
    - a session is a loop of steps (geometric, mean ~20): each step sends the whole transcript;
      the model's tool call (short) and the tool result (lognormal, median 400 tokens, heavy
      tail) are appended; tool latency 0.5..30 s between steps;
    - with ``branch_prob`` a step fans out into 2..6 parallel short branches (sub-calls,
      retries, candidate plans) that share the transcript and add a short distinct suffix; only
      one of them, if any, continues the transcript;
    - with ``doc_prob`` a step is a one-off large document request (8K..60K tokens pasted after
      the agent prefix: summarise / extract), never continued;
    - sessions start Poisson over ``duration_s``; requests past it are dropped.
    """
    rng = random.Random(seed)
    blocks = _Blocks(block)
    prefixes = [(blocks.new_segment(), _lognormal(rng, 9000, 0.6, 4000, 24000)) for _ in range(n_agent_types)]
    pw = _zipf_weights(n_agent_types, 1.0)
    requests = []
    seq = count()
    for _ in range(n_sessions):
        t = rng.uniform(0, duration_s)
        steps = 1 + int(rng.expovariate(1.0 / 20.0))
        prefix = rng.choices(prefixes, pw)[0]
        transcript = [prefix, (blocks.new_segment(), _lognormal(rng, 300, 1.0, 20, 8000))]  # task
        for _ in range(steps):
            if t > duration_s or sum(n for _, n in transcript) > max_context:
                break
            if rng.random() < doc_prob:
                doc = [prefix, (blocks.new_segment(), _lognormal(rng, 20000, 0.6, 8000, 60000))]
                requests.append((t * 1000.0, next(seq), _lognormal(rng, 300, 0.7), doc))
                t += rng.uniform(0.2, 3.0)
            if rng.random() < branch_prob:
                fan = rng.randint(2, 6)
                for b in range(fan):
                    suffix = (blocks.new_segment(), _lognormal(rng, 150, 0.8, 10, 2000))
                    requests.append((t * 1000.0 + rng.uniform(0, 500), next(seq),
                                     _lognormal(rng, 120, 0.8), transcript + [suffix]))
                if rng.random() < 0.5:
                    transcript = transcript + [suffix]  # the last branch's result is kept
                t += rng.uniform(1.0, 15.0)
                continue
            out_len = _lognormal(rng, 80, 0.8, 5, 2000)  # the tool call
            requests.append((t * 1000.0, next(seq), out_len, list(transcript)))
            transcript = transcript + [(blocks.new_segment(), out_len),
                                       (blocks.new_segment(), _lognormal(rng, 400, 1.3, 10, 20000))]
            t += out_len / 50.0 + _lognormal(rng, 3.0, 1.0, 0.5, 120)
    return _finish(requests, blocks)


GENERATORS = {"chat": multi_turn_chat, "agent": agent_sessions}
