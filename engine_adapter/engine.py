"""The engine loop: the scheduler picks, the model runs, the scheduler post-processes.

    engine = Engine(model, PagePool(model.config, num_pages=256))
    outputs = engine.generate([prompt_ids, ...], max_new_tokens=32)   # -> [[token ids], ...]

One ``step()`` runs the scheduled work through the model: every decoding sequence (one new token,
``Work.is_decode``) together in ONE ``model.forward_decode`` call, then each other item (prefill
chunk, suffix after a prefix hit, a connector load's first forward) with its own ``model(...)``
call. It commits the blocks each sequence completed and samples where a sequence reached its last
known token. A model call that raises ends only the requests it ran (``RequestOutput.error``);
the others go on. Requests are checked when added: their tokens must be in the vocabulary and
their ids unique among unfinished requests. Prefix reuse, the connector and page accounting live in ``BlockManager``; admission,
chunking and preemption in ``Scheduler``.

The optional ``connector`` (``connectors.base.KVConnector``) serves blocks beyond the device hit,
receives the blocks the model computes, and (unless the pool already has an ``on_evict`` hook)
receives device pages about to be reused through ``connector.demote``. The engine knows nothing
about tokenization or the store's tiers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import NamedTuple

import torch

from connectors.base import KVConnector, LoadFailed
from engine_adapter.block_manager import BlockManager
from engine_adapter.model import DeepseekForCausalLM
from engine_adapter.fingerprint import weights_fingerprint
from engine_adapter.namespace import namespace_for
from engine_adapter.paged_cache import PagePool
from engine_adapter.sampling import sample
from engine_adapter.scheduler import Scheduler, Work
from engine_adapter.sequence import Request, RequestOutput, Sequence

log = logging.getLogger(__name__)


class Forwarded(NamedTuple):
    """Positions [start, start + count) of ``seq`` went through the model; ``last_logits`` [vocab]."""

    seq: Sequence
    start: int
    count: int
    last_logits: torch.Tensor


class Engine:
    def __init__(self, model: DeepseekForCausalLM, pool: PagePool, block_size: int | None = None,
                 chunk_size: int = 512, max_running: int = 64, model_name: str = "deepseek",
                 cache_salt: str = "", connector: KVConnector | None = None, weights_hash: str | None = None) -> None:
        """``weights_hash`` names the weights in the namespace; None fingerprints them
        (``engine_adapter.fingerprint``), so two checkpoints of one config never share KV."""
        if block_size is not None and block_size != pool.page_size:
            raise ValueError(f"block_size {block_size} must equal the pool's page_size {pool.page_size}")
        if model.lm_head.weight.device != pool.device:
            raise ValueError(f"model on {model.lm_head.weight.device}, pool on {pool.device}: use one device")
        self.model, self.pool = model, pool
        weights = weights_fingerprint(model) if weights_hash is None else weights_hash
        self.namespace = namespace_for(model.config, model_name, pool.page_size, cache_salt, weights, str(model.dtype))
        self.blocks = BlockManager(pool, self.namespace, model.dtype, connector)
        if connector is not None and pool.on_evict is None:  # evicted device pages go down a tier
            pool.on_evict = lambda block_hash, page, parent: connector.demote(block_hash, page, pool, parent)
        self.scheduler = Scheduler(self.blocks, chunk_size, max_running)
        self._unclaimed: list[RequestOutput] = []  # finished during a run() that did not add them

    def add_request(self, request: Request | Seq[int]) -> str:
        """Queue a request (or bare prompt ids, greedy with defaults); returns its request id.
        Raises ``ValueError``, queueing nothing, if a prompt token lies outside ``[0, vocab_size)``,
        the request id is already waiting or running, or the request could outgrow the pool."""
        [request_id] = self._add([request])
        return request_id

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns the requests that finished in it, or that it ended early
        (``RequestOutput.error``: a model call that raised ends only the requests it ran), and
        those of ``add_request`` that finished during a ``run`` (which returns only its own)."""
        work = self.scheduler.schedule()
        sampled, failed = self._forward(work)
        for seq, error in failed:  # before anything else can raise: a failed sequence must not run on
            self.scheduler.fail(seq, error)
        finished, self._unclaimed = self._unclaimed + self.scheduler.postprocess(work, sampled), []
        return finished

    @property
    def has_unfinished(self) -> bool:
        """Requests waiting or running, or finished ones the next ``step`` has yet to return."""
        return self.scheduler.has_unfinished or bool(self._unclaimed)

    def run(self, requests: Iterable[Request | Seq[int]]) -> list[RequestOutput]:
        """Add the requests (all or, raising like ``add_request``, none), step until they finish;
        their outputs in request order. Requests queued before with ``add_request`` run alongside;
        those that finish meanwhile come out of the next ``step`` (until session 34 they were lost)."""
        ids = self._add(requests)
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            assert self.scheduler.has_unfinished, "a request of this run is neither finished nor queued: engine bug"
            for out in self.step():
                if out.request_id in ids and out.request_id not in done:
                    done[out.request_id] = out
                else:
                    self._unclaimed.append(out)
        return [done[i] for i in ids]

    def generate(self, prompts: Iterable[Seq[int]], max_new_tokens: int = 16, temperature: float = 0.0,
                 seed: int = 0) -> list[list[int]]:
        """Output token ids for each prompt (request ``i`` is seeded ``seed + i``); raises
        ``RuntimeError`` if the engine ended one early."""
        requests = [Request(tuple(p), max_new_tokens, temperature, seed + i) for i, p in enumerate(prompts)]
        outputs = self.run(requests)
        failed = [f"{out.request_id}: {out.error}" for out in outputs if out.error is not None]
        if failed:
            raise RuntimeError(f"requests ended early: {'; '.join(failed)}")
        return [list(out.output_ids) for out in outputs]

    def reset_prefix_cache(self) -> int:
        """Drop the device prefix cache: pages no running request references are freed and no
        later request finds them (it loads them through the connector or computes them). Nothing
        is demoted to the connector. Returns how many pages were dropped."""
        return self.pool.drop_cached()

    def check_integrity(self) -> None:
        """Pool accounting holds, and exactly the running sequences' pages are referenced."""
        self.pool.check_integrity()
        expected = [0] * self.pool.num_pages
        for seq in self.scheduler.running:
            for page in seq.block_table:
                expected[page] += 1
        actual = [self.pool.ref_count(page) for page in range(self.pool.num_pages)]
        assert actual == expected, "page references do not match the running sequences' block tables"

    def _add(self, requests: Iterable[Request | Seq[int]]) -> list[str]:
        """Queue all of ``requests`` or, raising ``ValueError``, none; their request ids."""
        requests = [r if isinstance(r, Request) else Request(tuple(r)) for r in requests]
        for request in requests:
            self._check_tokens(request)
        self.scheduler.add([Sequence(r) for r in requests])
        return [r.request_id for r in requests]

    def _check_tokens(self, request: Request) -> None:
        """Every prompt token is a row of the embedding (one outside would fail every step it shares)."""
        vocab, ids = self.model.config.vocab_size, request.prompt_ids
        if min(ids) >= 0 and max(ids) < vocab:
            return
        position = next(i for i, t in enumerate(ids) if not 0 <= t < vocab)
        raise ValueError(f"{request.request_id}: prompt token {ids[position]} at position {position} is not in "
                         f"the model's vocabulary: token ids must lie in [0, {vocab})")

    def _forward(self, work: list[Work]) -> tuple[list[int | None], list[tuple[Sequence, str]]]:
        """Run the step's work: every decode in ONE call, then each other item in its own. Returns
        the sampled tokens (None where a sequence sampled none) and the sequences whose call
        raised, with the error: the exception is logged and ends only the sequences of that call.
        Whatever a call raises (KeyboardInterrupt too, which goes on up), its sequences' caches are
        cut back to where they were before it: a forward stopped midway has written some layers and
        not others, and the next forward would append each layer at a different position. What
        follows a call (commit, sampling) runs per sequence: its failure ends that sequence only."""
        sampled: list[int | None] = [None] * len(work)
        failed: list[tuple[Sequence, str]] = []
        decode = [i for i, item in enumerate(work) if item.is_decode]
        others = [[i] for i, item in enumerate(work) if not item.is_decode]
        for indices in ([decode] if decode else []) + others:
            before = [(work[i].seq, work[i].seq.num_cached_tokens) for i in indices]
            try:
                results = self._model_call([work[i] for i in indices])
            except BaseException as exc:
                for seq, length in before:
                    if seq.cache is not None:
                        seq.cache.truncate(length)
                if not isinstance(exc, Exception):
                    raise
                ids = ", ".join(work[i].seq.request_id for i in indices)  # e.g. out of device memory: the rest go on
                log.exception("the model call for %s raised; the engine ends it and goes on", ids)
                failed += [(work[i].seq, f"{type(exc).__name__}: {exc}") for i in indices]
                continue
            for i, result in zip(indices, results):
                if result is None:  # its load failed: the next step recomputes
                    continue
                try:
                    sampled[i] = self._computed(*result)
                except Exception as exc:
                    log.exception("finishing the forward of %s raised; the engine ends it", work[i].seq.request_id)
                    failed.append((work[i].seq, f"{type(exc).__name__}: {exc}"))
        return sampled, failed

    def _model_call(self, items: list[Work]) -> list[Forwarded | None]:
        """One model call: a batch of decodes, or one other item; what each forwarded, in order."""
        if items[0].is_decode:
            return self._decode([item.seq for item in items])
        [item] = items
        return [self._run(item)]

    def _decode(self, seqs: list[Sequence]) -> list[Forwarded]:
        """Forward the next token of every sequence in ONE batched call."""
        if not seqs:
            return []
        starts = [seq.num_cached_tokens for seq in seqs]
        token_ids = torch.tensor([seq.token_ids[start] for seq, start in zip(seqs, starts)], device=self.pool.device)
        positions = torch.tensor(starts, device=self.pool.device)
        logits = self.model.forward_decode(token_ids, positions, [seq.cache for seq in seqs])  # [B, vocab]
        return [Forwarded(seq, start, 1, row) for seq, start, row in zip(seqs, starts, logits)]

    def _run(self, item: Work) -> Forwarded | None:
        """Forward ``item``'s tokens; None where its connector load failed (nothing computed)."""
        seq, count = item
        start = seq.num_cached_tokens
        token_ids = torch.tensor(seq.token_ids[start : start + count], device=self.pool.device)
        positions = torch.arange(start, start + count, device=self.pool.device)
        try:
            logits = self.model(token_ids, positions, seq.cache)  # [count, vocab]
            if seq.load is not None:
                self.blocks.finish_load(seq)
        except LoadFailed:
            self.blocks.abort_load(seq)  # the next step recomputes from the device hit
            return None
        return Forwarded(seq, start, count, logits[-1])

    def _computed(self, seq: Sequence, start: int, count: int, last_logits: torch.Tensor) -> int | None:
        """Positions [start, start + count) are cached: count, commit, and sample if at the end."""
        seq.stats.computed_prompt_tokens += max(0, min(start + count, seq.num_prompt_tokens) - start)
        self.blocks.commit(seq)
        if seq.num_uncomputed_tokens:
            return None
        return sample(last_logits, seq.request.temperature, seq.generator)
