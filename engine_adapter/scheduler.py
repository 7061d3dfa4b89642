"""Which sequences run in the next step, and with how many tokens.

A step has a budget of ``chunk_size`` tokens. Running sequences come first, in admission order:
each gets ``min(uncomputed tokens, budget left)`` (1 for a decoding sequence, a chunk of its prompt
for a prefilling one, so a long prompt is prefilled over several steps). Then waiting sequences
are admitted first come, first served while budget, ``max_running`` and free pages allow; the
head of the queue is never skipped. Every running sequence takes at least a token a step, so at
most ``chunk_size`` run at once whatever ``max_running`` says (a larger one admits no more).

When a running sequence needs a page and none is left, the most recently admitted sequence is
preempted: its pages are released (the registered ones stay cached, so readmission finds most of
them again) and it goes back to the front of the queue to recompute what it lost.

A waiting sequence whose admission raises (hashing its prompt, the connector's lookup or load)
is ended with the error, holding nothing; the queue goes on behind it.

A running sequence with nothing left to compute (an engine step raised after computing its last
token, before the token was appended) is never scheduled: it is ended with an error instead.

This module knows sequences and token counts; pages go through the ``BlockManager``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import NamedTuple

from engine_adapter.block_manager import BlockManager
from engine_adapter.sequence import RequestOutput, Sequence

log = logging.getLogger(__name__)


class Work(NamedTuple):
    seq: Sequence
    num_tokens: int  # positions [seq.num_cached_tokens, + num_tokens) run this step

    @property
    def is_decode(self) -> bool:
        """One new token and no connector load in flight: batched with the step's other decodes.
        (A load's first forward runs alone, so a failed load aborts only its own sequence.)"""
        return self.num_tokens == 1 and self.seq.load is None


class Scheduler:
    def __init__(self, blocks: BlockManager, chunk_size: int, max_running: int) -> None:
        if chunk_size <= 0 or max_running <= 0:
            raise ValueError(f"chunk_size and max_running must be positive, got {chunk_size}, {max_running}")
        self.blocks, self.chunk_size, self.max_running = blocks, chunk_size, max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ended: list[RequestOutput] = []  # outputs of sequences ended since the last postprocess

    def add(self, seqs: list[Sequence]) -> None:
        """Queue ``seqs`` in order, all or none: raises ``ValueError`` (nothing queued) if one could
        outgrow the pool or has the request id of a sequence waiting, running or before it in ``seqs``."""
        taken = {seq.request_id for seq in (*self.waiting, *self.running)}
        for seq in seqs:
            self._check_fits(seq)
            if seq.request_id in taken:
                raise ValueError(f"request id {seq.request_id!r} is already waiting or running: give each "
                                 "unfinished request its own id (an empty request_id gets a unique one)")
            taken.add(seq.request_id)
        self.waiting.extend(seqs)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Work]:
        """The next step's work; every item has at least one token."""
        budget, work = self.chunk_size, []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted for the pages of one before it
                continue
            if not seq.num_uncomputed_tokens:  # a step raised after computing its last token: the token is lost
                self.fail(seq, "an engine step raised after computing its last token")
                continue
            count = min(seq.num_uncomputed_tokens, budget)
            if self._reserve(seq, count):
                work.append(Work(seq, count))
                budget -= count
        while budget and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            try:
                admitted = self.blocks.admit(seq)
            except Exception as exc:  # kept at the head, it would raise again every step
                log.exception("admitting %s raised; the engine ends it and goes on", seq.request_id)
                self.waiting.popleft()
                self._ended.append(seq.output(f"{type(exc).__name__}: {exc}"))
                continue
            if not admitted:
                break
            self.running.append(self.waiting.popleft())
            count = min(seq.num_uncomputed_tokens, budget)
            work.append(Work(seq, count))
            budget -= count
        return work

    def postprocess(self, work: list[Work], sampled: list[int | None]) -> list[RequestOutput]:
        """Append each sampled token (None: the sequence produced none this step); finish sequences.
        Returns the finished ones, and those ended early since the last call (``fail``). An output
        is queued as its sequence ends, so none is lost if this raises midway: the next call has it."""
        for (seq, _), token in zip(work, sampled):
            if token is None:
                continue
            seq.token_ids.append(token)
            if seq.stats.ttft_s is None:
                seq.stats.ttft_s = time.perf_counter() - seq.arrival
                self.blocks.prefill_done(seq)
            if seq.is_finished:
                self.running.remove(seq)
                self.blocks.free(seq)
                self._ended.append(seq.output())
        finished, self._ended = self._ended, []
        return finished

    def fail(self, seq: Sequence, error: str) -> None:
        """End the running ``seq`` early: release what it holds; its output, carrying ``error``,
        comes with the next ``postprocess``."""
        self.running.remove(seq)
        self.blocks.free(seq)
        self._ended.append(seq.output(error))

    def _check_fits(self, seq: Sequence) -> None:
        longest = seq.num_prompt_tokens + seq.request.max_new_tokens - 1  # the last token sampled is never cached
        if self.blocks.pages_for(longest) > self.blocks.pool.num_pages:
            raise ValueError(f"{seq.request_id} may reach {longest} tokens = {self.blocks.pages_for(longest)} "
                             f"pages; the pool has {self.blocks.pool.num_pages}")

    def _reserve(self, seq: Sequence, count: int) -> bool:
        """Pages for ``count`` more tokens of ``seq``, preempting from the back; False if ``seq`` itself went."""
        while not self.blocks.reserve(seq, count):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.stats.preemptions += 1
        self.waiting.appendleft(seq)
