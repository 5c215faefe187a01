"""In-flight batching: which requests run in the next engine forward, and how many of their tokens.

Two small policies, composed in :meth:`Scheduler.schedule` (TensorRT-LLM's capacity scheduler + micro-batch
scheduler):

1. **Capacity (admission)** -- first come, first served: a waiting request is admitted when a batch slot is
   free (``max_batch_size``) and its :class:`BatchSchedulerPolicy` (TensorRT-LLM's
   ``batch_scheduler_policy``) says its KV blocks fit:

   - ``max_utilization``: the KV-cache manager can hold its whole *current* sequence (prompt, plus the
     tokens generated before a preemption). When a generation-phase request later needs a new block and
     none is free, the most recently admitted running request is preempted: its blocks are freed and it
     returns to the front of the waiting queue, to be recomputed (as one context) when blocks free up.
   - ``guaranteed_no_evict``: the blocks of its *worst case* (prompt + ``max_tokens``, capped by its
     ``max_num_tokens``) fit next to the worst case every running request may still grow to (each running
     request's remaining blocks are reserved, as TensorRT-LLM's ``GuaranteedNoEvictScheduler`` does).
     Fewer requests run at once, but none is ever preempted.

   Admission stops at the first request that does not fit, so a long prompt is never starved by shorter
   ones behind it.
2. **Packing (this iteration)** -- within the token budget ``max_num_tokens``: generation-phase requests
   first (one token each, growing their block table as they cross a block boundary; with speculative
   decoding also the draft tokens a proposer offers, :mod:`kilnlm.runtime.speculative`), then context-phase
   requests in admission order. A context whose next prompt block another running request is computing
   waits for it and then takes it from the prefix cache, so requests that arrive together compute a
   shared prefix once (:mod:`kilnlm.runtime.kv_cache`). With chunked context (``enable_chunked_context``)
   each gets the largest chunk of its pending tokens that still fits (a long prompt spreads over several
   iterations while others keep decoding); without it a context is scheduled only when all its pending
   tokens fit, and it and the contexts behind it wait otherwise (a recomputation after preemption longer
   than ``max_num_tokens`` is the one context still chunked: it could never fit whole).

Requests join and leave between iterations.

After the forward, :meth:`Scheduler.update` applies the step to the requests: it advances
``num_computed_tokens``, registers newly full blocks for prefix reuse, appends each sampled token and
finishes the requests that sampled an end id or reached their length (freeing their blocks). Stop strings
are text, so the output processor finds those (:mod:`kilnlm.runtime.output_processor`) and the executor
then finishes the request here with :meth:`Scheduler.finish`.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.kv_cache import KVCacheManager
from kilnlm.runtime.request import FinishReason, Request, RequestStatus
from kilnlm.runtime.speculative import Proposer, speculates


class BatchSchedulerPolicy(str, enum.Enum):
    """TensorRT-LLM's ``batch_scheduler_policy`` (its ``CapacitySchedulerPolicy``): how requests are admitted
    into the KV cache. See the module docstring."""

    MAX_UTILIZATION = "max_utilization"
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"

    @classmethod
    def from_name(cls, name: str) -> "BatchSchedulerPolicy":
        """The policy called ``name``. Raises :class:`KilnError` naming the choices for any other name."""
        try:
            return cls(name)
        except ValueError:
            raise KilnError(f"batch_scheduler_policy is {name!r}: it must be one of "
                            f"{', '.join(p.value for p in cls)}") from None


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int  # sequences per forward
    max_num_tokens: int  # packed new tokens per forward (context chunks + generation tokens)
    policy: BatchSchedulerPolicy = BatchSchedulerPolicy.MAX_UTILIZATION
    enable_chunked_context: bool = True  # off: a context runs only when all its pending tokens fit a step


@dataclass
class ScheduledSeq:
    """One sequence of the batch: its tokens ``token_ids[start:start + num_new_tokens]`` are computed this
    step (``start == request.num_computed_tokens``)."""

    request: Request
    num_new_tokens: int
    # speculative decoding: tokens proposed to follow token_ids, verified by this step's forward
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens this sequence packs into the forward: its new tokens and its draft tokens."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def completes_sequence(self) -> bool:
        """True if this step computes the request's last pending token, so its logits are sampled (a
        non-final context chunk yields logits that are discarded)."""
        return self.num_new_tokens == self.request.num_pending_tokens


@dataclass
class ScheduledBatch:
    """What the next engine forward computes: generation-phase sequences first, then context chunks."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # requests that lost their blocks this step
    num_generation_seqs: int = 0  # the leading seqs in the generation phase; the rest are context chunks

    @property
    def num_context_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs[self.num_generation_seqs :])

    @property
    def num_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.seqs)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(s.draft_token_ids) for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Owns the waiting queue and the running list; asks the :class:`KVCacheManager` for blocks.

    Not thread-safe: only the executor's loop thread calls it.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, proposer: Proposer | None = None) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.proposer = proposer  # speculative decoding's draft tokens (None: off)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._capacity = _CAPACITY_POLICIES[BatchSchedulerPolicy(config.policy)]

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished, cancelled or failed) and free its blocks. Idempotent."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)
        if self.proposer is not None:
            self.proposer.release(request.request_id)

    def finish(self, request: Request, reason: FinishReason, error_message: str | None = None) -> None:
        """End the request with ``reason``: take it out and free its blocks (:meth:`remove`), mark it
        finished. Calling it again only replaces the reason (a stop string found after the length was
        reached; an error while its final response was being made)."""
        self.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.error_message = error_message

    def update(self, batch: ScheduledBatch, sampled_token_ids: Sequence[Sequence[int]]) -> list[Request]:
        """Apply the forward of ``batch`` to its requests.

        ``sampled_token_ids``: per sequence of ``batch`` that completed its pending tokens
        (:attr:`ScheduledSeq.completes_sequence`), in batch order, the tokens the step yields: one, or with
        draft tokens the accepted drafts' successors too (:func:`kilnlm.runtime.speculative.verify_greedy`:
        ``tokens[i]`` equals draft ``i`` for every ``i < len(tokens) - 1``); empty when sampling failed
        (those requests were finished already and are skipped). Every sequence's ``num_computed_tokens``
        advances by its new tokens and its accepted drafts, the slots of rejected drafts are trimmed, and its
        full blocks of computed tokens are registered for prefix reuse; the yielded tokens are then appended
        in order until one is an end id (finish "end_id", that token is not part of the output) or the
        request reaches ``max_tokens`` or its ``max_num_tokens`` (finish "length", later tokens dropped).
        ``request.num_step_tokens`` counts the tokens appended. Finished requests' blocks are freed.

        Returns the requests that received tokens, in batch order: running with them appended, or finished
        ("end_id" or "length").
        """
        updated: list[Request] = []
        tokens = iter(sampled_token_ids)
        kv_cache = self.kv_cache
        for seq in batch.seqs:
            request = seq.request
            if request.status is RequestStatus.FINISHED:  # failed in sampling
                continue
            completes_sequence = seq.num_new_tokens == request.num_pending_tokens
            request.num_computed_tokens += seq.num_new_tokens
            if not completes_sequence:
                kv_cache.cache_computed_blocks(request.request_id, request.token_ids, request.num_computed_tokens)
                continue
            step_tokens = next(tokens)
            computed = request.token_ids
            if seq.draft_token_ids:
                num_accepted = len(step_tokens) - 1
                request.num_computed_tokens += num_accepted
                computed = computed + seq.draft_token_ids[:num_accepted]
                kv_cache.trim_slots(request.request_id, request.num_computed_tokens + 1)
            kv_cache.cache_computed_blocks(request.request_id, computed, request.num_computed_tokens)
            request.num_step_tokens = 0
            for token_id in step_tokens:
                self._append_token(request, token_id)
                if request.finished:
                    break
            updated.append(request)
        return updated

    def _append_token(self, request: Request, token_id: int) -> None:
        if request.first_token_time_s is None:
            request.first_token_time_s = time.monotonic()
        if token_id in request.end_ids:
            self.finish(request, FinishReason.END_ID)
            return
        request.token_ids.append(token_id)
        request.num_step_tokens += 1
        if request.num_generated_tokens >= request.params.max_tokens or request.num_tokens >= request.max_num_tokens:
            self.finish(request, FinishReason.LENGTH)

    def schedule(self) -> ScheduledBatch:
        """The next iteration's batch: admit what fits in the KV cache, then pack generation tokens and
        context chunks into the token budget. Empty only when nothing is running."""
        self._admit()
        batch = ScheduledBatch()
        token_budget = self._schedule_generation(batch, self.config.max_num_tokens)
        batch.num_generation_seqs = len(batch.seqs)
        self._schedule_context(batch, token_budget)
        return batch

    # ------------------------------------------------------------------------------------ policies
    def _admit(self) -> None:
        """Capacity policy: FCFS admission while a batch slot exists and the policy says the KV blocks fit."""
        while self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            if not self._capacity.fits(request, self.running, self.kv_cache):
                return
            num_cached_tokens = self.kv_cache.allocate(request.request_id, request.token_ids)
            if num_cached_tokens is None:
                return
            self.waiting.popleft()
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time_s is None:
                request.first_scheduled_time_s = time.monotonic()
            self.running.append(request)

    def _schedule_generation(self, batch: ScheduledBatch, token_budget: int) -> int:
        """One token for each generation-phase request, plus its draft tokens when it speculates and their
        slots are free (drafts never preempt); when blocks run out for the token itself, preempt from the
        back (``max_utilization``) or let the request wait a step (``guaranteed_no_evict``, where its
        reserved blocks make that impossible)."""
        proposals = self._propose_all([r for r in self.running if self._in_generation_phase(r)], token_budget)
        for request in list(self.running):
            if request not in self.running or not self._in_generation_phase(request) or token_budget == 0:
                continue
            drafts = proposals.get(request.request_id, [])[: token_budget - 1]
            granted = self.kv_cache.append_slots(request.request_id, request.num_tokens + len(drafts))
            if not granted and drafts:
                drafts = []
                granted = self.kv_cache.append_slots(request.request_id, request.num_tokens)
            while not granted and self._capacity.preempts:
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is request:
                    break
                granted = self.kv_cache.append_slots(request.request_id, request.num_tokens)
            if granted:
                batch.seqs.append(ScheduledSeq(request, 1, drafts))
                token_budget -= 1 + len(drafts)
        return token_budget

    def _propose_all(self, requests: list[Request], token_budget: int) -> dict[str, list[int]]:
        """Draft tokens for the step's generation-phase ``requests``, asked of the proposer in one call: each
        request may draft what the token budget leaves after the requests before it took their token and
        drafts (:meth:`_draft_limit`)."""
        if self.proposer is None:
            return {}
        items = []
        for request in requests:
            limit = self._draft_limit(request, token_budget - 1)
            if limit > 0:
                items.append((request, limit))
            token_budget -= 1 + min(limit, self.proposer.config.num_speculative_tokens)
        return {request.request_id: drafts for (request, _), drafts in zip(items, self.proposer.propose_batch(items))}

    def _draft_limit(self, request: Request, max_tokens: int) -> int:
        """How many draft tokens ``request`` may take this step: none for a request that does not speculate
        or while more requests run than the config's ``disable_by_batch_size``; else at most ``max_tokens``
        and the request's ``num_speculative_tokens``, and no more than could still be accepted (a step yields
        up to one token past its drafts: ``max_tokens`` and ``max_num_tokens`` bound the request)."""
        busy = self.proposer.config.disable_by_batch_size
        if not speculates(request) or (busy is not None and len(self.running) > busy):
            return 0
        cap = request.params.num_speculative_tokens
        return min(max_tokens, request.params.max_tokens - request.num_generated_tokens - 1,
                   request.max_num_tokens - request.num_tokens, max_tokens if cap is None else cap)

    def _schedule_context(self, batch: ScheduledBatch, token_budget: int) -> None:
        """Pending context tokens, in admission order, while the token budget lasts: the largest chunk that
        fits, or (without chunked context) all of them or nothing, this context and those behind it
        waiting for a step with room."""
        for request in self.running:
            if token_budget == 0:
                return
            if self._in_generation_phase(request):
                continue
            # a prefix shared with requests admitted with it: take what they computed, wait for what they compute
            request.num_computed_tokens = self.kv_cache.reuse_computed_prefix(request.request_id,
                                                                              request.num_computed_tokens)
            if self.kv_cache.waits_for_prefix(request.request_id, request.num_computed_tokens):
                continue
            num_pending = request.num_pending_tokens
            chunked = self.config.enable_chunked_context or num_pending > self.config.max_num_tokens
            if num_pending > token_budget and not chunked:
                return
            num_new_tokens = min(num_pending, token_budget)
            batch.seqs.append(ScheduledSeq(request, num_new_tokens))
            token_budget -= num_new_tokens

    # ----------------------------------------------------------------------------------- internals
    @staticmethod
    def _in_generation_phase(request: Request) -> bool:
        return request.num_pending_tokens == 1 and request.num_generated_tokens > 0

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        batch.preempted.append(request)


# ----------------------------------------------------------------------------------- capacity policies
class _MaxUtilization:
    """Admit while the blocks of the current sequence are free; generation preempts when they run out."""

    preempts = True

    @staticmethod
    def fits(request: Request, running: list[Request], kv_cache: KVCacheManager) -> bool:
        return kv_cache.can_allocate(request.token_ids)


class _GuaranteedNoEvict:
    """Admit only when the request's worst case fits next to every running request's remaining worst case
    (its blocks up to ``max_num_tokens`` not yet allocated); never preempt."""

    preempts = False

    @staticmethod
    def fits(request: Request, running: list[Request], kv_cache: KVCacheManager) -> bool:
        num_reserved = sum(kv_cache.num_missing_blocks(r.request_id, r.max_num_tokens) for r in running)
        num_needed = kv_cache.num_blocks_to_allocate(request.token_ids, request.max_num_tokens)
        return num_needed <= kv_cache.num_free_blocks - num_reserved


_CAPACITY_POLICIES = {BatchSchedulerPolicy.MAX_UTILIZATION: _MaxUtilization(),
                      BatchSchedulerPolicy.GUARANTEED_NO_EVICT: _GuaranteedNoEvict()}
